"""Language-model losses shared by the recipes.

All take logits ``[B, S, V]`` and labels ``[B, S]`` (``ignore_index`` = −100 marks
positions without a target) and run without host synchronisation: no boolean
indexing, so a step on CUDA never waits for the host.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._errors import ShapeError

__all__ = ["IGNORE_INDEX", "shift_labels", "cross_entropy", "z_loss", "abstention_loss"]

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, offset: int = 1, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels[:, t + offset]`` at position t, ``ignore_index`` for the last ``offset``
    positions: "predict token t+offset at t" without slicing the logits."""
    out = torch.full_like(labels, ignore_index)
    if labels.shape[1] > offset:
        out[:, :-offset] = labels[:, offset:]
    return out


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ShapeError(f"`labels` must have shape {tuple(logits.shape[:-1])} (logits without the vocab dim), "
                         f"got {tuple(labels.shape)}")


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, reduction: str = "mean",
                  num_items: int | torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross entropy in fp32 over the positions whose label is not ``ignore_index``.

    ``reduction``: "mean" (over valid labels; 0, with a gradient path, when there are
    none), "sum", or "none" (``[...]`` per position, 0 where ignored). ``num_items``
    divides the sum instead of the valid count (Naylis' ``num_items_in_batch``).
    """
    _check(logits, labels)
    per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                          ignore_index=ignore_index, reduction="none").view(labels.shape)
    if reduction == "none":
        return per
    total = per.sum()
    if reduction == "sum":
        return total
    if num_items is not None:
        return total / num_items
    return total / (labels != ignore_index).sum().clamp_min(1)


def z_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``mean(logsumexp(logits)²)`` over positions with a valid label (fp32; 0 if none)."""
    _check(logits, labels)
    valid = labels != ignore_index
    log_z = torch.logsumexp(logits.float(), dim=-1)
    sq = torch.where(valid, log_z.square(), torch.zeros_like(log_z))
    return sq.sum() / valid.sum().clamp_min(1)


def abstention_loss(abstain_logit: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                    pos_weight: float = 8.0, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """BCE of ``abstain_logit`` ``[B, S]`` against "the top-1 prediction is wrong",
    ``pos_weight`` on the wrong class, mean over valid positions (0 if none)."""
    _check(logits, labels)
    valid = labels != ignore_index
    wrong = (logits.detach().argmax(-1) != labels).float()
    per = F.binary_cross_entropy_with_logits(
        abstain_logit.float(), wrong, reduction="none",
        pos_weight=torch.tensor(pos_weight, device=abstain_logit.device))
    per = torch.where(valid, per, torch.zeros_like(per))
    return per.sum() / valid.sum().clamp_min(1)
