"""RMSNorm in the variants the recipes' seeds use.

``rms_norm(x, weight, eps, upcast=..., group_size=...)``:

    y = x · rsqrt(mean(x², over the last dim or each group) + eps) · weight

- ``upcast=True`` (Llama, ShellElastic): statistics and normalisation in fp32, the
  result cast back to ``x.dtype`` *before* the gain (HF ``LlamaRMSNorm``).
- ``upcast=False`` (SpikeWhale): everything in the input dtype.
- ``group_size``: statistics per group of that many features (per-head QK norm over a
  flattened ``[.., heads·head_dim]`` tensor); the gain stays full width.
- an input narrower than the gain uses its first ``x.shape[-1]`` entries when
  ``allow_prefix`` (nested-width models slice one gain to the active width).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import ConfigError, ShapeError
from .._validation import check_positive_float, check_positive_int

__all__ = ["rms_norm", "RMSNorm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, upcast: bool = True,
             group_size: int | None = None) -> torch.Tensor:
    """RMS-normalise ``x`` ``[..., D]`` and multiply by ``weight`` ``[D]`` (or None)."""
    D = x.shape[-1]
    g = group_size or D
    xs = x.reshape(*x.shape[:-1], D // g, g) if g != D else x
    if upcast:
        y = F.rms_norm(xs.to(torch.promote_types(xs.dtype, torch.float32)), (g,), None, eps).to(x.dtype)
    else:
        y = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)
    y = y.reshape(x.shape)
    return y if weight is None else y * weight


class RMSNorm(nn.Module):
    """``weight`` [dim] (ones). ``forward(x [..., dim]) -> [..., dim]`` in x's dtype
    (upcast mode) or the promoted dtype of x and weight (input-dtype mode, as the seed).

    Args:
        dim: feature width D.
        eps: added to the mean square (Llama 1e-5/1e-6, SpikeWhale 1e-6).
        upcast: fp32 statistics cast back before the gain (Llama) vs input dtype (SpikeWhale).
        group_size: per-group statistics (must divide ``dim``); None = whole width.
        allow_prefix: accept ``x`` narrower than ``dim`` and use ``weight[:width]``.

    Example::

        norm = RMSNorm(512, eps=1e-5)             # Llama
        qk = RMSNorm(8 * 64, group_size=64)      # per-head statistics, per-feature gains
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, upcast: bool = True, group_size: int | None = None,
                 allow_prefix: bool = False) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_float("eps", eps)
        if group_size is not None:
            check_positive_int("group_size", group_size)
            if dim % group_size:
                raise ConfigError(f"`group_size` ({group_size}) must divide `dim` ({dim})")
        self.dim, self.eps, self.upcast = dim, float(eps), bool(upcast)
        self.group_size, self.allow_prefix = group_size, bool(allow_prefix)
        self.weight = nn.Parameter(torch.ones(dim))

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, upcast={self.upcast}, group_size={self.group_size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1] if x.dim() else 0
        if width != self.dim and not (self.allow_prefix and 0 < width < self.dim):
            raise ShapeError(f"last dim of `x` must be dim={self.dim}, got shape {tuple(x.shape)}")
        if self.group_size and width % self.group_size:
            raise ShapeError(f"last dim of `x` ({width}) must be a multiple of group_size={self.group_size}")
        return rms_norm(x, self.weight[:width], self.eps, upcast=self.upcast, group_size=self.group_size)
