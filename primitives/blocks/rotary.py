"""Rotary position embeddings, half-split ("rotate half") convention: the one RoPE of
laminae (GQA and the decoders, MoSRAH's YaRN heads, the sliding window, ShellElastic).

For the rotated slice ``x_r`` of width R (even) at position p, with
``inv_freq[i] = theta^(-2i/R)`` (or YaRN's blended frequencies, :func:`yarn_rope`):

    x_r = [x1, x2]  →  [x1·cos − x2·sin,  x1·sin + x2·cos],   angle = p · inv_freq

Where the slice sits is an argument, so one module covers: the full head (Llama), a
partial leading slice (NeoLLM's partial_rotary_factor), and the MLA nope/rope
partition where only the *last* ``rope_dim`` features rotate (SpikeWhale). Positions
are one per token ``[B|1, S]`` (shared by the heads) or one per row of ``x``
(MoSRAH's per-head positions ``[B, L, T]`` for ``x`` ``[B, L, T, u]``).

Precision: the frequencies stay fp32 whatever dtype the model is cast to (a bf16
frequency puts position 1000 up to ~2 rad off). ``angle_dtype`` (default fp32) is the
precision of the angles: positions, frequencies and their product are rounded
through it (bf16: ShellElastic's seed). ``table_dtype`` rounds cos and sin through a
dtype (bf16-rounded tables). The rotation itself runs in ``x``'s dtype.

Tables: with ``max_positions`` the cos/sin tables ``[max_positions, R/2]`` are
precomputed; ``persistent=True`` puts ``inv_freq``, ``cos_cache`` and ``sin_cache`` in
the state dict (SpikeWhale keeps them there, so a checkpoint's tables are loaded, not
recomputed). Without tables the angles are computed per call.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from .._errors import ConfigError, ShapeError
from .._validation import check_positive_float, check_positive_int, debug_checks_enabled

__all__ = ["rope_inv_freq", "YarnRope", "yarn_rope", "rotary_cos_sin", "apply_rotary", "rotary_embedding",
           "RotaryEmbedding"]


def rope_inv_freq(dim: int, theta: float = 10000.0) -> torch.Tensor:
    """``[dim/2]`` fp32 inverse frequencies ``theta^(-2i/dim)``."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


class YarnRope(NamedTuple):
    inv_freq: torch.Tensor      # [u/2] fp32 θ′_i (angles are position · θ′_i)
    attention_scale: float      # A_rope / √u, the one factor applied to q̃·k̃


def yarn_rope(head_dim: int, base: float, training_length: int, inference_length: int,
              alpha: float = 1.0, beta: float = 32.0, device: torch.device | str | None = None) -> YarnRope:
    """YaRN frequencies ``θ′`` ``[head_dim/2]`` (fp32) and the score scale ``A/√u`` for a
    context extended by ``s = inference_length / training_length``: the low
    frequencies are divided by ``s`` (blended over the ramp ``[alpha, beta]`` of
    wavelengths per training context), ``A = (0.1·ln s + 1)²``.

    Evaluated in fp32 in the public SHRAM implementation's order (mosrah errata E6),
    also at ``s = 1``, where ``θ′`` equals ``θ`` up to one ulp and ``A = 1``."""
    scale = inference_length / training_length
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    theta = 1.0 / (base ** exponent)
    ratio = (training_length * theta) / (2 * math.pi)
    ramp = ((ratio - alpha) / (beta - alpha)).clamp(0.0, 1.0)
    inv_freq = (1 - ramp) * (theta / scale) + ramp * theta
    factor = (0.1 * math.log(scale) + 1.0) ** 2
    return YarnRope(inv_freq, factor / math.sqrt(head_dim))


def rotary_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, *, angle_dtype: torch.dtype = torch.float32,
                   table_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[*position_ids.shape, R/2]`` for integer ``position_ids`` and
    ``inv_freq`` ``[R/2]``, in ``promote(angle_dtype, float32)``.

    The positions, the frequencies and their product are rounded through
    ``angle_dtype`` (fp32: exact positions times the fp32 frequencies; bf16: the
    bf16 angles of ShellElastic's seed); ``table_dtype`` rounds cos and sin."""
    compute = torch.promote_types(angle_dtype, torch.float32)
    pos = position_ids.to(compute).to(angle_dtype).to(compute)
    freq = inv_freq.to(device=position_ids.device, dtype=compute).to(angle_dtype).to(compute)
    angle = (pos[..., None] * freq).to(angle_dtype).to(compute)
    cos, sin = angle.cos(), angle.sin()
    if table_dtype is not None:
        cos, sin = cos.to(table_dtype).to(compute), sin.to(table_dtype).to(compute)
    return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Rotate ``x[..., start:start+R]`` of ``x`` ``[B, S, heads, D]`` (or any ``[..., D]``);
    ``cos``/``sin`` ``[*x.shape[:-1], R/2]`` (one angle per row, e.g. per-head
    positions) or ``[B or 1, S, R/2]`` (one per token, shared by the heads). cos and
    sin are cast to ``x``'s dtype and the rotation runs in it. Features outside the
    slice pass through unchanged."""
    half = cos.shape[-1]
    end = start + 2 * half
    if end > x.shape[-1]:
        raise ShapeError(f"rotary slice [{start}:{end}] does not fit head_dim {x.shape[-1]}")
    if cos.dim() == x.dim() - 1:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    elif cos.dim() != x.dim():
        raise ShapeError(f"rotary angles of shape {tuple(cos.shape)} fit neither every row of x "
                         f"{tuple(x.shape)} nor every token")
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., start:start + half], x[..., start + half:end]
    rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    if start == 0 and end == x.shape[-1]:
        return rotated
    return torch.cat([x[..., :start], rotated, x[..., end:]], dim=-1)


def rotary_embedding(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor, start: int = 0, *,
                     angle_dtype: torch.dtype = torch.float32, table_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The functional form of :class:`RotaryEmbedding`: ``x`` rotated by
    ``position_ids`` at the frequencies ``inv_freq`` (:func:`rotary_cos_sin`,
    :func:`apply_rotary`)."""
    cos, sin = rotary_cos_sin(position_ids, inv_freq, angle_dtype=angle_dtype, table_dtype=table_dtype)
    return apply_rotary(x, cos, sin, start)


class RotaryEmbedding(nn.Module):
    """Half-split RoPE over a ``dim``-wide slice of each head.

    Args:
        dim: R, rotated width (even).
        theta: base.
        max_positions: precompute cos/sin tables for positions < max_positions.
        persistent: register ``inv_freq``/``cos_cache``/``sin_cache`` in the state dict.
        inv_freq: explicit ``[R/2]`` frequencies (e.g. YaRN's, :func:`yarn_rope`, or a
            fractal spectrum) instead of θ's.
        angle_dtype: precision of the angles (default fp32; bf16 rounds positions,
            frequencies and angles as ShellElastic's seed does).
        table_dtype: round cos and sin through this dtype (bf16-rounded tables).

    ``forward(x [B, S, heads, D], position_ids, start=0)`` rotates
    ``x[..., start:start+R]``; ``position_ids`` is ``[B or 1, S]`` (one position per
    token) or ``x.shape[:-1]`` (one per row: MoSRAH's per-head positions);
    ``start = D − R`` gives the MLA "last R dims" partition. ``inv_freq`` stays fp32
    when the module is cast to another dtype.

    Example::

        rope = RotaryEmbedding(64, theta=5e5)
        q = rope(q, position_ids)                          # full head (Llama)
        rope = RotaryEmbedding(32, max_positions=4096, persistent=True)
        q = rope(q, position_ids, start=q.shape[-1] - 32)  # nope/rope partition (MLA)
    """

    def __init__(self, dim: int, theta: float = 10000.0, max_positions: int | None = None,
                 persistent: bool = False, inv_freq: torch.Tensor | None = None,
                 table_dtype: torch.dtype | None = None, angle_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        check_positive_float("theta", theta)
        if dim % 2:
            raise ConfigError(f"`dim` of a rotary embedding must be even, got {dim}")
        if max_positions is not None:
            check_positive_int("max_positions", max_positions)
        if persistent and max_positions is None:
            raise ConfigError("`persistent=True` needs `max_positions` (the tables it stores)")
        for name, dtype in (("angle_dtype", angle_dtype), ("table_dtype", table_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ConfigError(f"`{name}` must be a floating torch.dtype, got {dtype!r}")
        if inv_freq is None:
            inv_freq = rope_inv_freq(dim, theta)
        elif tuple(inv_freq.shape) != (dim // 2,):
            raise ShapeError(f"`inv_freq` must have shape ({dim // 2},), got {tuple(inv_freq.shape)}")
        self.dim, self.theta, self.max_positions = dim, float(theta), max_positions
        self.angle_dtype, self.table_dtype = angle_dtype, table_dtype
        self.register_buffer("inv_freq", inv_freq.float(), persistent=persistent)
        if max_positions is not None:
            cos, sin = self._angles(torch.arange(max_positions))
            self.register_buffer("cos_cache", cos, persistent=persistent)
            self.register_buffer("sin_cache", sin, persistent=persistent)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta}, max_positions={self.max_positions}"

    def _apply(self, fn, recurse=True):
        # a dtype cast of the model moves the frequencies but never rounds them
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def _angles(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(position_ids, self.inv_freq, angle_dtype=self.angle_dtype, table_dtype=self.table_dtype)

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[*position_ids.shape, R/2]`` for integer ``position_ids``."""
        if self.max_positions is None:
            return self._angles(position_ids)
        # Reading the range is a host sync, so on the hot path it is left to the models,
        # which know their length on the host (check_context); LAMINAE_DEBUG=1 reads it.
        if debug_checks_enabled() and not torch.compiler.is_compiling() and position_ids.numel():
            lo, hi = int(position_ids.min()), int(position_ids.max())
            if lo < 0 or hi >= self.max_positions:
                raise ShapeError(f"`position_ids` must lie in [0, max_positions={self.max_positions}) (the rotary "
                                 f"tables), got [{lo}, {hi}]")
        return self.cos_cache[position_ids], self.sin_cache[position_ids]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        if x.dim() != 4:
            raise ShapeError(f"`x` must be [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
        per_token = position_ids.dim() == 2 and position_ids.shape[0] in (1, x.shape[0]) \
            and position_ids.shape[1] == x.shape[1]
        if not (per_token or tuple(position_ids.shape) == tuple(x.shape[:-1])):
            raise ShapeError(f"`position_ids` must be [batch or 1, seq={x.shape[1]}] or one per row of x "
                             f"{tuple(x.shape[:-1])}, got shape {tuple(position_ids.shape)}")
        cos, sin = self.cos_sin(position_ids)
        return apply_rotary(x, cos, sin, start)
