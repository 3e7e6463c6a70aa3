"""Hyper-connections (simplified, SpikeWhale form): the residual stream is
``hc_mult`` parallel streams ``[B, M, S, H]``. A sub-layer reads a softmax-weighted
mix of the streams and its output is added to every stream with softmax weights:

    h       = Σ_m softmax(pre_weight)_m · x_m
    x_m    += softmax(post_weight)_m · f(h)

At the output, :class:`HCOutputMix` mixes the streams back with softmax(weight)
(zeros: the plain mean).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import ShapeError
from .._validation import check_positive_int

__all__ = ["expand_streams", "HyperConnection", "HCOutputMix"]


def expand_streams(x: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """``[B, S, H]`` → ``[B, hc_mult, S, H]`` identical copies."""
    return x.unsqueeze(1).expand(-1, hc_mult, -1, -1).clone()


def _mix(streams: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if streams.dim() != 4 or streams.shape[1] != weight.shape[0]:
        raise ShapeError(f"`streams` must be [batch, {weight.shape[0]}, seq, hidden], got {tuple(streams.shape)}")
    return (streams * F.softmax(weight, dim=0).view(1, -1, 1, 1)).sum(dim=1)


class HyperConnection(nn.Module):
    """One sub-layer's read/write weights over ``hc_mult`` streams.

    Parameters: ``pre_weight``, ``post_weight`` [hc_mult], initialised asymmetrically
    (linspace(±0.5, ∓0.5)/hc_mult) so the streams diverge.

    Example::

        hc = HyperConnection(4)
        h = hc.pre(streams)                 # [B, S, H]
        streams = hc.post(streams, f(h))    # [B, 4, S, H]
    """

    def __init__(self, hc_mult: int) -> None:
        super().__init__()
        check_positive_int("hc_mult", hc_mult)
        self.hc_mult = hc_mult
        self.pre_weight = nn.Parameter(torch.linspace(0.5, -0.5, hc_mult) / hc_mult)
        self.post_weight = nn.Parameter(torch.linspace(-0.5, 0.5, hc_mult) / hc_mult)

    def extra_repr(self) -> str:
        return f"hc_mult={self.hc_mult}"

    def pre(self, streams: torch.Tensor) -> torch.Tensor:
        return _mix(streams, self.pre_weight)

    def post(self, streams: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return streams + delta.unsqueeze(1) * F.softmax(self.post_weight, dim=0).view(1, -1, 1, 1)


class HCOutputMix(nn.Module):
    """``forward(x [B, M, S, H]) -> [B, S, H]``: the streams mixed with softmax(weight)
    (zeros = mean)."""

    def __init__(self, hc_mult: int) -> None:
        super().__init__()
        check_positive_int("hc_mult", hc_mult)
        self.weight = nn.Parameter(torch.zeros(hc_mult))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _mix(x, self.weight)
