"""Fused elastic tier matmul: ``y = (x · (σ·(a·init + b·delta))[:R, :C]ᵀ) / e``.

The tier weight is never written to memory. Every kernel reads ``init`` and
``delta`` tiles straight from the full-size ``[out_features, in_features]``
tensors (row stride ``in_features``, masks at R and C), combines them on chip
with the reference's roundings, casts the tile to the activation dtype and feeds
a tensor-core ``tl.dot`` with fp32 accumulation.

Forward  y  [M, R]: grid (M/BM, R/BN), K loop over C.
dx       dx [M, C] = (dy/e) · W':  grid (M/BM, C/BN), K loop over R, the same
         on-the-fly combine (W' rows are W's rows: no transpose in memory).
dW       G  [R, C] = (dy/e)ᵀ · x:  grid (R/BN, C/BK, splits of M), K loop over M; the epilogue
         writes σ·b·G into d delta (σ·a·G into d init only when init is trainable),
         leaving the rest of the full-size gradient at zero, and, when σ is a
         learned scale, per-tile partial sums of G ⊙ W_τ for dσ (summed in torch).
         A small block (few tiles) splits M across programs into an fp32 workspace
         reduced in torch, so a 640×640 block still fills the GPU (deterministic).
Saved for backward: x, the parameter tensors, the keep mask (no W_τ).

Prefill and training sizes (M ≥ CUBLAS_MIN_ROWS) skip the fused fwd and dx: one
elementwise pass writes W_τ [R, C] in the activation dtype (the same _tier_weight,
so the reference's roundings), then cuBLAS computes x·W_τᵀ and (dy/e)·W_τ. At the
goal shape (1024 × 1024 block, M = 16384, bf16) the product is 34.4 GFLOP (34.7 µs
at 990 TFLOP/s) over ≈ 71 MB (15 µs at 4.8 TB/s): compute-bound. The fused forward
recombines the block once per 128-row M tile, 128 × 1.05 M elements × ≈ 15 ALU ops
= 2.0 G ops ≈ 60 µs on the FP32 pipes (≈ 33 T ops/s), with one 8-warp CTA per SM
(register-limited) issuing HGMMA.64x64x16, so it overlaps little with the MMA:
≈ 60–113 µs, 31–58 % of peak. Transient: a 6.3 MB pass (≈ 1.3 µs + a launch) and
cuBLAS at 70–80 %: ≈ 47–52 µs, 67–74 %. The fused path pays ≈ 0.47 µs of combine
per 128 rows against the transient path's ≈ 3 µs once: equal near 800 rows, hence
1024. dW keeps its kernel at every M: its K loop has no combine (W_τ only in the
epilogue, for dσ), while cuBLAS would need dy/e and the masked x written out first
(two 67 MB passes, ≈ 28 µs next to a 35 µs product).
"""
from __future__ import annotations

from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import DTypeError
from laminae.primitives.shared_matrix import check_operands, fan_in_multipliers

from ._common import StaticCase, contiguous, dot_precision, empty, triton_dtype

__all__ = ["shared_matrix", "shared_matrix_linear"]

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Activation dtype -> parameter dtypes the kernels are compiled for: the same dtype,
# or fp32 master weights under autocast.
DTYPE_PAIRS = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.bfloat16, torch.float32), (torch.float16, torch.float32))

# Launch tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), sized for Hopper's
# wgmma (64 rows per warpgroup) and for the register cost of the on-chip combine: two
# weight tiles and their fp32 sum live next to the accumulator, so 8 warps share them.
# Decode-sized inputs (M <= 64) take a 64-row tile so one token does not pay for 128.
# fp32 activations use exact ("ieee") products, which are not tensor-core shaped: a
# smaller tile keeps them free of spills.
SMALL_M = 64
TILES = {
    "16bit": {"small_m": (64, 128, 32, 8, 3), "large_m": (128, 64, 32, 8, 3)},
    "fp32": {"any_m": (64, 64, 16, 8, 2)},
}
# dW: an output tile of [BLOCK_R rows, BLOCK_C columns] of W, M streamed in BLOCK_M chunks.
DW_TILES = {"16bit": (128, 64, 64, 8, 3), "fp32": (64, 64, 32, 8, 2)}
# From this many rows on, forward and dx combine the tier weight once into a transient
# [R, C] tensor and hand the product to cuBLAS (module docstring: the arithmetic).
CUBLAS_MIN_ROWS = 1024
# The transient combine is elementwise: (BLOCK_R, BLOCK_C, num_warps).
COMBINE_TILE = (32, 64, 4)


def _dtype_class(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16bit"


@triton.jit
def _tier_weight(w0_ptr, d_ptr, offs, mask, a, b, alpha, SPLIT: tl.constexpr):
    """A tile of σ·(a·init + b·delta) (or σ·weight), rounded to the parameter dtype
    after each product and the sum, as the reference computes it; returned in fp32."""
    pdt = w0_ptr.dtype.element_ty
    w = tl.load(w0_ptr + offs, mask=mask, other=0.0)
    if SPLIT:
        dl = tl.load(d_ptr + offs, mask=mask, other=0.0)
        w = ((a * w.to(tl.float32)).to(pdt).to(tl.float32) + (b * dl.to(tl.float32)).to(pdt).to(tl.float32)).to(pdt)
    # σ = 1 when there is no learned scale: an exact multiply and an exact rounding.
    return (w.to(tl.float32) * alpha).to(pdt).to(tl.float32)


@triton.jit
def _tier_weight_kernel(w0_ptr, d_ptr, scale_ptr, w_ptr, R, C, stride_w, a, b, has_scale,
                        SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """W_τ [R, C] in the activation dtype (w_ptr's), one pass over the block."""
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    col0 = tl.program_id(1).to(tl.int64) * BLOCK_C
    rr = tl.arange(0, BLOCK_R)
    cc = tl.arange(0, BLOCK_C)
    mask = (row0 + rr < R)[:, None] & (col0 + cc < C)[None, :]
    alpha = tl.load(scale_ptr, mask=has_scale != 0, other=1.0).to(tl.float32)
    w_base = row0 * stride_w + col0
    w = _tier_weight(w0_ptr + w_base, d_ptr + w_base, rr[:, None] * stride_w + cc[None, :], mask, a, b, alpha, SPLIT)
    tl.store(w_ptr + (row0 * C + col0) + (rr[:, None] * C + cc[None, :]), w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_mask(keep_ptr, offs_m, M, has_keep):
    """Rows that exist and are kept. Without a mask nothing is read (has_keep = 0)."""
    inside = offs_m < M
    keep = tl.load(keep_ptr + offs_m, mask=inside & (has_keep != 0), other=1)
    return inside & (keep != 0)


@triton.jit
def _shared_matrix_fwd_kernel(x_ptr, w0_ptr, d_ptr, scale_ptr, keep_ptr, y_ptr,
                              M, R, C, stride_w, a, b, divisor, has_scale, has_keep,
                              SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = _row_mask(keep_ptr, offs_m, M, has_keep)
    n_mask = offs_n < R
    alpha = tl.load(scale_ptr, mask=has_scale != 0, other=1.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < C
        x = tl.load(x_ptr + offs_m[:, None] * C + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # [BLOCK_N, BLOCK_K] tile of W_τ read in place (rows contiguous), transposed on chip
        w = _tier_weight(w0_ptr, d_ptr, offs_n[:, None] * stride_w + offs_k[None, :],
                         n_mask[:, None] & k_mask[None, :], a, b, alpha, SPLIT)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    # The reference rounds the matmul output before dividing by e.
    y = (acc.to(y_ptr.dtype.element_ty).to(tl.float32) / divisor).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * R + offs_n[None, :], y, mask=(offs_m < M)[:, None] & n_mask[None, :])


@triton.jit
def _shared_matrix_dx_kernel(dy_ptr, w0_ptr, d_ptr, scale_ptr, keep_ptr, dx_ptr,
                             M, R, C, stride_w, a, b, divisor, has_scale, has_keep,
                             SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid_c.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = _row_mask(keep_ptr, offs_m, M, has_keep)
    c_mask = offs_c < C
    alpha = tl.load(scale_ptr, mask=has_scale != 0, other=1.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_K):
        offs_r = r0 + tl.arange(0, BLOCK_K)
        r_mask = offs_r < R
        dy = tl.load(dy_ptr + offs_m[:, None] * R + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        # d(y/e) = dy/e, rounded to dy's dtype as autograd of the reference does
        dy = (dy.to(tl.float32) / divisor).to(dy_ptr.dtype.element_ty)
        w = _tier_weight(w0_ptr, d_ptr, offs_r[:, None] * stride_w + offs_c[None, :],
                         r_mask[:, None] & c_mask[None, :], a, b, alpha, SPLIT)
        acc = tl.dot(dy, w.to(dy.dtype), acc, input_precision=PRECISION)
    tl.store(dx_ptr + offs_m[:, None] * C + offs_c[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & c_mask[None, :])


@triton.jit
def _shared_matrix_dw_kernel(dy_ptr, x_ptr, w0_ptr, d_ptr, scale_ptr, keep_ptr, dw0_ptr, dd_ptr, part_ptr, ws_ptr,
                             M, R, C, stride_w, a, b, divisor, has_scale, has_keep, want_w0, want_delta,
                             m_chunk, use_ws,
                             SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_s = tl.program_id(2)  # split of M (1 split unless the [R, C] block has too few tiles)
    # int64 only in the scalar tile bases; in-tile offsets stay int32 (a [128, 64] int64
    # offset tensor alone would take 64 registers per thread).
    row0 = pid_r.to(tl.int64) * BLOCK_R
    col0 = pid_c.to(tl.int64) * BLOCK_C
    rr = tl.arange(0, BLOCK_R)
    cc = tl.arange(0, BLOCK_C)
    mm = tl.arange(0, BLOCK_M)
    r_mask = row0 + rr < R
    c_mask = col0 + cc < C
    m_start = pid_s.to(tl.int64) * m_chunk
    m_end = tl.minimum(M, m_start + m_chunk)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for m0 in range(m_start, m_end, BLOCK_M):
        # padded rows contribute nothing, whatever x and dy hold there
        m_mask = _row_mask(keep_ptr, m0 + mm, m_end, has_keep)
        dy_t = tl.load(dy_ptr + (m0 * R + row0) + (mm[None, :] * R + rr[:, None]),
                       mask=r_mask[:, None] & m_mask[None, :], other=0.0)
        dy_t = (dy_t.to(tl.float32) / divisor).to(dy_ptr.dtype.element_ty)
        x = tl.load(x_ptr + (m0 * C + col0) + (mm[:, None] * C + cc[None, :]),
                    mask=m_mask[:, None] & c_mask[None, :], other=0.0)
        acc = tl.dot(dy_t, x, acc, input_precision=PRECISION)
    mask = r_mask[:, None] & c_mask[None, :]
    w_base = row0 * stride_w + col0
    local = rr[:, None] * stride_w + cc[None, :]
    alpha = tl.load(scale_ptr, mask=has_scale != 0, other=1.0).to(tl.float32)
    if has_scale != 0:
        # dσ = Σ G ⊙ W_τ (the unscaled tier weight): one partial sum per tile and split
        w = _tier_weight(w0_ptr + w_base, d_ptr + w_base, local, mask, a, b, 1.0, SPLIT)
        tile = (pid_s * tl.num_programs(0) + pid_r) * tl.num_programs(1) + pid_c
        tl.store(part_ptr + tile, tl.sum(tl.sum(acc * w, axis=1), axis=0))
    if use_ws != 0:
        # split M: raw fp32 partial G per split, reduced (and scaled) in torch
        tl.store(ws_ptr + ((pid_s * R + row0) * C + col0) + (rr[:, None] * C + cc[None, :]), acc, mask=mask)
    else:
        pdt = w0_ptr.dtype.element_ty
        if SPLIT:
            tl.store(dd_ptr + w_base + local, (acc * (alpha * b)).to(pdt), mask=mask & (want_delta != 0))
            tl.store(dw0_ptr + w_base + local, (acc * (alpha * a)).to(pdt), mask=mask & (want_w0 != 0))
        else:
            tl.store(dw0_ptr + w_base + local, (acc * alpha).to(pdt), mask=mask & (want_w0 != 0))


# ----------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------

def _tile(m: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    tiles = TILES[_dtype_class(dtype)]
    if len(tiles) == 1:
        return next(iter(tiles.values()))
    return tiles["small_m" if m <= SMALL_M else "large_m"]


def _placeholder(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A zero-element tensor standing in for an absent pointer argument (never read)."""
    return torch.empty(0, dtype=dtype, device=like.device)


def _flags(weight, delta, scale, keep):
    return (delta if delta is not None else weight,
            scale if scale is not None else _placeholder(weight, weight.dtype),
            keep if keep is not None else _placeholder(weight, torch.bool),
            int(scale is not None), int(keep is not None))


def _transient(m: int) -> bool:
    """Prefill and training sizes take the transient weight and cuBLAS (from the shape only)."""
    return m >= CUBLAS_MIN_ROWS


def _transient_weight(weight, delta, scale, rows: int, cols: int, a: float, b: float,
                      dtype: torch.dtype) -> torch.Tensor:
    """W_τ = σ·(a·init + b·delta)[:rows, :cols] in ``dtype``, the fused kernels' combine
    (the reference's roundings) written out once."""
    w = empty((rows, cols), dtype=dtype, device=weight.device)
    d, s, _, has_scale, _ = _flags(weight, delta, scale, None)
    block_r, block_c, warps = COMBINE_TILE
    wrap_triton(_tier_weight_kernel)[(triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))](
        weight, d, s, w, rows, cols, weight.stride(0), a, b, has_scale,
        SPLIT=delta is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
    )
    return w


def _finish(out: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Dropped rows are zero whatever they held (NaN too): the rows of a product are independent."""
    if keep is not None:
        out.masked_fill_(~keep[:, None], 0.0)
    return out


@triton_op("laminae::shared_matrix_linear", mutates_args=())
def shared_matrix_linear(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None,
                         scale: torch.Tensor | None, keep: torch.Tensor | None,
                         rows: int, cols: int, a: float, b: float, divisor: float) -> torch.Tensor:
    """``y [M, rows] = (x [M, cols] · (σ·(a·weight + b·delta))[:rows, :cols]ᵀ) / divisor``.

    ``weight``/``delta``: full-size ``[out, in]`` (``delta`` None: unsplit); ``scale``:
    one element or None; ``keep``: ``[M]`` bool or None (dropped rows read as 0).
    """
    m = x.shape[0]
    if _transient(m):
        # the reference's roundings: the product rounded to x's dtype, then ÷ e
        y = x @ _transient_weight(weight, delta, scale, rows, cols, a, b, x.dtype).t()
        return _finish(y.div_(divisor) if divisor != 1.0 else y, keep)
    y = empty((m, rows), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    d, s, k, has_scale, has_keep = _flags(weight, delta, scale, keep)
    block_m, block_n, block_k, warps, stages = _tile(m, x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(rows, block_n))
    wrap_triton(_shared_matrix_fwd_kernel)[grid](
        x, weight, d, s, k, y, m, rows, cols, weight.stride(0), a, b, divisor, has_scale, has_keep,
        SPLIT=delta is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype), num_warps=warps, num_stages=stages,
    )
    return y


@triton_op("laminae::shared_matrix_linear_dx", mutates_args=())
def _shared_matrix_linear_dx(dy: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None,
                             scale: torch.Tensor | None, keep: torch.Tensor | None,
                             rows: int, cols: int, a: float, b: float, divisor: float) -> torch.Tensor:
    m = dy.shape[0]
    if _transient(m):
        dy_e = dy / divisor if divisor != 1.0 else dy  # rounded to dy's dtype, as autograd of the reference
        return _finish(dy_e @ _transient_weight(weight, delta, scale, rows, cols, a, b, dy.dtype), keep)
    dx = empty((m, cols), dtype=dy.dtype, device=dy.device)
    if m == 0:
        return dx
    d, s, k, has_scale, has_keep = _flags(weight, delta, scale, keep)
    block_m, block_n, block_k, warps, stages = _tile(m, dy.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(cols, block_n))
    wrap_triton(_shared_matrix_dx_kernel)[grid](
        dy, weight, d, s, k, dx, m, rows, cols, weight.stride(0), a, b, divisor, has_scale, has_keep,
        SPLIT=delta is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=dot_precision(dy.dtype), num_warps=warps, num_stages=stages,
    )
    return dx


def _dw_splits(m: int, tiles: int, block_m: int, device: torch.device) -> tuple[int, int]:
    """(splits, rows per split): split M when the [R, C] block alone has fewer tiles
    than the device has room for (a 640×640 q_proj block is 50 tiles on 132 SMs);
    each split keeps at least two BLOCK_M chunks."""
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    splits = 1 if tiles >= target else max(1, min(triton.cdiv(target, tiles), triton.cdiv(m, 2 * block_m)))
    chunk = triton.cdiv(triton.cdiv(m, splits), block_m) * block_m
    return triton.cdiv(m, chunk), chunk


@triton_op("laminae::shared_matrix_linear_dw", mutates_args=())
def _shared_matrix_linear_dw(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None,
                             scale: torch.Tensor | None, keep: torch.Tensor | None,
                             rows: int, cols: int, a: float, b: float, divisor: float,
                             want_weight: bool, want_delta: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-size gradients of ``weight`` and ``delta`` (zero outside the block; empty when
    not wanted) and the per-tile partial sums of dσ (empty without a scale)."""
    m = x.shape[0]
    block_r, block_c, block_m, warps, stages = DW_TILES[_dtype_class(x.dtype)]
    tiles_r, tiles_c = triton.cdiv(rows, block_r), triton.cdiv(cols, block_c)
    splits, chunk = _dw_splits(m, tiles_r * tiles_c, block_m, x.device) if m else (1, block_m)
    want_delta = want_delta and delta is not None
    # Outside the tier block the gradient is exactly zero: the kernel writes the block only.
    dw0 = torch.zeros_like(weight) if want_weight else _placeholder(weight, weight.dtype)
    dd = torch.zeros_like(weight) if want_delta else _placeholder(weight, weight.dtype)
    parts = empty((splits * tiles_r * tiles_c if scale is not None else 0,), dtype=torch.float32, device=x.device)
    if m == 0:
        return dw0, dd, parts.zero_()
    ws = empty((splits, rows, cols) if splits > 1 else (0,), dtype=torch.float32, device=x.device)
    d, s, k, has_scale, has_keep = _flags(weight, delta, scale, keep)
    wrap_triton(_shared_matrix_dw_kernel)[(tiles_r, tiles_c, splits)](
        dy, x, weight, d, s, k, dw0, dd, parts, ws, m, rows, cols, weight.stride(0), a, b, divisor,
        has_scale, has_keep, int(want_weight), int(want_delta), chunk, int(splits > 1),
        SPLIT=delta is not None, BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_M=block_m,
        PRECISION=dot_precision(x.dtype), num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        g = ws.sum(0)
        alpha = scale.float() if scale is not None else 1.0
        if want_delta:
            dd[:rows, :cols] = (g * (alpha * b)).to(weight.dtype)
        if want_weight:
            dw0[:rows, :cols] = (g * (alpha * (a if delta is not None else 1.0))).to(weight.dtype)
    return dw0, dd, parts


def _setup_context(ctx, inputs, output):
    x, weight, delta, scale, keep, rows, cols, a, b, divisor = inputs
    ctx.save_for_backward(x, weight, delta, scale, keep)
    ctx.block = (rows, cols, a, b, divisor)


def _backward(ctx, dy):
    x, weight, delta, scale, keep = ctx.saved_tensors
    rows, cols, a, b, divisor = ctx.block
    need_x, need_w, need_d, need_s = ctx.needs_input_grad[:4]
    dy = dy.contiguous()
    dx = _shared_matrix_linear_dx(dy, weight, delta, scale, keep, rows, cols, a, b, divisor) if need_x else None
    dw = dd = ds = None
    if need_w or need_d or need_s:
        dw0, dd_full, parts = _shared_matrix_linear_dw(dy, x, weight, delta, scale, keep, rows, cols, a, b, divisor,
                                                       bool(need_w), bool(need_d))
        dw = dw0 if need_w else None
        dd = dd_full if need_d else None
        ds = parts.sum().reshape(scale.shape).to(scale.dtype) if need_s else None
    return dx, dw, dd, ds, None, None, None, None, None, None


shared_matrix_linear.register_autograd(_backward, setup_context=_setup_context)


def shared_matrix(
    x: torch.Tensor,
    weight: torch.Tensor,
    delta: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    rows: int,
    cols: int,
    ratio: float = 1.0,
    output_divisor: float = 1.0,
) -> torch.Tensor:
    """Triton tier matmul with the signature of
    :func:`laminae.primitives.shared_matrix.shared_matrix_reference`.

    ``x [..., cols]`` fp32/bf16/fp16; parameters in the same dtype or fp32 (autocast).
    Returns ``[..., rows]`` in ``x.dtype``. Gradients: ``x``, ``weight`` (= ``init``,
    only when it requires grad), ``delta`` and ``scale``, all full-size, exactly zero
    outside the block.
    """
    keep = check_operands(x, weight, delta, rows, cols, ratio, scale, output_divisor, attention_mask)
    if x.dtype not in KERNEL_DTYPES or (x.dtype, weight.dtype) not in DTYPE_PAIRS:
        pairs = ", ".join(f"x {triton_dtype(p[0])} with weights {triton_dtype(p[1])}" for p in DTYPE_PAIRS)
        raise DTypeError(f"Triton shared_matrix supports {pairs}; got x {x.dtype} with weights {weight.dtype} "
                         "(use backend='reference' for fp64)")
    a, b = fan_in_multipliers(float(ratio))
    lead = x.shape[:-1]
    x2, weight, delta = contiguous(x.reshape(-1, cols), weight, delta)
    scale = None if scale is None else scale.reshape(1)
    keep = None if keep is None else keep.reshape(-1).contiguous()
    y = shared_matrix_linear(x2, weight, delta, scale, keep, rows, cols, a, b, float(output_divisor))
    return y.reshape(*lead, rows)


# ----------------------------------------------------------------------------
# Static sm_90 configurations and the tour
# ----------------------------------------------------------------------------

def _pointers(signature: dict) -> tuple[str, ...]:
    """Every pointer: parameters, fresh outputs, contiguous activations and the
    placeholders are 16-byte aligned at launch (Triton specialises them)."""
    return tuple(k for k, v in signature.items() if v.startswith("*"))


def static_cases() -> Iterator[StaticCase]:
    for x_dtype, p_dtype in DTYPE_PAIRS:
        xt, pt = triton_dtype(x_dtype), triton_dtype(p_dtype)
        precision = dot_precision(x_dtype)
        scalars = dict(M="i32", R="i32", C="i32", stride_w="i32", a="fp32", b="fp32", divisor="fp32",
                       has_scale="i32", has_keep="i32")
        params = dict(w0_ptr=f"*{pt}", d_ptr=f"*{pt}", scale_ptr=f"*{pt}", keep_ptr="*i1")
        tags = {"x": xt, "weights": pt}
        cls = _dtype_class(x_dtype)
        expect = "HGMMA" if cls == "16bit" else ""   # the tile products on wgmma; fp32 is exact on FMA
        for split in (True, False):
            for tile, (block_m, block_n, block_k, warps, stages) in TILES[cls].items():
                const = dict(SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision)
                fwd = dict(x_ptr=f"*{xt}", **params, y_ptr=f"*{xt}", **scalars)
                yield StaticCase("shared_matrix_fwd", _shared_matrix_fwd_kernel, fwd,
                                 const, warps, stages, tags=tags | {"tile": tile}, divisible=_pointers(fwd),
                                 expect=expect)
                dx = dict(dy_ptr=f"*{xt}", **params, dx_ptr=f"*{xt}", **scalars)
                yield StaticCase("shared_matrix_dx", _shared_matrix_dx_kernel, dx,
                                 const, warps, stages, tags=tags | {"tile": tile}, divisible=_pointers(dx),
                                 expect=expect)
            block_r, block_c, warps = COMBINE_TILE
            combine = dict(w0_ptr=f"*{pt}", d_ptr=f"*{pt}", scale_ptr=f"*{pt}", w_ptr=f"*{xt}", R="i32", C="i32",
                           stride_w="i32", a="fp32", b="fp32", has_scale="i32")
            yield StaticCase("shared_matrix_tier_weight", _tier_weight_kernel, combine,
                             dict(SPLIT=split, BLOCK_R=block_r, BLOCK_C=block_c), warps, tags=tags,
                             divisible=_pointers(combine))
            block_r, block_c, block_m, warps, stages = DW_TILES[cls]
            dw = dict(dy_ptr=f"*{xt}", x_ptr=f"*{xt}", **params, dw0_ptr=f"*{pt}", dd_ptr=f"*{pt}",
                      part_ptr="*fp32", ws_ptr="*fp32", **scalars, want_w0="i32", want_delta="i32",
                      m_chunk="i32", use_ws="i32")
            yield StaticCase("shared_matrix_dw", _shared_matrix_dw_kernel, dw,
                             dict(SPLIT=split, BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_M=block_m,
                                  PRECISION=precision), warps, stages, tags=tags, divisible=_pointers(dw),
                             expect=expect)


def tour_case(device: torch.device):
    from laminae.primitives.shared_matrix import shared_matrix_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    out_features, in_features, rows, cols, tokens = 320, 192, 200, 130, 2 * 37
    inputs = {
        "x": torch.randn(tokens, cols, generator=gen).to(device),
        "weight": (torch.randn(out_features, in_features, generator=gen) / 8).to(device),
        "delta": (torch.randn(out_features, in_features, generator=gen) / 8).to(device),
        "scale": torch.tensor([0.7]).to(device),
        "rows": rows, "cols": cols, "ratio": 3.0, "output_divisor": 2.0,
    }
    return TourCase("shared_matrix (split, learned scale, r=3)", shared_matrix, shared_matrix_reference,
                    inputs, ["x", "weight", "delta", "scale"])
