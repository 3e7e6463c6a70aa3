"""Rotary position embeddings, half-split ("rotate half") convention.

For the rotated slice ``x_r`` of width R (even) at position p, with
``inv_freq[i] = theta^(-2i/R)``:

    x_r = [x1, x2]  →  [x1·cos − x2·sin,  x1·sin + x2·cos],   angle = p · inv_freq

Where the slice sits is an argument, so one module covers: the full head (Llama), a
partial leading slice (NeoLLM's partial_rotary_factor), and the MLA nope/rope
partition where only the *last* ``rope_dim`` features rotate (SpikeWhale).

Tables: with ``max_positions`` the cos/sin tables ``[max_positions, R/2]`` are
precomputed; ``persistent=True`` puts ``inv_freq``, ``cos_cache`` and ``sin_cache`` in
the state dict (SpikeWhale keeps them there, so a checkpoint's tables are loaded, not
recomputed). ``table_dtype`` rounds the tables through a dtype (ShellElastic's
bf16-rounded tables). Without tables the angles are computed per call in fp32.
"""
from __future__ import annotations

import torch
from torch import nn

from .._errors import ConfigError, ShapeError
from .._validation import check_positive_float, check_positive_int, debug_checks_enabled

__all__ = ["rope_inv_freq", "apply_rotary", "RotaryEmbedding"]


def rope_inv_freq(dim: int, theta: float = 10000.0) -> torch.Tensor:
    """``[dim/2]`` fp32 inverse frequencies ``theta^(-2i/dim)``."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Rotate ``x[..., start:start+R]`` of ``x`` ``[B, S, heads, D]``; ``cos``/``sin``
    ``[B or 1, S, R/2]``. Features outside the slice pass through unchanged."""
    half = cos.shape[-1]
    end = start + 2 * half
    if end > x.shape[-1]:
        raise ShapeError(f"rotary slice [{start}:{end}] does not fit head_dim {x.shape[-1]}")
    c, s = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    x1, x2 = x[..., start:start + half], x[..., start + half:end]
    rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    if start == 0 and end == x.shape[-1]:
        return rotated
    return torch.cat([x[..., :start], rotated, x[..., end:]], dim=-1)


class RotaryEmbedding(nn.Module):
    """Half-split RoPE over a ``dim``-wide slice of each head.

    Args:
        dim: R, rotated width (even).
        theta: base.
        max_positions: precompute cos/sin tables for positions < max_positions.
        persistent: register ``inv_freq``/``cos_cache``/``sin_cache`` in the state dict.
        inv_freq: explicit ``[R/2]`` frequencies (e.g. a fractal spectrum) instead of θ's.
        table_dtype: round the tables through this dtype (bf16-rounded tables).

    ``forward(x [B, S, heads, D], positions [B or 1, S], start=0)`` rotates
    ``x[..., start:start+R]``; ``start = D − R`` gives the MLA "last R dims" partition.

    Example::

        rope = RotaryEmbedding(64, theta=5e5)
        q = rope(q, positions)                     # full head (Llama)
        rope = RotaryEmbedding(32, max_positions=4096, persistent=True)
        q = rope(q, positions, start=q.shape[-1] - 32)   # nope/rope partition (MLA)
    """

    def __init__(self, dim: int, theta: float = 10000.0, max_positions: int | None = None,
                 persistent: bool = False, inv_freq: torch.Tensor | None = None,
                 table_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_float("theta", theta)
        if dim % 2:
            raise ConfigError(f"`dim` of a rotary embedding must be even, got {dim}")
        if max_positions is not None:
            check_positive_int("max_positions", max_positions)
        if persistent and max_positions is None:
            raise ConfigError("`persistent=True` needs `max_positions` (the tables it stores)")
        if inv_freq is None:
            inv_freq = rope_inv_freq(dim, theta)
        elif tuple(inv_freq.shape) != (dim // 2,):
            raise ShapeError(f"`inv_freq` must have shape ({dim // 2},), got {tuple(inv_freq.shape)}")
        self.dim, self.theta, self.max_positions = dim, float(theta), max_positions
        self.table_dtype = table_dtype
        self.register_buffer("inv_freq", inv_freq.float(), persistent=persistent)
        if max_positions is not None:
            cos, sin = self._angles(torch.arange(max_positions, dtype=torch.float32))
            self.register_buffer("cos_cache", cos, persistent=persistent)
            self.register_buffer("sin_cache", sin, persistent=persistent)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta}, max_positions={self.max_positions}"

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        cos, sin = freqs.cos(), freqs.sin()
        if self.table_dtype is not None:
            cos, sin = cos.to(self.table_dtype).float(), sin.to(self.table_dtype).float()
        return cos, sin

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[*positions.shape, R/2]`` fp32 for integer ``positions``."""
        if self.max_positions is None:
            return self._angles(positions)
        # Reading the range is a host sync, so on the hot path it is left to the models,
        # which know their length on the host (check_context); LAMINAE_DEBUG=1 reads it.
        if debug_checks_enabled() and not torch.compiler.is_compiling() and positions.numel():
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0 or hi >= self.max_positions:
                raise ShapeError(f"`positions` must lie in [0, max_positions={self.max_positions}) (the rotary "
                                 f"tables), got [{lo}, {hi}]")
        return self.cos_cache[positions], self.sin_cache[positions]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, start: int = 0) -> torch.Tensor:
        if x.dim() != 4:
            raise ShapeError(f"`x` must be [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
        cos, sin = self.cos_sin(positions)
        return apply_rotary(x, cos, sin, start)
