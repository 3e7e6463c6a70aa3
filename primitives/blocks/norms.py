"""RMSNorm: the one implementation, in the variants the seeds use.

``rms_norm(x, weight, eps, upcast=..., upcast_weight=..., group_size=...)``:

    y = x · rsqrt(mean(x², over the last dim or each group) + eps) · weight

- ``upcast=True`` (Llama, Naylis, ShellElastic): statistics and normalisation in fp32
  (fp64 stays fp64), the result cast back to ``x.dtype`` *before* the gain (HF
  ``LlamaRMSNorm``).
- ``upcast=True, upcast_weight=True`` (SiameseNorm): the gain too is applied in fp32 and
  the result rounded once, to ``x.dtype``, at the end (what the fused boundary kernel does).
- ``upcast=False`` (SpikeWhale, HRM refinement, the Engram fusion gate): everything in
  the input dtype.
- ``group_size``: statistics per group of that many features (per-head QK norm over a
  flattened ``[.., heads·head_dim]`` tensor); the gain stays full width.
- an input narrower than the gain uses its first ``x.shape[-1]`` entries when
  ``allow_prefix`` (nested-width models slice one gain to the active width).

Every seed stores the gain as ``weight`` initialised to ones and multiplies by it as
it is (no ``1 + weight`` offset), so each seed's checkpoints load under that one name.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import ConfigError, ShapeError
from .._validation import check_positive_float, check_positive_int

__all__ = ["rms_norm", "RMSNorm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, upcast: bool = True,
             upcast_weight: bool = False, group_size: int | None = None) -> torch.Tensor:
    """RMS-normalise ``x`` ``[..., D]`` and multiply by ``weight`` ``[D]`` (or None).

    Returns ``x.dtype`` with ``upcast`` (and ``upcast_weight``) or without a weight;
    otherwise the promoted dtype of ``x`` and ``weight``, as the seeds' ``x_hat * weight``."""
    D = x.shape[-1]
    g = group_size or D
    xs = x.reshape(*x.shape[:-1], D // g, g) if g != D else x
    if not upcast:
        y = (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)).reshape(x.shape)
        return y if weight is None else y * weight
    compute = torch.promote_types(xs.dtype, torch.float32)
    y = F.rms_norm(xs.to(compute), (g,), None, eps).reshape(x.shape)
    if weight is None:
        return y.to(x.dtype)
    if upcast_weight:
        return (y * weight.to(compute)).to(x.dtype)
    return y.to(x.dtype) * weight


class RMSNorm(nn.Module):
    """``weight`` [dim] (ones). ``forward(x [..., dim]) -> [..., dim]`` in x's dtype
    (upcast modes) or the promoted dtype of x and weight (input-dtype mode, as the seed).

    Args:
        dim: feature width D.
        eps: added to the mean square, finite and > 0 (Llama 1e-5/1e-6, SpikeWhale 1e-6).
        upcast: fp32 statistics (Llama, SiameseNorm) vs the input dtype throughout
            (SpikeWhale, HRM refinement, the Engram fusion gate).
        upcast_weight: with ``upcast``, apply the gain in fp32 too and round once at the
            end (SiameseNorm) instead of casting back before the gain (Llama).
        group_size: per-group statistics (must divide ``dim``); None = whole width.
        allow_prefix: accept ``x`` narrower than ``dim`` and use ``weight[:width]``.

    Parameter: ``weight`` (the name every seed uses, so their checkpoints load as they are).

    Example::

        norm = RMSNorm(512, eps=1e-5)                       # Llama
        seed = RMSNorm(512, upcast=False)                   # SpikeWhale, HRM refinement
        stream = RMSNorm(512, upcast_weight=True)           # SiameseNorm
        qk = RMSNorm(8 * 64, group_size=64)                 # per-head statistics, per-feature gains
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, upcast: bool = True, upcast_weight: bool = False,
                 group_size: int | None = None, allow_prefix: bool = False) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_float("eps", eps)
        if not math.isfinite(eps):
            raise ConfigError(f"`eps` must be finite, got {eps!r}")
        if upcast_weight and not upcast:
            raise ConfigError("`upcast_weight=True` needs `upcast=True` (without upcast everything is in x's dtype)")
        if group_size is not None:
            check_positive_int("group_size", group_size)
            if dim % group_size:
                raise ConfigError(f"`group_size` ({group_size}) must divide `dim` ({dim})")
        self.dim, self.eps, self.upcast, self.upcast_weight = dim, float(eps), bool(upcast), bool(upcast_weight)
        self.group_size, self.allow_prefix = group_size, bool(allow_prefix)
        self.weight = nn.Parameter(torch.ones(dim))

    def extra_repr(self) -> str:
        return (f"{self.dim}, eps={self.eps}, upcast={self.upcast}, upcast_weight={self.upcast_weight}, "
                f"group_size={self.group_size}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1] if x.dim() else 0
        if width != self.dim and not (self.allow_prefix and 0 < width < self.dim):
            raise ShapeError(f"last dim of `x` must be dim={self.dim}, got shape {tuple(x.shape)}")
        if self.group_size and width % self.group_size:
            raise ShapeError(f"last dim of `x` ({width}) must be a multiple of group_size={self.group_size}")
        return rms_norm(x, self.weight[:width], self.eps, upcast=self.upcast, upcast_weight=self.upcast_weight,
                        group_size=self.group_size)
