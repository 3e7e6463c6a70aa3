"""SiameseNorm boundary kernels: every step between two sublayers in one memory pass.

Forward, one program per row (the whole row of D ≤ 8192 in registers):

    x1 = x + c_inv·upd,  y1 = y + upd            (HAS_UPD)
    x2 = x1·ρx·wx                                (HAS_XNORM)      → X' (STORE_X)
    u  = s ⊙ x2 + y1·ρy·wy                       (HAS_SCALE, HAS_YNORM)
    h  = u·ρin·win                               (HAS_INNORM)     → h  (STORE_H)
                                                                   Y' = y1 (STORE_Y)
with ρ = rsqrt(mean(t²) + eps) in fp32; the three ρ per row are saved ([N, 3] fp32,
1 where a norm is absent).

Backward, the mirror on a persistent grid (``num_programs_for_rows``): each program
loops over its rows, recomputes x1, y1, u from the saved inputs and ρ, and runs the
chain rule backwards (RMSNorm: dt = ρ·(w⊙g − t̂·mean(t̂⊙w⊙g)), t̂ = t·ρ, dw = Σ g⊙t̂;
dupd = c_inv·dx1 + dy1). The weight gradients (ds, dwx, dwy, dwin) are per-program
[n_programs, D] fp32 partial sums that torch reduces.

* BLOCK_D ≤ 2048 (``_siamese_bwd_kernel``): the row and the four accumulators live
  in registers; one pass per row.
* Wider rows (``_siamese_bwd_wide_kernel``): a row plus four fp32 accumulators no
  longer fit the register file without spills (checked for sm_90), so the row goes in
  chunks of 1024 columns over three passes (the input norm's reduction; the Y norm's
  and X post-norm's reductions; the gradients), and each program adds its weight
  terms to its own partial rows in global memory (no atomics; deterministic). The
  re-reads of a row mostly hit L2.

Rows wider than 8192 are rejected with a ConfigError: the forward holds one row per
program, and a wider hidden size would need the chunked treatment there too.
"""
from __future__ import annotations

from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import ConfigError, DTypeError
from laminae.primitives.siamese_norm import check_boundary_args

from ._common import StaticCase, contiguous, empty, num_programs_for_rows

__all__ = ["siamese_boundary", "siamese_boundary_fused", "MAX_HIDDEN"]

MAX_HIDDEN = 8192
# The backward keeps a whole row in registers up to this BLOCK_D; wider rows go in
# chunks of BWD_CHUNK columns (read at call time, so tests can shrink both).
BWD_MAX_ROW_BLOCK = 2048
BWD_CHUNK = 1024
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def block_d_for(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def num_warps_for(block_d: int) -> int:
    """Forward warps: a row of BLOCK_D fp32 values spread over 4/8/16 warps."""
    if block_d <= 1024:
        return 4
    if block_d <= 4096:
        return 8
    return 16


def bwd_num_warps_for(block: int) -> int:
    """Backward warps for a row (or chunk) of ``block`` columns: the backward holds
    about twice as many live vectors, so it spreads them wider sooner."""
    return 4 if block <= 512 else 8


@triton.jit
def _rstd(t, D, eps):
    return tl.rsqrt(tl.sum(t * t, axis=0) / D + eps)


@triton.jit
def _siamese_fwd_kernel(
    x_ptr, y_ptr, upd_ptr, s_ptr, wx_ptr, wy_ptr, win_ptr,
    xo_ptr, yo_ptr, h_ptr, rstd_ptr,
    D, c_inv, eps,
    HAS_UPD: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_XNORM: tl.constexpr,
    HAS_YNORM: tl.constexpr, HAS_INNORM: tl.constexpr,
    STORE_X: tl.constexpr, STORE_Y: tl.constexpr, STORE_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    offs = row * D + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_UPD:
        a = tl.load(upd_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = x + c_inv * a
        y = y + a
    if HAS_XNORM:
        rx = _rstd(x, D, eps)
        x = x * rx * tl.load(wx_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(rstd_ptr + row * 3, rx)
    else:
        tl.store(rstd_ptr + row * 3, 1.0)
    if STORE_X:
        tl.store(xo_ptr + offs, x.to(xo_ptr.dtype.element_ty), mask=mask)
    if STORE_Y:
        tl.store(yo_ptr + offs, y.to(yo_ptr.dtype.element_ty), mask=mask)
    if STORE_H:
        if HAS_SCALE:
            x = x * tl.load(s_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_YNORM:
            ry = _rstd(y, D, eps)
            y = y * ry * tl.load(wy_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(rstd_ptr + row * 3 + 1, ry)
        else:
            tl.store(rstd_ptr + row * 3 + 1, 1.0)
        u = x + y
        if HAS_INNORM:
            rin = _rstd(u, D, eps)
            u = u * rin * tl.load(win_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(rstd_ptr + row * 3 + 2, rin)
        else:
            tl.store(rstd_ptr + row * 3 + 2, 1.0)
        tl.store(h_ptr + offs, u.to(h_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(rstd_ptr + row * 3 + 1, 1.0)
        tl.store(rstd_ptr + row * 3 + 2, 1.0)


@triton.jit
def _rms_norm_bwd(t_hat, w, g, rstd, D):
    """Input gradient of RMSNorm for t̂ = t·ρ (w⊙g is the gradient w.r.t. t̂)."""
    wg = w * g
    return rstd * (wg - t_hat * (tl.sum(t_hat * wg, axis=0) / D))


@triton.jit
def _recompute(x_ptr, y_ptr, upd_ptr, s_ptr, wx_ptr, wy_ptr, offs, cols, mask, c_inv, rx, ry,
               HAS_UPD: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_XNORM: tl.constexpr,
               HAS_YNORM: tl.constexpr):
    """Rebuild one row (or chunk) of the forward from the saved inputs and ρ.

    Returns x̂ (= x1·ρx, or x1 without post-norm), x2, ŷ (= y1·ρy, or y1), the
    fused input u = s⊙x2 + ŷ⊙wy, and the weights s, wx, wy (1 where absent).
    """
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y1 = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_UPD:
        a = tl.load(upd_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = x1 + c_inv * a
        y1 = y1 + a
    s = tl.full(cols.shape, 1.0, tl.float32)
    wx = s
    wy = s
    if HAS_SCALE:
        s = tl.load(s_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_XNORM:
        wx = tl.load(wx_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x1 = x1 * rx
    if HAS_YNORM:
        wy = tl.load(wy_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y1 = y1 * ry
    x2 = x1 * wx if HAS_XNORM else x1
    u = s * x2 if HAS_SCALE else x2
    u += y1 * wy if HAS_YNORM else y1
    return x1, x2, y1, u, s, wx, wy


@triton.jit
def _load_or_zero(ptr, offs, mask, PRESENT: tl.constexpr, BLOCK: tl.constexpr):
    if PRESENT:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        return tl.zeros((BLOCK,), dtype=tl.float32)


@triton.jit
def _siamese_bwd_kernel(
    gxo_ptr, gyo_ptr, gh_ptr, x_ptr, y_ptr, upd_ptr, s_ptr, wx_ptr, wy_ptr, win_ptr, rstd_ptr,
    dx_ptr, dy_ptr, dupd_ptr, ds_part_ptr, dwx_part_ptr, dwy_part_ptr, dwin_part_ptr,
    N, D, c_inv,
    HAS_UPD: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_XNORM: tl.constexpr,
    HAS_YNORM: tl.constexpr, HAS_INNORM: tl.constexpr,
    HAS_GX: tl.constexpr, HAS_GY: tl.constexpr, HAS_GH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows up to BLOCK_D ≤ 2048: the whole row and the four weight-gradient
    accumulators live in registers; one pass over each row."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    acc_s = tl.zeros((BLOCK_D,), dtype=tl.float32)
    acc_wx = tl.zeros((BLOCK_D,), dtype=tl.float32)
    acc_wy = tl.zeros((BLOCK_D,), dtype=tl.float32)
    acc_win = tl.zeros((BLOCK_D,), dtype=tl.float32)
    row = pid.to(tl.int64)
    for _ in range(pid, N, n_programs):
        offs = row * D + cols
        rx = tl.load(rstd_ptr + row * 3)
        ry = tl.load(rstd_ptr + row * 3 + 1)
        x_hat, x2, y_hat, u, s, wx, wy = _recompute(x_ptr, y_ptr, upd_ptr, s_ptr, wx_ptr, wy_ptr, offs, cols, mask,
                                                    c_inv, rx, ry, HAS_UPD, HAS_SCALE, HAS_XNORM, HAS_YNORM)
        gx2 = _load_or_zero(gxo_ptr, offs, mask, HAS_GX, BLOCK_D)
        gy1 = _load_or_zero(gyo_ptr, offs, mask, HAS_GY, BLOCK_D)
        if HAS_GH:
            gu = tl.load(gh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_INNORM:
                rin = tl.load(rstd_ptr + row * 3 + 2)
                win = tl.load(win_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                u_hat = u * rin
                acc_win += gu * u_hat
                gu = _rms_norm_bwd(u_hat, win, gu, rin, D)
            if HAS_SCALE:
                acc_s += gu * x2
            gx2 += s * gu if HAS_SCALE else gu
            if HAS_YNORM:
                acc_wy += gu * y_hat
                gy1 += _rms_norm_bwd(y_hat, wy, gu, ry, D)
            else:
                gy1 += gu
        if HAS_XNORM:
            acc_wx += gx2 * x_hat
            gx1 = _rms_norm_bwd(x_hat, wx, gx2, rx, D)
        else:
            gx1 = gx2
        tl.store(dx_ptr + offs, gx1.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dy_ptr + offs, gy1.to(dy_ptr.dtype.element_ty), mask=mask)
        if HAS_UPD:
            tl.store(dupd_ptr + offs, (c_inv * gx1 + gy1).to(dupd_ptr.dtype.element_ty), mask=mask)
        row += n_programs

    part = pid.to(tl.int64) * D + cols
    if HAS_SCALE:
        tl.store(ds_part_ptr + part, acc_s, mask=mask)
    if HAS_XNORM:
        tl.store(dwx_part_ptr + part, acc_wx, mask=mask)
    if HAS_YNORM:
        tl.store(dwy_part_ptr + part, acc_wy, mask=mask)
    if HAS_INNORM:
        tl.store(dwin_part_ptr + part, acc_win, mask=mask)


@triton.jit
def _add_to(part_ptr, value, mask):
    tl.store(part_ptr, tl.load(part_ptr, mask=mask, other=0.0) + value, mask=mask)


@triton.jit
def _siamese_bwd_wide_kernel(
    gxo_ptr, gyo_ptr, gh_ptr, x_ptr, y_ptr, upd_ptr, s_ptr, wx_ptr, wy_ptr, win_ptr, rstd_ptr,
    dx_ptr, dy_ptr, dupd_ptr, ds_part_ptr, dwx_part_ptr, dwy_part_ptr, dwin_part_ptr,
    N, D, c_inv,
    HAS_UPD: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_XNORM: tl.constexpr,
    HAS_YNORM: tl.constexpr, HAS_INNORM: tl.constexpr,
    HAS_GX: tl.constexpr, HAS_GY: tl.constexpr, HAS_GH: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Wider rows, in chunks of BLOCK_C columns: a row plus four accumulators no
    longer fits the register file. Per row, pass 1 reduces Σ û⊙win⊙gh (input norm),
    pass 2 reduces Σ ŷ⊙wy⊙gu and Σ x̂⊙wx⊙gx2 (Y norm, X post-norm), pass 3 writes the
    gradients and adds the weight-gradient terms to this program's own partial rows
    in global memory (no other program touches them: no atomics, deterministic)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols0 = tl.arange(0, BLOCK_C)
    part = pid.to(tl.int64) * D
    zero = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for c0 in range(0, D, BLOCK_C):
        cols = c0 + cols0
        mask = cols < D
        if HAS_SCALE:
            tl.store(ds_part_ptr + part + cols, zero, mask=mask)
        if HAS_XNORM:
            tl.store(dwx_part_ptr + part + cols, zero, mask=mask)
        if HAS_YNORM:
            tl.store(dwy_part_ptr + part + cols, zero, mask=mask)
        if HAS_INNORM:
            tl.store(dwin_part_ptr + part + cols, zero, mask=mask)

    row = pid.to(tl.int64)
    for _ in range(pid, N, n_programs):
        base = row * D
        rx = tl.load(rstd_ptr + row * 3)
        ry = tl.load(rstd_ptr + row * 3 + 1)
        rin = tl.load(rstd_ptr + row * 3 + 2)
        # pass 1: the input norm's row reduction
        mean_in = 0.0
        if HAS_GH and HAS_INNORM:
            sum_in = tl.zeros((), dtype=tl.float32)
            for c0 in range(0, D, BLOCK_C):
                cols = c0 + cols0
                mask = cols < D
                offs = base + cols
                x_hat, x2, y_hat, u, s, wx, wy = _recompute(x_ptr, y_ptr, upd_ptr, s_ptr, wx_ptr, wy_ptr, offs, cols,
                                                            mask, c_inv, rx, ry,
                                                            HAS_UPD, HAS_SCALE, HAS_XNORM, HAS_YNORM)
                gh = tl.load(gh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                win = tl.load(win_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                sum_in += tl.sum(u * rin * win * gh, axis=0)
            mean_in = sum_in / D
        # pass 2: the Y norm's and the X post-norm's row reductions
        mean_y = 0.0
        mean_x = 0.0
        if (HAS_GH and HAS_YNORM) or HAS_XNORM:
            sum_y = tl.zeros((), dtype=tl.float32)
            sum_x = tl.zeros((), dtype=tl.float32)
            for c0 in range(0, D, BLOCK_C):
                cols = c0 + cols0
                mask = cols < D
                offs = base + cols
                x_hat, x2, y_hat, u, s, wx, wy = _recompute(x_ptr, y_ptr, upd_ptr, s_ptr, wx_ptr, wy_ptr, offs, cols,
                                                            mask, c_inv, rx, ry,
                                                            HAS_UPD, HAS_SCALE, HAS_XNORM, HAS_YNORM)
                gx2 = _load_or_zero(gxo_ptr, offs, mask, HAS_GX, BLOCK_C)
                if HAS_GH:
                    gu = tl.load(gh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                    if HAS_INNORM:
                        win = tl.load(win_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                        u_hat = u * rin
                        gu = rin * (win * gu - u_hat * mean_in)
                    gx2 += s * gu if HAS_SCALE else gu
                    if HAS_YNORM:
                        sum_y += tl.sum(y_hat * wy * gu, axis=0)
                if HAS_XNORM:
                    sum_x += tl.sum(x_hat * wx * gx2, axis=0)
            mean_y = sum_y / D
            mean_x = sum_x / D
        # pass 3: gradients and weight-gradient terms
        for c0 in range(0, D, BLOCK_C):
            cols = c0 + cols0
            mask = cols < D
            offs = base + cols
            x_hat, x2, y_hat, u, s, wx, wy = _recompute(x_ptr, y_ptr, upd_ptr, s_ptr, wx_ptr, wy_ptr, offs, cols,
                                                        mask, c_inv, rx, ry,
                                                        HAS_UPD, HAS_SCALE, HAS_XNORM, HAS_YNORM)
            gx2 = _load_or_zero(gxo_ptr, offs, mask, HAS_GX, BLOCK_C)
            gy1 = _load_or_zero(gyo_ptr, offs, mask, HAS_GY, BLOCK_C)
            if HAS_GH:
                gu = tl.load(gh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                if HAS_INNORM:
                    win = tl.load(win_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                    u_hat = u * rin
                    _add_to(dwin_part_ptr + part + cols, gu * u_hat, mask)
                    gu = rin * (win * gu - u_hat * mean_in)
                if HAS_SCALE:
                    _add_to(ds_part_ptr + part + cols, gu * x2, mask)
                gx2 += s * gu if HAS_SCALE else gu
                if HAS_YNORM:
                    _add_to(dwy_part_ptr + part + cols, gu * y_hat, mask)
                    gy1 += ry * (wy * gu - y_hat * mean_y)
                else:
                    gy1 += gu
            if HAS_XNORM:
                _add_to(dwx_part_ptr + part + cols, gx2 * x_hat, mask)
                gx1 = rx * (wx * gx2 - x_hat * mean_x)
            else:
                gx1 = gx2
            tl.store(dx_ptr + offs, gx1.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dy_ptr + offs, gy1.to(dy_ptr.dtype.element_ty), mask=mask)
            if HAS_UPD:
                tl.store(dupd_ptr + offs, (c_inv * gx1 + gy1).to(dupd_ptr.dtype.element_ty), mask=mask)
        row += n_programs


def _nothing(like: torch.Tensor) -> torch.Tensor:
    return empty((0,), dtype=like.dtype, device=like.device)


@triton_op("laminae::siamese_boundary", mutates_args=())
def siamese_boundary_fused(
    x: torch.Tensor, y: torch.Tensor, update: torch.Tensor | None,
    x_scale: torch.Tensor | None, x_norm_weight: torch.Tensor | None,
    y_norm_weight: torch.Tensor | None, in_norm_weight: torch.Tensor | None,
    c_inv: float, eps: float, store_x: bool, store_y: bool, store_h: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The boundary over rows of ``[N, D]`` contiguous inputs.

    Returns ``(x_new, y_new, h, rstd)``; an output whose ``store_*`` flag is False
    is an empty tensor. ``rstd`` is ``[N, 3]`` fp32 (ρx, ρy, ρin; 1 for absent norms).
    """
    n, d = x.shape
    block_d = block_d_for(d)
    xo = empty((n, d), dtype=x.dtype, device=x.device) if store_x else _nothing(x)
    yo = empty((n, d), dtype=y.dtype, device=y.device) if store_y else _nothing(y)
    h = empty((n, d), dtype=x.dtype, device=x.device) if store_h else _nothing(x)
    rstd = empty((n, 3), dtype=torch.float32, device=x.device)
    if n > 0:
        wrap_triton(_siamese_fwd_kernel)[(n,)](
            x, y, update, x_scale, x_norm_weight, y_norm_weight, in_norm_weight,
            xo, yo, h, rstd, d, c_inv, eps,
            HAS_UPD=update is not None, HAS_SCALE=x_scale is not None,
            HAS_XNORM=x_norm_weight is not None, HAS_YNORM=y_norm_weight is not None,
            HAS_INNORM=in_norm_weight is not None,
            STORE_X=store_x, STORE_Y=store_y, STORE_H=store_h,
            BLOCK_D=block_d, num_warps=num_warps_for(block_d),
        )
    return xo, yo, h, rstd


@triton_op("laminae::siamese_boundary_bwd", mutates_args=())
def _siamese_boundary_bwd(
    g_x: torch.Tensor | None, g_y: torch.Tensor | None, g_h: torch.Tensor | None,
    x: torch.Tensor, y: torch.Tensor, update: torch.Tensor | None,
    x_scale: torch.Tensor | None, x_norm_weight: torch.Tensor | None,
    y_norm_weight: torch.Tensor | None, in_norm_weight: torch.Tensor | None,
    rstd: torch.Tensor, c_inv: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, d = x.shape
    block_d = block_d_for(d)
    programs = num_programs_for_rows(n, x.device)
    dx = empty((n, d), dtype=x.dtype, device=x.device)
    dy = empty((n, d), dtype=y.dtype, device=y.device)
    dupd = empty((n, d), dtype=update.dtype, device=x.device) if update is not None else _nothing(x)

    def partial(w):
        return empty((programs, d), dtype=torch.float32, device=x.device) if w is not None else None

    parts = [partial(w) for w in (x_scale, x_norm_weight, y_norm_weight, in_norm_weight)]
    args = (g_x, g_y, g_h, x, y, update, x_scale, x_norm_weight, y_norm_weight, in_norm_weight, rstd,
            dx, dy, dupd if update is not None else None, *parts, n, d, c_inv)
    flags = dict(HAS_UPD=update is not None, HAS_SCALE=x_scale is not None,
                 HAS_XNORM=x_norm_weight is not None, HAS_YNORM=y_norm_weight is not None,
                 HAS_INNORM=in_norm_weight is not None,
                 HAS_GX=g_x is not None, HAS_GY=g_y is not None, HAS_GH=g_h is not None)
    if block_d <= BWD_MAX_ROW_BLOCK:
        wrap_triton(_siamese_bwd_kernel)[(programs,)](
            *args, **flags, BLOCK_D=block_d, num_warps=bwd_num_warps_for(block_d))
    else:
        chunk = min(BWD_CHUNK, block_d)
        wrap_triton(_siamese_bwd_wide_kernel)[(programs,)](
            *args, **flags, BLOCK_C=chunk, num_warps=bwd_num_warps_for(chunk))
    parts = [p if p is not None else _nothing(rstd) for p in parts]
    return dx, dy, dupd, *parts


def _setup_context(ctx, inputs, output):
    x, y, update, x_scale, wx, wy, win, c_inv, eps, store_x, store_y, store_h = inputs
    ctx.save_for_backward(x, y, update, x_scale, wx, wy, win, output[3])
    ctx.c_inv = c_inv
    ctx.stored = (store_x, store_y, store_h)


def _backward(ctx, g_x, g_y, g_h, g_rstd):
    x, y, update, x_scale, wx, wy, win, rstd = ctx.saved_tensors
    store_x, store_y, store_h = ctx.stored
    g_x = g_x.contiguous() if store_x and g_x is not None else None
    g_y = g_y.contiguous() if store_y and g_y is not None else None
    g_h = g_h.contiguous() if store_h and g_h is not None else None
    dx, dy, dupd, *parts = _siamese_boundary_bwd(g_x, g_y, g_h, x, y, update, x_scale, wx, wy, win,
                                                 rstd, ctx.c_inv)
    dweights = [p.sum(0).to(w.dtype) if w is not None else None
                for p, w in zip(parts, (x_scale, wx, wy, win))]
    return (dx, dy, dupd if update is not None else None, *dweights,
            None, None, None, None, None)


siamese_boundary_fused.register_autograd(_backward, setup_context=_setup_context)


def siamese_boundary(
    x: torch.Tensor,
    y: torch.Tensor,
    update: torch.Tensor | None = None,
    c_inv: float = 1.0,
    x_scale: torch.Tensor | None = None,
    x_norm_weight: torch.Tensor | None = None,
    y_norm_weight: torch.Tensor | None = None,
    in_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    return_streams: bool = True,
    return_h: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Triton SiameseNorm boundary with the signature of
    :func:`laminae.primitives.siamese_norm.siamese_boundary_reference`.

    ``x``, ``y`` (and ``update``): ``[..., D]`` fp32/bf16/fp16 with D ≤ 8192; the
    weights ``[D]`` in any of those dtypes. Returns ``(x_new, y_new, h)`` in the
    input dtype. A stream the boundary leaves unchanged (X without update and
    post-norm, Y without update) is returned as the input tensor itself.
    """
    check_boundary_args(x, y, update, c_inv, x_scale, x_norm_weight, y_norm_weight, in_norm_weight, eps)
    for name, t in (("x", x), ("update", update), ("x_scale", x_scale), ("x_norm_weight", x_norm_weight),
                    ("y_norm_weight", y_norm_weight), ("in_norm_weight", in_norm_weight)):
        if t is not None and t.dtype not in _KERNEL_DTYPES:
            raise DTypeError(f"Triton SiameseNorm supports fp32/bf16/fp16 `{name}`, got {t.dtype}")
    d = x.shape[-1]
    if d > MAX_HIDDEN:
        raise ConfigError(
            f"Triton SiameseNorm keeps a row in one program: the last dim must be <= {MAX_HIDDEN}, got {d}; "
            "use backend='reference' for wider rows"
        )
    if not return_h:  # the fused-input pieces only shape h
        x_scale = y_norm_weight = in_norm_weight = None
    store_x = return_streams and (update is not None or x_norm_weight is not None)
    store_y = return_streams and update is not None
    if not (store_x or store_y or return_h):
        return (x, y, None) if return_streams else (None, None, None)

    shape = x.shape
    x2, y2, upd2 = contiguous(x.reshape(-1, d), y.reshape(-1, d), None if update is None else update.reshape(-1, d))
    weights = contiguous(x_scale, x_norm_weight, y_norm_weight, in_norm_weight)
    xo, yo, h, _ = siamese_boundary_fused(x2, y2, upd2, *weights, float(c_inv), float(eps),
                                          store_x, store_y, return_h)
    h = h.reshape(shape) if return_h else None
    if not return_streams:
        return None, None, h
    x_new = xo.reshape(shape) if store_x else x
    y_new = yo.reshape(shape) if store_y else y
    return x_new, y_new, h


# ----------------------------------------------------------------------------
# Launch configurations (static sm_90 check) and the tour
# ----------------------------------------------------------------------------

# Flag sets the modules launch with, plus everything on (the register-pressure worst case).
_FWD_FLAGS = {
    "attn_scale": dict(HAS_UPD=False, HAS_SCALE=True, HAS_XNORM=False, HAS_YNORM=True, HAS_INNORM=True,
                       STORE_X=False, STORE_Y=False, STORE_H=True),
    "attn_postnorm": dict(HAS_UPD=False, HAS_SCALE=False, HAS_XNORM=True, HAS_YNORM=True, HAS_INNORM=True,
                          STORE_X=True, STORE_Y=False, STORE_H=True),
    "attn_plain": dict(HAS_UPD=False, HAS_SCALE=True, HAS_XNORM=False, HAS_YNORM=False, HAS_INNORM=False,
                       STORE_X=False, STORE_Y=False, STORE_H=True),
    "mlp": dict(HAS_UPD=True, HAS_SCALE=False, HAS_XNORM=True, HAS_YNORM=True, HAS_INNORM=True,
                STORE_X=True, STORE_Y=True, STORE_H=True),
    "update": dict(HAS_UPD=True, HAS_SCALE=False, HAS_XNORM=False, HAS_YNORM=False, HAS_INNORM=False,
                   STORE_X=True, STORE_Y=True, STORE_H=False),
    "final": dict(HAS_UPD=False, HAS_SCALE=False, HAS_XNORM=True, HAS_YNORM=True, HAS_INNORM=True,
                  STORE_X=False, STORE_Y=False, STORE_H=True),
    "all": dict(HAS_UPD=True, HAS_SCALE=True, HAS_XNORM=True, HAS_YNORM=True, HAS_INNORM=True,
                STORE_X=True, STORE_Y=True, STORE_H=True),
}


def _bwd_flags(fwd: dict) -> dict:
    keep = ("HAS_UPD", "HAS_SCALE", "HAS_XNORM", "HAS_YNORM", "HAS_INNORM")
    return {**{k: fwd[k] for k in keep}, "HAS_GX": fwd["STORE_X"], "HAS_GY": fwd["STORE_Y"],
            "HAS_GH": fwd["STORE_H"]}


def static_cases() -> Iterator[StaticCase]:
    block_ds = [2**k for k in range(4, 14)]  # 16 … 8192
    for dt in ("fp32", "bf16"):
        p = f"*{dt}"
        w = "*fp32"
        fwd_sig = dict(x_ptr=p, y_ptr=p, upd_ptr=p, s_ptr=w, wx_ptr=w, wy_ptr=w, win_ptr=w,
                       xo_ptr=p, yo_ptr=p, h_ptr=p, rstd_ptr="*fp32", D="i32", c_inv="fp32", eps="fp32")
        bwd_sig = dict(gxo_ptr=p, gyo_ptr=p, gh_ptr=p, x_ptr=p, y_ptr=p, upd_ptr=p, s_ptr=w, wx_ptr=w,
                       wy_ptr=w, win_ptr=w, rstd_ptr="*fp32", dx_ptr=p, dy_ptr=p, dupd_ptr=p,
                       ds_part_ptr="*fp32", dwx_part_ptr="*fp32", dwy_part_ptr="*fp32", dwin_part_ptr="*fp32",
                       N="i32", D="i32", c_inv="fp32")
        # every pointer is a contiguous input, weight or fresh output: 16-byte aligned at
        # launch, which Triton specialises (D varies, so it is not declared)
        fwd_aligned = tuple(k for k, v in fwd_sig.items() if v.startswith("*"))
        bwd_aligned = tuple(k for k, v in bwd_sig.items() if v.startswith("*"))
        for label, flags in _FWD_FLAGS.items():
            tags = {"dtype": dt, "flags": label}
            for block_d in block_ds:
                yield StaticCase("siamese_fwd", _siamese_fwd_kernel, fwd_sig, {**flags, "BLOCK_D": block_d},
                                 num_warps_for(block_d), tags=tags, divisible=fwd_aligned)
                if block_d <= BWD_MAX_ROW_BLOCK:
                    yield StaticCase("siamese_bwd", _siamese_bwd_kernel, bwd_sig,
                                     {**_bwd_flags(flags), "BLOCK_D": block_d}, bwd_num_warps_for(block_d),
                                     tags=tags, divisible=bwd_aligned)
            # rows wider than BWD_MAX_ROW_BLOCK: one chunked configuration
            yield StaticCase("siamese_bwd_wide", _siamese_bwd_wide_kernel, bwd_sig,
                             {**_bwd_flags(flags), "BLOCK_C": BWD_CHUNK}, bwd_num_warps_for(BWD_CHUNK), tags=tags,
                             divisible=bwd_aligned)


def tour_case(device: torch.device):
    from laminae.primitives.siamese_norm import siamese_boundary_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    rows, d = 2 * 64, 256

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(device)

    inputs = {
        "x": rnd(rows, d),
        "y": rnd(rows, d, scale=3.0),
        "update": rnd(rows, d),
        "c_inv": 1.0 / (2.0 * 3) ** 0.5,  # layer 2
        "x_scale": rnd(d, scale=0.1, shift=1.0),
        "x_norm_weight": rnd(d, scale=0.1, shift=1.0),
        "y_norm_weight": rnd(d, scale=0.1, shift=1.0),
        "in_norm_weight": rnd(d, scale=0.1, shift=1.0),
    }
    grads = ["x", "y", "update", "x_scale", "x_norm_weight", "y_norm_weight", "in_norm_weight"]
    return TourCase("siamese_norm (MLP boundary, all norms + scale)", siamese_boundary,
                    siamese_boundary_reference, inputs, grads)
