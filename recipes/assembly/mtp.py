"""Multi-token prediction heads (SpikeWhale v2 form): head k maps the final hidden
state to a state predicting token t+k+1 through the model's *shared* LM head:

    h_k = h + proj_k(h)            proj_k: H×H, zero-init (head k starts as the LM head)

``mtp_loss`` averages the cross entropy of every head whose offset fits the sequence.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from laminae.primitives._validation import check_positive_int
from laminae.primitives.blocks.losses import IGNORE_INDEX, cross_entropy

__all__ = ["MTPHead", "mtp_loss"]


class MTPHead(nn.Module):
    """``proj`` [H, H] (zeros). ``forward(h [..., H]) = h + proj(h)``."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.proj(hidden)


def mtp_loss(heads: Sequence[nn.Module], hidden: torch.Tensor, labels: torch.Tensor,
             logits_fn: Callable[[torch.Tensor], torch.Tensor], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean over heads k = 1..K (offset k+1 < S) of CE(logits_fn(head_k(h[:, :-(k+1)])),
    labels[:, k+1:]). ``labels`` are unshifted (``labels = input_ids``). 0 if no head fits."""
    total, active = hidden.new_zeros((), dtype=torch.float32), 0
    for k, head in enumerate(heads, start=1):
        offset = k + 1
        if hidden.shape[1] <= offset:
            continue
        logits = logits_fn(head(hidden[:, :-offset]))
        total = total + cross_entropy(logits, labels[:, offset:], ignore_index=ignore_index)
        active += 1
    return total / active if active else total
