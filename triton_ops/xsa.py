"""XSA (exclusive self-attention) kernels.

One program owns BLOCK_R rows (one row = one position's kv head) and the group of
G = H/Hkv query heads that read that kv head, so each value vector is loaded once
and reused by its whole group, BLOCK_G query heads at a time.

Forward   out = y − c·v,  c = (y·v)/den            den = (‖v‖+ε)²  ("normalized")
                                                    den = ‖v‖²+ε    ("squared_norm")
Backward  with upstream g and e = (g·v)/den:
          dy = g − e·v
          dv = Σ_group (−c·g − e·y) + κ·(Σ_group c·e)·v
          The last term is c·e·∂den/∂v with ∂den/∂v = κ·v:
          κ = 2(‖v‖+ε)/‖v‖ ("normalized"), κ = 2 ("squared_norm").
          At v = 0, c = e = 0 and κ is taken as 0, so dv = 0 and dy = g: exactly
          what autograd gives for the reference (whose norm has a zero subgradient).

Both passes read y (and g) once and v once, and write out (dy, dv) once; the
backward recomputes c from the saved inputs instead of storing it.
"""
from __future__ import annotations

from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import DTypeError, ShapeError
from laminae.primitives.xsa import check_xsa_inputs, xsa_eps

from ._common import StaticCase, empty_like

__all__ = ["xsa", "xsa_op"]

MAX_HEAD_DIM = 256
MAX_BLOCK_G = 8
# fp32 elements of one [BLOCK_R, BLOCK_G, BLOCK_D] tile: 8 per thread at 4 warps
# (2048 pushes the backward into register spills on sm_90).
TILE = 1024
NUM_WARPS = 4
NUM_STAGES = 1  # the group loop has nothing worth software-pipelining


@triton.jit
def _value_stats(v_ptr, rows, cols, row_mask, col_mask, D, eps, NORMALIZED: tl.constexpr):
    """Load v as [BLOCK_R, 1, BLOCK_D] fp32; return v, 1/den and κ as [BLOCK_R, 1, 1].

    Every tensor in these kernels is 3-D (reductions keep their axis), so they all
    share one layout and the compiler inserts no layout conversions."""
    v = tl.load(v_ptr + (rows * D + cols), mask=row_mask & col_mask, other=0.0).to(tl.float32)
    sq = tl.sum(v * v, axis=2, keep_dims=True)
    if NORMALIZED:
        nrm = tl.sqrt_rn(sq)
        den = (nrm + eps) * (nrm + eps)
        safe = tl.where(nrm > 0.0, nrm, 1.0)
        kappa = tl.where(nrm > 0.0, 2.0 * (nrm + eps) / safe, 0.0)
    else:
        den = sq + eps
        kappa = tl.full(sq.shape, 2.0, tl.float32)
    return v, 1.0 / den, kappa


@triton.jit
def _xsa_fwd_kernel(y_ptr, v_ptr, out_ptr, R, G, D, eps,
                    NORMALIZED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    # 64-bit offset of the program's first row in a scalar; per-element offsets stay 32-bit
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    y_ptr += row0 * G * D
    v_ptr += row0 * D
    out_ptr += row0 * G * D
    rows = tl.arange(0, BLOCK_R)[:, None, None]                      # [R, 1, 1]
    cols = tl.arange(0, BLOCK_D)[None, None, :]                      # [1, 1, D]
    row_mask = rows < tl.minimum(R - row0, BLOCK_R).to(tl.int32)
    col_mask = cols < D
    v, inv_den, kappa = _value_stats(v_ptr, rows, cols, row_mask, col_mask, D, eps, NORMALIZED)
    for g0 in range(0, G, BLOCK_G):
        heads = g0 + tl.arange(0, BLOCK_G)[None, :, None]           # [1, G, 1]
        mask = row_mask & (heads < G) & col_mask
        offs = rows * G * D + heads * D + cols
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        c = tl.sum(y * v, axis=2, keep_dims=True) * inv_den           # [R, G, 1]
        tl.store(out_ptr + offs, (y - c * v).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _xsa_bwd_kernel(g_ptr, y_ptr, v_ptr, dy_ptr, dv_ptr, R, G, D, eps,
                    NORMALIZED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    y_ptr += row0 * G * D
    v_ptr += row0 * D
    g_ptr += row0 * G * D
    dy_ptr += row0 * G * D
    dv_ptr += row0 * D
    rows = tl.arange(0, BLOCK_R)[:, None, None]
    cols = tl.arange(0, BLOCK_D)[None, None, :]
    row_mask = rows < tl.minimum(R - row0, BLOCK_R).to(tl.int32)
    col_mask = cols < D
    v, inv_den, kappa = _value_stats(v_ptr, rows, cols, row_mask, col_mask, D, eps, NORMALIZED)
    dv = tl.zeros((BLOCK_R, 1, BLOCK_D), dtype=tl.float32)
    ce = tl.zeros((BLOCK_R, 1, 1), dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        heads = g0 + tl.arange(0, BLOCK_G)[None, :, None]
        mask = row_mask & (heads < G) & col_mask
        offs = rows * G * D + heads * D + cols
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        c = tl.sum(y * v, axis=2, keep_dims=True) * inv_den           # [R, G, 1]
        e = tl.sum(g * v, axis=2, keep_dims=True) * inv_den
        tl.store(dy_ptr + offs, (g - e * v).to(dy_ptr.dtype.element_ty), mask=mask)
        dv -= tl.sum(c * g + e * y, axis=1, keep_dims=True)           # Σ over the group's heads
        ce += tl.sum(c * e, axis=1, keep_dims=True)
    dv += kappa * ce * v
    tl.store(dv_ptr + (rows * D + cols), dv.to(dv_ptr.dtype.element_ty), mask=row_mask & col_mask)


def _blocks(group: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_G, BLOCK_D) for a group size and head_dim ≤ MAX_HEAD_DIM."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_g = min(MAX_BLOCK_G, triton.next_power_of_2(group))
    return max(1, TILE // (block_g * block_d)), block_g, block_d


def _launch_config(y: torch.Tensor, v: torch.Tensor):
    rows = v.shape[0] * v.shape[1] * v.shape[2]
    group, dim = y.shape[2] // v.shape[2], y.shape[3]
    block_r, block_g, block_d = _blocks(group, dim)
    return (triton.cdiv(rows, block_r),), rows, group, dim, dict(BLOCK_R=block_r, BLOCK_G=block_g, BLOCK_D=block_d)


@triton_op("laminae::xsa", mutates_args=())
def xsa_op(y: torch.Tensor, v: torch.Tensor, normalized: bool, eps: float) -> torch.Tensor:
    """y − ((y·v)/den)·v for contiguous y [B, S, H, D], v [B, S, Hkv, D]."""
    out = empty_like(y)
    grid, rows, group, dim, blocks = _launch_config(y, v)
    if rows > 0 and group > 0 and dim > 0:
        wrap_triton(_xsa_fwd_kernel)[grid](y, v, out, rows, group, dim, eps, NORMALIZED=normalized,
                                           num_warps=NUM_WARPS, num_stages=NUM_STAGES, **blocks)
    return out


@triton_op("laminae::xsa_bwd", mutates_args=())
def _xsa_bwd(g: torch.Tensor, y: torch.Tensor, v: torch.Tensor, normalized: bool,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dy = empty_like(y)
    dv = empty_like(v)
    grid, rows, group, dim, blocks = _launch_config(y, v)
    if rows > 0 and group > 0 and dim > 0:
        wrap_triton(_xsa_bwd_kernel)[grid](g, y, v, dy, dv, rows, group, dim, eps, NORMALIZED=normalized,
                                           num_warps=NUM_WARPS, num_stages=NUM_STAGES, **blocks)
    return dy, dv


def _setup_context(ctx, inputs, output):
    y, v, normalized, eps = inputs
    ctx.save_for_backward(y, v)
    ctx.normalized, ctx.eps = normalized, eps


def _backward(ctx, g):
    y, v = ctx.saved_tensors
    dy, dv = _xsa_bwd(g.contiguous(), y, v, ctx.normalized, ctx.eps)
    return dy, dv, None, None


xsa_op.register_autograd(_backward, setup_context=_setup_context)


def xsa(y: torch.Tensor, v: torch.Tensor, *, mode: str = "normalized", eps: float | None = None) -> torch.Tensor:
    """Triton XSA with the signature of :func:`laminae.primitives.xsa.xsa_reference`
    (the kernel always accumulates in fp32, so there is no ``upcast``).

    ``y`` ``[B, S, H, D]``, ``v`` ``[B, S, Hkv, D]``, fp32/bf16/fp16, D ≤ 256;
    returns ``y``'s shape and dtype.
    """
    eps = xsa_eps(mode, eps)
    check_xsa_inputs(y, v)
    if y.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"Triton XSA supports fp32/bf16/fp16 inputs, got {y.dtype}")
    if y.shape[-1] > MAX_HEAD_DIM:
        raise ShapeError(f"Triton XSA supports head_dim <= {MAX_HEAD_DIM}, got {y.shape[-1]}; "
                         "use backend='reference' for wider heads")
    return xsa_op(y.contiguous(), v.contiguous(), mode == "normalized", eps)


def static_cases() -> Iterator[StaticCase]:
    """Every pointer is a contiguous input or a fresh output, 16-byte aligned at launch
    (Triton specialises it: ``divisible``). D, the head dim, is declared a multiple of 16
    where the tile is a common head dim's (64, 128, 256); any smaller one is its own binary."""
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        for normalized in (True, False):
            for block_d in (16, 32, 64, 128, 256):
                for block_g in (1, 2, 4, MAX_BLOCK_G):
                    block_r, _, _ = _blocks(block_g, block_d)
                    const = dict(NORMALIZED=normalized, BLOCK_R=block_r, BLOCK_G=block_g, BLOCK_D=block_d)
                    tags = {"dtype": dt}
                    head_dim = ("D",) if block_d >= 64 else ()
                    yield StaticCase("xsa_fwd", _xsa_fwd_kernel,
                                     dict(y_ptr=p, v_ptr=p, out_ptr=p, R="i32", G="i32", D="i32", eps="fp32"),
                                     const, NUM_WARPS, NUM_STAGES, tags=tags,
                                     divisible=("y_ptr", "v_ptr", "out_ptr") + head_dim)
                    yield StaticCase("xsa_bwd", _xsa_bwd_kernel,
                                     dict(g_ptr=p, y_ptr=p, v_ptr=p, dy_ptr=p, dv_ptr=p, R="i32", G="i32",
                                          D="i32", eps="fp32"),
                                     const, NUM_WARPS, NUM_STAGES, tags=tags,
                                     divisible=("g_ptr", "y_ptr", "v_ptr", "dy_ptr", "dv_ptr") + head_dim)


def tour_case(device: torch.device):
    from laminae.primitives.xsa import xsa_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    batch, seq, heads, kv_heads, dim = 2, 64, 4, 2, 32
    inputs = {
        "y": torch.randn(batch, seq, heads, dim, generator=gen).to(device),
        "v": torch.randn(batch, seq, kv_heads, dim, generator=gen).to(device),
    }
    return TourCase("xsa (GQA 4/2, normalized)", xsa, xsa_reference, inputs, list(inputs))
