"""LAuReL combination kernels.

Forward  y = w0·f + w1·(x + t·B)          one pass over f, x (and t, B); writes y.
Backward df = w0·g,  dℓ = w1·g            one pass over g, f, x (and t, B); writes df,
         partial Σ f·g and Σ u·g          dℓ and per-program partial sums for the two
                                          weights (reduced in torch).
``t = x·A`` [N, r] and the weight-gradient matmuls dA, dB stay in torch: r is thin
and cuBLAS is already optimal for them. ℓ = t·B is recomputed in both kernels
(≤ 32 ranks per tl.dot step: cheap) instead of materialising the [N, D] product.
"""
from __future__ import annotations

from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import DTypeError
from laminae.primitives.laurel import laurel_weights

from ._common import StaticCase, contiguous, dot_precision, empty, empty_like

__all__ = ["laurel", "laurel_combine"]

BLOCK_M = 16
BLOCK_D = 128
NUM_WARPS = 4


@triton.jit
def _lowrank_tile(t_ptr, b_ptr, rows, cols, row_mask, col_mask, R, D,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                  PRECISION: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        r_mask = rr < R
        t = tl.load(t_ptr + rows[:, None] * R + rr[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(b_ptr + rr[:, None] * D + cols[None, :], mask=r_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.dot(t, b, input_precision=PRECISION)
    return acc


@triton.jit
def _laurel_fwd_kernel(f_ptr, x_ptr, t_ptr, b_ptr, w_ptr, y_ptr, N, D, R,
                       HAS_RW: tl.constexpr, HAS_LR: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                       PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < N
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows[:, None] * D + cols[None, :]
    f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_LR:
        u += _lowrank_tile(t_ptr, b_ptr, rows, cols, row_mask, col_mask, R, D,
                           BLOCK_M, BLOCK_D, BLOCK_R, PRECISION)
    if HAS_RW:
        w_f = tl.load(w_ptr)
        w_u = tl.load(w_ptr + 1)
        y = w_f * f + w_u * u
    else:
        y = f + u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _laurel_bwd_kernel(g_ptr, f_ptr, x_ptr, t_ptr, b_ptr, w_ptr, df_ptr, dl_ptr, part_ptr, N, D, R,
                       HAS_RW: tl.constexpr, HAS_LR: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                       PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < N
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows[:, None] * D + cols[None, :]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RW:
        w_f = tl.load(w_ptr)
        w_u = tl.load(w_ptr + 1)
        f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_LR:
            u += _lowrank_tile(t_ptr, b_ptr, rows, cols, row_mask, col_mask, R, D,
                               BLOCK_M, BLOCK_D, BLOCK_R, PRECISION)
        pid = pid_m * tl.num_programs(1) + pid_d
        tl.store(part_ptr + 2 * pid, tl.sum(tl.sum(f * g, axis=1), axis=0))
        tl.store(part_ptr + 2 * pid + 1, tl.sum(tl.sum(u * g, axis=1), axis=0))
        tl.store(df_ptr + offs, (w_f * g).to(df_ptr.dtype.element_ty), mask=mask)
        tl.store(dl_ptr + offs, (w_u * g).to(dl_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(df_ptr + offs, g.to(df_ptr.dtype.element_ty), mask=mask)
        tl.store(dl_ptr + offs, g.to(dl_ptr.dtype.element_ty), mask=mask)


def _block_r(rank: int) -> int:
    return min(32, max(16, triton.next_power_of_2(max(rank, 1))))


def _grid(n: int, d: int):
    return (triton.cdiv(n, BLOCK_M), triton.cdiv(d, BLOCK_D))


@triton_op("laminae::laurel_combine", mutates_args=())
def laurel_combine(
    f: torch.Tensor, x: torch.Tensor, t: torch.Tensor | None, lr_B: torch.Tensor | None,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """y = w0·f + w1·(x + t·lr_B) over rows of [N, D] (w = ones when ``weights`` is None)."""
    n, d = f.shape
    rank = 0 if t is None else t.shape[1]
    y = empty_like(f)
    wrap_triton(_laurel_fwd_kernel)[_grid(n, d)](
        f, x, t, lr_B, weights, y, n, d, rank,
        HAS_RW=weights is not None, HAS_LR=t is not None,
        BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, BLOCK_R=_block_r(rank),
        PRECISION=dot_precision(f.dtype), num_warps=NUM_WARPS,
    )
    return y


@triton_op("laminae::laurel_combine_bwd", mutates_args=())
def _laurel_combine_bwd(
    g: torch.Tensor, f: torch.Tensor, x: torch.Tensor, t: torch.Tensor | None,
    lr_B: torch.Tensor | None, weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, d = f.shape
    rank = 0 if t is None else t.shape[1]
    grid = _grid(n, d)
    df = empty_like(f)
    dl = empty_like(x)
    partials = empty((grid[0] * grid[1], 2), dtype=torch.float32, device=f.device)
    wrap_triton(_laurel_bwd_kernel)[grid](
        g, f, x, t, lr_B, weights, df, dl, partials, n, d, rank,
        HAS_RW=weights is not None, HAS_LR=t is not None,
        BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, BLOCK_R=_block_r(rank),
        PRECISION=dot_precision(f.dtype), num_warps=NUM_WARPS,
    )
    return df, dl, partials


def _setup_context(ctx, inputs, output):
    f, x, t, lr_B, weights = inputs
    ctx.save_for_backward(f, x, t, lr_B, weights)


def _backward(ctx, g):
    f, x, t, lr_B, weights = ctx.saved_tensors
    df, dl, partials = _laurel_combine_bwd(g.contiguous(), f, x, t, lr_B, weights)
    dweights = partials.sum(0) if weights is not None else None
    dt = dB = None
    if t is not None:
        dt = dl @ lr_B.t()
        dB = t.t() @ dl
    # x's direct residual gradient equals dℓ (both are w1·g).
    return df, dl, dt, dB, dweights


laurel_combine.register_autograd(_backward, setup_context=_setup_context)


def laurel(
    x: torch.Tensor,
    alpha_logit: torch.Tensor | None = None,
    beta_logit: torch.Tensor | None = None,
    lr_A: torch.Tensor | None = None,
    lr_B: torch.Tensor | None = None,
    *,
    sublayer_output: torch.Tensor,
) -> torch.Tensor:
    """Triton LAuReL with the signature of :func:`laminae.primitives.laurel.laurel_reference`.

    ``x`` (the residual) and ``sublayer_output``: ``[..., D]`` fp32/bf16/fp16; returns
    ``y`` in their dtype.
    """
    f = sublayer_output
    if f.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"Triton LAuReL supports fp32/bf16/fp16 inputs, got {f.dtype}")
    shape = f.shape
    d = shape[-1]
    f2, x2 = contiguous(f.reshape(-1, d), x.reshape(-1, d))
    weights = laurel_weights(alpha_logit, beta_logit) if alpha_logit is not None else None
    t = B = None
    if lr_A is not None:
        t = (x2 @ lr_A.to(x2.dtype)).contiguous()
        B = lr_B.to(x2.dtype).contiguous()
    return laurel_combine(f2, x2, t, B, weights).reshape(shape)


def static_cases() -> Iterator[StaticCase]:
    """Every pointer is a fresh or contiguous tensor (16-byte aligned at launch, which
    Triton specialises: ``divisible``); N, D and the rank vary, so none is declared."""
    for dt in ("fp32", "bf16", "fp16"):
        for has_rw in (True, False):
            for has_lr, block_rs in ((True, (16, 32)), (False, (16,))):
                for block_r in block_rs:
                    const = dict(HAS_RW=has_rw, HAS_LR=has_lr, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
                                 BLOCK_R=block_r, PRECISION="ieee" if dt == "fp32" else "tf32")
                    p = f"*{dt}"
                    yield StaticCase("laurel_fwd", _laurel_fwd_kernel,
                                     dict(f_ptr=p, x_ptr=p, t_ptr=p, b_ptr=p, w_ptr="*fp32", y_ptr=p,
                                          N="i32", D="i32", R="i32"), const, NUM_WARPS, tags={"dtype": dt},
                                     divisible=("f_ptr", "x_ptr", "t_ptr", "b_ptr", "w_ptr", "y_ptr"))
                    yield StaticCase("laurel_bwd", _laurel_bwd_kernel,
                                     dict(g_ptr=p, f_ptr=p, x_ptr=p, t_ptr=p, b_ptr=p, w_ptr="*fp32",
                                          df_ptr=p, dl_ptr=p, part_ptr="*fp32", N="i32", D="i32", R="i32"),
                                     const, NUM_WARPS, tags={"dtype": dt},
                                     divisible=("g_ptr", "f_ptr", "x_ptr", "t_ptr", "b_ptr", "w_ptr", "df_ptr",
                                                "dl_ptr", "part_ptr"))


def tour_case(device: torch.device):
    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    rows, d, rank = 2 * 64, 256, 32
    inputs = {
        "sublayer_output": torch.randn(rows, d, generator=gen).to(device),
        "x": torch.randn(rows, d, generator=gen).to(device),
        "alpha_logit": torch.tensor(0.3).to(device),
        "beta_logit": torch.tensor(-0.2).to(device),
        "lr_A": (torch.randn(d, rank, generator=gen) / d**0.5).to(device),
        "lr_B": (torch.randn(rank, d, generator=gen) / rank**0.5).to(device),
    }
    from laminae.primitives.laurel import laurel_reference

    return TourCase("laurel (RW+LR, r=32)", laurel, laurel_reference, inputs, list(inputs))
