"""LUCID preconditioned attention: Triton kernels.

The preconditioner V′ = L⁻¹V (L_ij = exp(s·k̂_i·k̂_j − √d), j ≤ i) is one op; the
attention of q over (k, V′) is the toolkit's causal flash attention (``_flash.py``).
Autograd sums the two key gradients (the softmax's and the preconditioner's).

Every L tile is built the same way, diagonal and off-diagonal blocks alike: the Gram
product of the **raw** keys (exact operands in their own dtype, fp32 accumulation),
scaled by the fp32 inverse RMS norms, S_ij = s·ρ_i·ρ_j·(k_i·k_j); k̂ is never stored.

``_lucid_prep_kernel``, grid ``(n_blocks, B·H_kv)``, fully parallel
    ρ per key and the inverse of each diagonal block L_II (fp32), blocked: the
    16×16 diagonal sub-blocks by a 16-step row loop (all sub-blocks of the tile at
    once), then doubling steps ``X ← X − X·C·X`` with ``tl.dot`` (C the coupling
    blocks of the next level). Forward only: ρ and the inverses are saved.
``_lucid_solve_kernel``, one launch per block row (a kernel boundary orders every
    global write before the reads that depend on it), grid ``(programs, B·H_kv,
    value-column tiles)``. Right-looking blocked substitution: at step I the first
    program solves block row I, ``V′_I = L_II⁻¹ (R_I − L_I,I−1 V′_I−1)``, and program
    p ≥ 1 folds the block solved last into the right-hand side of block row I + p,
    ``R_K ← R_K − L_K,I−1 V′_I−1``. The serial chain is one Gram tile, one panel
    product and one product with the stored inverse per block row. With
    ``TRANSPOSED`` the same kernel runs ``dV = L⁻ᵀ dV′`` from the last block row up
    (the Gram tile is symmetric; the inverse is read transposed).
``_lucid_dk_kernel``, grid ``(n_blocks, head-dim tiles, B·H_kv)``, fully parallel.
    dk̂_I = s·Σ_J dS_IJ k̂_J + s·Σ_J dS_JIᵀ k̂_J with dS = −(dV V′ᵀ) ⊙ L on the allowed
    lower triangle. A program owns the head-dim columns of its tile only (dS needs
    all of D, so each recomputes it): with one tile the RMS-norm backward
    ``dk = ρ(dk̂ − k̂(k̂·dk̂)/d)`` is its epilogue, with several (head dim 128) dk̂ goes
    to an fp32 buffer and ``_lucid_norm_bwd_kernel`` finishes the rows (and the diagonal).
``_lucid_cache_panel_kernel``, decoding: the new keys' rows of L against the cached
    keys, ``Σ_j L_tj v′_j`` in split-K chunks of the cache (ρ of the cached keys
    recomputed from their raw values); the substitution over the new keys subtracts
    the chunk sums on its first touch of each row.

Precision. fp32 inputs: exact ("ieee") products throughout. bf16/fp16 inputs: the
Gram products take the raw keys (exact), so S and every L entry are as accurate as
in fp32; the panel products L·V′ (and dS·k̂, dV·V′ᵀ) take 16-bit operands with fp32
accumulation, like attention's P·V; the diagonal-block inverse is built and applied
in "tf32x3" (three TF32 products: fp32 accuracy on the tensor cores), so the
diagonal solve is fp32 as the method asks. The interpreter computes every product
exactly in its operands, which then equals what the GPU computes up to the
accumulation order and tf32x3's dropped low-order product (about 2⁻²² relative).
Saved for backward: raw k, V′ in fp32 (its rows give the diagonal's coefficients
dV_i·V′_i, a dot product that may cancel) and, for 16-bit k, the operand copy the
products read (the attention saves it as well), ρ, the diagonal inverses and the keep mask. Never materialised: any N×N matrix.

Padding keys (keep mask 0) have a zero row and column in L and a unit diagonal: ρ is
0, they get no preconditioner gradient, and their contents are selected away (never
multiplied by 0) before any product.
"""
from __future__ import annotations

import math
from typing import Iterator, NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
# Row sums call tl.reduce with tl.sum's own combine function: the same code on the GPU,
# but the interpreter runs it through numpy without re-entering a jit function, which
# keeps the row loops fast enough for the CPU test suite.
from triton.language.standard import _sum_combine

from laminae.primitives._errors import ConfigError, DTypeError, ShapeError
from laminae.primitives.lucid_attention import LUCID_ATTENTION_EPS, check_lucid_inputs

from ._common import StaticCase, dot_precision, empty

__all__ = ["lucid_attention", "lucid_precondition", "lucid_precondition_extend", "lucid_attend", "max_head_dim",
           "static_cases", "tour_case"]


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _keep_rows(mask_ptr, mask_base, rows, N, HAS_MASK: tl.constexpr):
    keep = rows < N
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + mask_base + rows, mask=rows < N, other=0) != 0)
    return keep


@triton.jit
def _load_rows(base, rows, keep, cols, col_ok, row_stride):
    """[rows, cols] tile in the tensor's dtype, zero where a row is not kept: padding
    contents (even NaN) never enter a product."""
    m = keep[:, None] & col_ok[None, :]
    return tl.load(base + rows[:, None] * row_stride + cols[None, :], mask=m, other=0.0)


@triton.jit
def _inv_rms(k32, keep, head_dim, eps):
    """ρ = (mean k² + eps)^(−1/2) per row of an fp32 tile (zero-padded columns past
    ``head_dim`` add nothing); 0 where the row is not kept."""
    return tl.where(keep, 1.0 / tl.sqrt(tl.reduce(k32 * k32, 1, _sum_combine) / head_dim + eps), 0.0)


@triton.jit
def _l_tile(k_i, k_j, rho_i, rho_j, allowed, scale, shift, PRECISION: tl.constexpr):
    """exp(s·ρ_i·ρ_j·(k_i·k_j) − √d) where allowed, else 0 (fp32). The raw keys are the
    operands: exact in their own dtype, so S is fp32-accurate for 16-bit keys too."""
    g = tl.dot(k_i, tl.trans(k_j), input_precision=PRECISION)
    s = g * (rho_i * scale)[:, None] * rho_j[None, :] - shift
    return tl.where(allowed, tl.exp(s), 0.0)


@triton.jit
def _triangular_inverse(t, n_rows, BLOCK: tl.constexpr, SUB: tl.constexpr, LEVELS: tl.constexpr,
                        PRECISION: tl.constexpr):
    """Inverse of the lower-triangular [BLOCK, BLOCK] tile ``t`` (fp32), blocked; rows
    from ``n_rows`` on must be the identity.

    1. The SUB×SUB diagonal sub-blocks, all at once: rows scaled by the inverse
       diagonal, then column-oriented forward substitution on the identity (row r of
       each sub-block's inverse is final when reached and is eliminated from the rows
       below it in the same sub-block): SUB − 1 steps, fewer in a short last block.
    2. LEVELS doubling steps: with X the inverse of the diagonal blocks of size h,
       inv([[A, 0], [C, B]]) = [[A⁻¹, 0], [−B⁻¹CA⁻¹, B⁻¹]] for every 2h-block at once,
       X ← X − X·C_h·X, where C_h keeps the coupling blocks C of ``t``."""
    offs = tl.arange(0, BLOCK)
    eye = offs[:, None] == offs[None, :]
    same = (offs[:, None] // SUB) == (offs[None, :] // SUB)
    inv_d = 1.0 / tl.reduce(tl.where(eye, t, 0.0), 1, _sum_combine)
    m = tl.where(same & ~eye, t * inv_d[:, None], 0.0)
    x = tl.where(eye, inv_d[:, None], 0.0)
    lane = offs % SUB
    for r in range(0, tl.minimum(SUB, n_rows) - 1):
        sel = lane == r
        col = tl.reduce(tl.where(sel[None, :], m, 0.0), 1, _sum_combine)  # column r of each unit sub-block
        x_r = tl.reduce(tl.where(sel[:, None], x, 0.0), 0, _sum_combine)  # final row r of each sub-block
        x -= tl.where(same, col[:, None] * x_r[None, :], 0.0)
    for level in tl.static_range(LEVELS):
        half = SUB << level
        coupling = ((offs[:, None] // (2 * half)) == (offs[None, :] // (2 * half))) & \
            ((offs[:, None] // half) != (offs[None, :] // half))
        c = tl.where(coupling, t, 0.0)  # t is lower triangular: only the lower-left h-blocks remain
        x -= tl.dot(tl.dot(x, c, input_precision=PRECISION), x, input_precision=PRECISION)
    return x


@triton.jit(do_not_specialize=["N", "HKV", "head_dim"])
def _lucid_prep_kernel(k_ptr, mask_ptr, rho_ptr, linv_ptr, N, HKV, D, head_dim, eps, scale, shift,
                       HAS_MASK: tl.constexpr, UNIT_DIAG: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                       SUB: tl.constexpr, LEVELS: tl.constexpr, PRECISION: tl.constexpr,
                       INV_PRECISION: tl.constexpr):
    """Per key block I, in parallel: ρ_I and L_II⁻¹ (fp32)."""
    pid_n = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    base = (b * N * HKV + kvh) * D
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    rows = pid_n * BLOCK + offs
    keep = _keep_rows(mask_ptr, b * N, rows, N, HAS_MASK)
    k = _load_rows(k_ptr + base, rows, keep, offs_d, offs_d < D, HKV * D)
    rho = _inv_rms(k.to(tl.float32), keep, head_dim, eps)
    tl.store(rho_ptr + pid.to(tl.int64) * N + rows, rho, mask=rows < N)
    eye = offs[:, None] == offs[None, :]
    # every entry, the diagonal too, from the one Gram product (as every other tile of L);
    # padding keys and rows past N: unit diagonal
    l_ii = _l_tile(k, k, rho, rho, (offs[None, :] <= offs[:, None]) & keep[:, None] & keep[None, :], scale, shift,
                   PRECISION)
    if UNIT_DIAG:
        l_ii = tl.where(eye, 1.0, l_ii)
    else:
        l_ii = tl.where(eye & ~keep[:, None], 1.0, l_ii)
    x = _triangular_inverse(l_ii, N - pid_n * BLOCK, BLOCK, SUB, LEVELS, INV_PRECISION)
    linv = linv_ptr + (pid.to(tl.int64) * tl.num_programs(0) + pid_n) * BLOCK * BLOCK
    tl.store(linv + offs[:, None] * BLOCK + offs[None, :], x)


@triton.jit(do_not_specialize=["N", "HKV", "n_parts", "step"])
def _lucid_solve_kernel(k_ptr, rhs_ptr, mask_ptr, rho_ptr, linv_ptr, part_ptr, r_ptr, out_ptr, op_ptr,
                        N, HKV, D, n_parts, step, scale, shift,
                        HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                        PRECISION: tl.constexpr, INV_PRECISION: tl.constexpr, TRANSPOSED: tl.constexpr,
                        STORE_OUT: tl.constexpr, STORE_OP: tl.constexpr):
    """One step of the right-looking block substitution, for one (batch·kv head,
    value-column tile) and one target block row.

    Forward (``TRANSPOSED=False``, V′ = L⁻¹·rhs), step I = 0, 1, ...: program 0 solves
    block row I, program p ≥ 1 updates block row K = I + p; each folds in the block
    I − 1 solved by the previous launch:
        R_K ← R_K − L_K,I−1 V′_I−1,    V′_I = L_II⁻¹ (R_I − L_I,I−1 V′_I−1)
    Backward (``TRANSPOSED=True``, dV = L⁻ᵀ·rhs): the same from the last block row
    down, with L_I+1,Kᵀ (the Gram tile is symmetric; the inverse is read transposed).
    A block row's first touch (step ≤ 1) starts from ``rhs`` minus the ``n_parts``
    cache sums in ``part_ptr``; later ones from the fp32 accumulator ``r_ptr``. The
    solution goes to ``out_ptr`` (fp32) and/or ``op_ptr`` (the operand dtype), from
    which later steps read it."""
    p = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    row_stride = HKV * D
    base = (b * N * HKV + kvh) * D
    n_blocks = tl.cdiv(N, BLOCK)
    if TRANSPOSED:
        blk = n_blocks - 1 - step
        prev = blk + 1
        target = blk - p
    else:
        blk = step
        prev = blk - 1
        target = blk + p
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    v_ok = offs_v < D
    rows = target * BLOCK + offs
    keep_t = _keep_rows(mask_ptr, b * N, rows, N, HAS_MASK)
    io = rows[:, None] * row_stride + offs_v[None, :]
    io_mask = (rows < N)[:, None] & v_ok[None, :]
    if step <= 1:  # first touch of this block row: padding rows pass their rhs through
        acc = tl.load(rhs_ptr + base + io, mask=io_mask, other=0.0).to(tl.float32)
        for part in range(0, n_parts):
            acc -= tl.load(part_ptr + part * (tl.num_programs(1) // HKV).to(tl.int64) * N * row_stride + base + io,
                           mask=io_mask, other=0.0)
    else:
        acc = tl.load(r_ptr + base + io, mask=io_mask, other=0.0)
    if step >= 1:
        if STORE_OP:
            x_ptr = op_ptr
        else:
            x_ptr = out_ptr
        operand = k_ptr.dtype.element_ty
        cols = prev * BLOCK + offs
        keep_p = _keep_rows(mask_ptr, b * N, cols, N, HAS_MASK)
        k_t = _load_rows(k_ptr + base, rows, keep_t, offs_d, offs_d < D, row_stride)
        k_p = _load_rows(k_ptr + base, cols, keep_p, offs_d, offs_d < D, row_stride)
        rho_t = tl.load(rho_ptr + pid.to(tl.int64) * N + rows, mask=rows < N, other=0.0)
        rho_p = tl.load(rho_ptr + pid.to(tl.int64) * N + cols, mask=cols < N, other=0.0)
        l_tp = _l_tile(k_t, k_p, rho_t, rho_p, keep_t[:, None] & keep_p[None, :], scale, shift, PRECISION)
        x_p = _load_rows(x_ptr + base, cols, keep_p, offs_v, v_ok, row_stride).to(operand)
        acc = tl.dot((-l_tp).to(operand), x_p, acc, input_precision=PRECISION)
    if p == 0:
        # the diagonal block through its inverse (the identity on padding rows, whose
        # right-hand side is kept out of the product and passed through)
        blk_inv = linv_ptr + (pid.to(tl.int64) * n_blocks + blk) * BLOCK * BLOCK
        if TRANSPOSED:
            inv = tl.load(blk_inv + offs[None, :] * BLOCK + offs[:, None])
        else:
            inv = tl.load(blk_inv + offs[:, None] * BLOCK + offs[None, :])
        rhs = tl.where(keep_t[:, None], acc, 0.0)
        x = tl.where(keep_t[:, None], tl.dot(inv, rhs, input_precision=INV_PRECISION), acc)
        if STORE_OUT:
            tl.store(out_ptr + base + io, x, mask=io_mask)
        if STORE_OP:
            tl.store(op_ptr + base + io, x.to(op_ptr.dtype.element_ty), mask=io_mask)
    else:
        tl.store(r_ptr + base + io, acc, mask=io_mask)


@triton.jit
def _load_block(base, row0, col0, keep, N, D, row_stride, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [row0, row0 + BLOCK), columns [col0, col0 + BLOCK_D) of a [N, D] row-major
    view through a block pointer, zero where a row is not kept (a select: padding NaN
    never enters a product)."""
    # a block pointer rather than a [BLOCK, BLOCK_D] tile of addresses: at D = 128
    # those would not fit the register file next to the dk̂ kernel's accumulator
    ptr = tl.make_block_ptr(base, (N, D), (row_stride, 1), (row0, col0), (BLOCK, BLOCK_D), (1, 0))
    x = tl.load(ptr, boundary_check=(0, 1), padding_option="zero")
    return tl.where(keep[:, None], x, tl.zeros_like(x))


@triton.jit
def _dk_pass(acc, k_i, rho_i, a_i, keep_i, lo, hi, k_base, b_base, rho_base, mask_ptr, mask_base, d0, N, row_stride,
             D, scale, shift, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_DK: tl.constexpr, PRECISION: tl.constexpr):
    """acc + Σ_J (−(a_I b_Jᵀ) ⊙ L) k̂_J[:, d0:d0 + BLOCK_DK] over key tiles J of BLOCK_N in
    [lo, hi), all off the diagonal block, so every pair of kept keys counts: below it
    a = dV, b = V′ (dS_IJ); above it a = V′, b = dV (dS_JIᵀ, the Gram tile read as L_JIᵀ)."""
    operand = k_i.dtype
    for start_j in range(lo, hi, BLOCK_N):
        # keep mask and block loads written out here rather than through the helpers:
        # the interpreter pays for every helper call, and this is the hot loop
        cols = start_j + tl.arange(0, BLOCK_N)
        keep_j = cols < N
        if HAS_MASK:
            keep_j = keep_j & (tl.load(mask_ptr + mask_base + cols, mask=cols < N, other=0) != 0)
        k_j = tl.load(tl.make_block_ptr(k_base, (N, D), (row_stride, 1), (start_j, 0), (BLOCK_N, BLOCK_D), (1, 0)),
                      boundary_check=(0, 1), padding_option="zero")
        k_j = tl.where(keep_j[:, None], k_j, tl.zeros_like(k_j))
        rho_j = tl.load(rho_base + cols, mask=cols < N, other=0.0)
        l_t = _l_tile(k_i, k_j, rho_i, rho_j, keep_i[:, None] & keep_j[None, :], scale, shift, PRECISION)
        b_j = tl.load(tl.make_block_ptr(b_base, (N, D), (row_stride, 1), (start_j, 0), (BLOCK_N, BLOCK_D), (1, 0)),
                      boundary_check=(0, 1), padding_option="zero")
        b_j = tl.where(keep_j[:, None], b_j, tl.zeros_like(b_j)).to(operand)
        ds = -tl.dot(a_i, tl.trans(b_j), input_precision=PRECISION) * l_t
        if BLOCK_DK < BLOCK_D:
            kd_j = _load_block(k_base, start_j, d0, keep_j, N, D, row_stride, BLOCK_N, BLOCK_DK)
        else:
            kd_j = k_j
        # k̂_J in the operand dtype (ρ on the keys, not on dS: fp16 keeps its range)
        kh_j = (kd_j.to(tl.float32) * rho_j[:, None]).to(operand)
        acc = tl.dot(ds.to(operand), kh_j, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["N", "HKV", "head_dim"])
def _lucid_dk_kernel(k_ptr, mask_ptr, rho_ptr, vp_ptr, dv_ptr, vp32_ptr, dv32_ptr, out_ptr, N, HKV, D,
                     head_dim, eps, scale, shift,
                     HAS_MASK: tl.constexpr, UNIT_DIAG: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_DK: tl.constexpr, PRECISION: tl.constexpr):
    """Key block I (BLOCK rows), head-dim columns [d0, d0 + BLOCK_DK), over key tiles J
    of BLOCK_N (BLOCK a multiple). With BLOCK_DK = BLOCK_D: dk in the dtype of k;
    otherwise the off-diagonal dk̂ (fp32) for ``_lucid_norm_bwd_kernel``, which also
    takes the diagonal. ``vp_ptr``/``dv_ptr`` are the products' operands (the dtype of
    k), ``vp32_ptr``/``dv32_ptr`` the same in fp32 for the diagonal."""
    pid_n = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_DK
    pid = tl.program_id(2)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    row_stride = HKV * D
    base = (b * N * HKV + kvh) * D
    rho_base = rho_ptr + pid.to(tl.int64) * N
    operand = k_ptr.dtype.element_ty
    start = pid_n * BLOCK
    rows = start + tl.arange(0, BLOCK)
    keep_i = _keep_rows(mask_ptr, b * N, rows, N, HAS_MASK)
    k_i = _load_block(k_ptr + base, start, 0, keep_i, N, D, row_stride, BLOCK, BLOCK_D)
    rho_i = tl.load(rho_base + rows, mask=rows < N, other=0.0)
    # dk̂_I = s·Σ_J dS_IJ k̂_J + s·Σ_J dS_JIᵀ k̂_J with dS = −(dV V′ᵀ) ⊙ L, J ≤ I and J ≥ I.
    # The diagonal block once: the pairs j < i of dS_II and j > i of dS_IIᵀ. The diagonal
    # itself is in both sums (S_ii is quadratic in k̂_i): c_i·k̂_i with c_i = 2·s·dS_ii,
    # kept out of the products. It lies along k̂_i, which the RMS-norm backward projects
    # out up to O(eps): summed into dk̂ its rounding (16-bit, or fp32 against an O(eps)
    # result) would not cancel, so it goes through the projection in closed form
    # (``_norm_backward``). Its coefficient dV_i·V′_i is a dot product that may cancel
    # (a key alone in its sequence has only this term): from the fp32 rows, since their
    # 16-bit roundings would leave it up to 2⁻⁹·Σ|dV·V′| off. Split over the head dim,
    # the norm kernel takes it: two more fp32 [BLOCK, BLOCK_D] tiles here would spill.
    if UNIT_DIAG or BLOCK_DK < BLOCK_D:  # a constant diagonal has no gradient
        diag = tl.zeros((BLOCK,), dtype=tl.float32)
    else:
        diag = _diagonal_coefficients(
            k_i.to(tl.float32) * rho_i[:, None],
            _load_block(dv32_ptr + base, start, 0, keep_i, N, D, row_stride, BLOCK, BLOCK_D),
            _load_block(vp32_ptr + base, start, 0, keep_i, N, D, row_stride, BLOCK, BLOCK_D), keep_i, scale, shift)
    dv_i = _load_block(dv_ptr + base, start, 0, keep_i, N, D, row_stride, BLOCK, BLOCK_D).to(operand)
    vp_i = _load_block(vp_ptr + base, start, 0, keep_i, N, D, row_stride, BLOCK, BLOCK_D).to(operand)
    l_ii = _l_tile(k_i, k_i, rho_i, rho_i, keep_i[:, None] & keep_i[None, :], scale, shift, PRECISION)
    m = tl.dot(dv_i, tl.trans(vp_i), input_precision=PRECISION)  # dV_I V′_Iᵀ
    ds = tl.where(rows[None, :] < rows[:, None], m, tl.where(rows[None, :] > rows[:, None], tl.trans(m), 0.0))
    if BLOCK_DK < BLOCK_D:
        kd_i = _load_block(k_ptr + base, start, d0, keep_i, N, D, row_stride, BLOCK, BLOCK_DK)
    else:
        kd_i = k_i
    acc = tl.dot((-ds * l_ii).to(operand), (kd_i.to(tl.float32) * rho_i[:, None]).to(operand),
                 input_precision=PRECISION)
    acc = _dk_pass(acc, k_i, rho_i, dv_i, keep_i, 0, start, k_ptr + base, vp_ptr + base, rho_base, mask_ptr, b * N,
                   d0, N, row_stride, D, scale, shift, HAS_MASK, BLOCK_N, BLOCK_D, BLOCK_DK, PRECISION)
    acc = _dk_pass(acc, k_i, rho_i, vp_i, keep_i, start + BLOCK, N, k_ptr + base, dv_ptr + base, rho_base, mask_ptr,
                   b * N, d0, N, row_stride, D, scale, shift, HAS_MASK, BLOCK_N, BLOCK_D, BLOCK_DK, PRECISION)
    dkh = acc * scale
    if BLOCK_DK < BLOCK_D:
        offs_c = d0 + tl.arange(0, BLOCK_DK)
        tl.store(out_ptr + base + rows[:, None] * row_stride + offs_c[None, :], dkh,
                 mask=(rows < N)[:, None] & (offs_c < D)[None, :])
    else:
        offs_d = tl.arange(0, BLOCK_D)
        dk = _norm_backward(k_i.to(tl.float32) * rho_i[:, None], rho_i, dkh, diag, eps, head_dim)
        tl.store(out_ptr + base + rows[:, None] * row_stride + offs_d[None, :], dk.to(out_ptr.dtype.element_ty),
                 mask=(rows < N)[:, None] & (offs_d < D)[None, :])


@triton.jit
def _diagonal_coefficients(kh, dv32, vp32, keep, scale, shift):
    """c_i = 2·s·dS_ii = −2·s·L_ii·(dV_i·V′_i) from fp32 rows of k̂, dV and V′."""
    l_diag = tl.where(keep, tl.exp(tl.reduce(kh * kh, 1, _sum_combine) * scale - shift), 0.0)
    return -2.0 * scale * l_diag * tl.reduce(dv32 * vp32, 1, _sum_combine)


@triton.jit
def _norm_backward(kh, rho, dkh, diag, eps, head_dim):
    """RMS-norm backward dk = ρ·(dk̂ − k̂·(k̂·dk̂)/d) of the off-diagonal dk̂ (fp32 tiles, k̂ =
    ρ·k), plus the diagonal's c·k̂ through the same map in closed form: since
    1 − ‖k̂‖²/d = eps·ρ², it is c·eps·ρ³·k̂ (no cancellation)."""
    dk = rho[:, None] * (dkh - kh * (tl.reduce(kh * dkh, 1, _sum_combine) / head_dim)[:, None])
    return dk + (diag * eps * rho * rho * rho)[:, None] * kh


@triton.jit(do_not_specialize=["N", "HKV", "head_dim"])
def _lucid_norm_bwd_kernel(k_ptr, mask_ptr, rho_ptr, dkh_ptr, vp32_ptr, dv32_ptr, dk_ptr, N, HKV, D, head_dim, eps,
                           scale, shift, HAS_MASK: tl.constexpr, UNIT_DIAG: tl.constexpr, BLOCK: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """The RMS-norm backward of ``_norm_backward`` for a tile of rows, from the dk̂ of a
    head-dim-split dk̂ kernel, with the diagonal's coefficients from the fp32 rows."""
    pid_n = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    row_stride = HKV * D
    base = (b * N * HKV + kvh) * D
    rows = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    keep = _keep_rows(mask_ptr, b * N, rows, N, HAS_MASK)
    rho = tl.load(rho_ptr + pid.to(tl.int64) * N + rows, mask=rows < N, other=0.0)
    kh = _load_rows(k_ptr + base, rows, keep, offs_d, d_ok, row_stride).to(tl.float32) * rho[:, None]
    dkh = _load_rows(dkh_ptr + base, rows, keep, offs_d, d_ok, row_stride)
    if UNIT_DIAG:
        diag = tl.zeros((BLOCK,), dtype=tl.float32)
    else:
        diag = _diagonal_coefficients(kh, _load_rows(dv32_ptr + base, rows, keep, offs_d, d_ok, row_stride),
                                      _load_rows(vp32_ptr + base, rows, keep, offs_d, d_ok, row_stride), keep,
                                      scale, shift)
    dk = _norm_backward(kh, rho, dkh, diag, eps, head_dim)
    tl.store(dk_ptr + base + rows[:, None] * row_stride + offs_d[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=(rows < N)[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["T", "C", "HKV", "head_dim", "maskc_bstride"])
def _lucid_cache_panel_kernel(k_ptr, kc_ptr, mask_ptr, maskc_ptr, rho_ptr, vpc_ptr, part_ptr,
                              T, C, HKV, D, head_dim, kc_bstride, maskc_bstride, vpc_bstride, chunk, eps, scale,
                              shift,
                              HAS_MASK: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
                              BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Σ_{j in chunk} L_tj v′_j for ROWS new keys t against one chunk of the C cached
    keys (split-K: chunk sums go to ``part_ptr[chunk index]``, the substitution
    subtracts them). ρ of a cached key comes from its raw value, as in prefill; V′ of
    the cache is fp32 and enters the product in the operand dtype, as in prefill."""
    pid_r = tl.program_id(0)
    q = tl.program_id(1)
    pid = tl.program_id(2)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    row_stride = HKV * D
    base = (b * T * HKV + kvh) * D
    operand = k_ptr.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    rows = pid_r * ROWS + tl.arange(0, ROWS)
    keep_t = _keep_rows(mask_ptr, b * T, rows, T, HAS_MASK)
    k_t = _load_rows(k_ptr + base, rows, keep_t, offs_d, d_ok, row_stride)
    rho_t = tl.load(rho_ptr + pid.to(tl.int64) * T + rows, mask=rows < T, other=0.0)
    kc_base = kc_ptr + b * kc_bstride + kvh * D
    vpc_base = vpc_ptr + b * vpc_bstride + kvh * D
    acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    lo = q * chunk
    for start in range(lo, tl.minimum(lo + chunk, C), BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        keep_c = _keep_rows(maskc_ptr, b * maskc_bstride, cols, C, HAS_MASK)
        k_c = _load_rows(kc_base, cols, keep_c, offs_d, d_ok, row_stride)
        rho_c = _inv_rms(k_c.to(tl.float32), keep_c, head_dim, eps)
        l_tc = _l_tile(k_t, k_c, rho_t, rho_c, keep_t[:, None] & keep_c[None, :], scale, shift, PRECISION)
        vp_c = _load_rows(vpc_base, cols, keep_c, offs_d, d_ok, row_stride).to(operand)
        acc = tl.dot(l_tc.to(operand), vp_c, acc, input_precision=PRECISION)
    tl.store(part_ptr + q.to(tl.int64) * tl.num_programs(2) * T * D + base + rows[:, None] * row_stride
             + offs_d[None, :], acc, mask=(rows < T)[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------
# Tiles
# ----------------------------------------------------------------------------


class Tiles(NamedTuple):
    """Launch shape for one head dim and dtype family."""

    block: int  # keys per block row: diagonal blocks, substitution steps, dk̂ rows, cached-key tiles
    block_dv: int  # value columns per substitution program
    warps: int  # prep, substitution and decoding kernels
    dk_warps: int  # the dk̂ kernel
    dk_block_n: int  # keys per J tile of the dk̂ kernel (divides block)
    dk_cols: int  # head-dim columns per dk̂ program (the padded head dim: unsplit, norm backward fused)
    panel_warps: int = 4  # the decoding cache panel


# Per padded head dim, for fp32 (exact "ieee" products on CUDA cores) and for bf16/fp16
# (16-bit operands on the tensor cores, fp32 accumulation), sized for sm_90 without
# spills at NUM_STAGES (``python -m laminae.triton_ops._static lucid_attention``).
# 64-key blocks give wgmma its M = 64 tiles; at head dim 128 the dk̂ kernel splits the
# head dim over two programs so that its 64-row tile fits the register file. Head dims
# above the largest key have no spill-free tile and are rejected.
NUM_STAGES = 2
SUB = 16  # rows of the diagonal sub-blocks the row loop inverts
DECODE_ROWS = 16  # new-key rows per cache-panel program when a step has at most this many keys
_TILES: dict[str, dict[int, Tiles]] = {
    "fp32": {16: Tiles(32, 16, 4, 4, 32, 16, 2), 32: Tiles(32, 32, 4, 8, 32, 32), 64: Tiles(16, 32, 4, 8, 16, 64)},
    "low": {16: Tiles(64, 16, 4, 4, 64, 16, 2), 32: Tiles(64, 32, 4, 4, 64, 32), 64: Tiles(64, 64, 4, 8, 32, 64),
            128: Tiles(64, 64, 4, 8, 32, 64, 8)},
}


def _family(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "low"


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def max_head_dim(dtype: torch.dtype) -> int:
    return max(_TILES[_family(dtype)])


def tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    """Launch shape for ``head_dim`` and ``dtype`` (tests monkeypatch this to force
    small blocks)."""
    return _TILES[_family(dtype)][block_d(head_dim)]


def inverse_precision(dtype: torch.dtype) -> str:
    """Products that build and apply the diagonal-block inverses: fp32-accurate in
    every family ("ieee" for fp32 inputs; three TF32 products for bf16/fp16, on the
    tensor cores)."""
    return "ieee" if dtype == torch.float32 else "tf32x3"


def _levels(block: int) -> int:
    return max(0, int(math.log2(block // min(SUB, block))))


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def _mask_arg(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    if key_mask is None:
        return None
    mask = key_mask.to(torch.int8).contiguous()
    return mask.clone() if mask.data_ptr() % 16 else mask


def storage_dim(head_dim: int) -> int:
    """The head dim the kernels run at: ``head_dim`` rounded up to a multiple of 16."""
    return -(-head_dim // 16) * 16


def _as_launched(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` ``[B, N, H, D]`` contiguous, 16-byte aligned and zero-padded to ``width``
    columns (differentiable). With every tensor aligned and a 16-divisible head dim,
    each launch takes the one specialisation the static cases compile; zero columns
    add nothing to a product or a norm (the mean divides by the true head dim)."""
    t = t.contiguous()
    if t.shape[-1] != width:
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]))
    return t.clone() if t.data_ptr() % 16 else t


def _scalars(head_dim: int) -> tuple[float, float]:
    return 1.0 / math.sqrt(head_dim), math.sqrt(head_dim)


def _nothing(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def _prepare(k: torch.Tensor, key_mask: torch.Tensor | None, head_dim: int, eps: float, unit_diagonal: bool,
             t: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """(ρ ``[B·H_kv, N]``, L_II⁻¹ ``[B·H_kv, n_blocks·block, block]``), fp32: every
    diagonal block inverted at once, off the sequential path."""
    B, N, HKV, D = k.shape
    n_blocks = triton.cdiv(N, t.block)
    scale, shift = _scalars(head_dim)
    rho = empty((B * HKV, N), dtype=torch.float32, device=k.device)
    linv = empty((B * HKV, n_blocks * t.block, t.block), dtype=torch.float32, device=k.device)
    wrap_triton(_lucid_prep_kernel)[(n_blocks, B * HKV)](
        k, key_mask, rho, linv, N, HKV, D, head_dim, eps, scale, shift,
        HAS_MASK=key_mask is not None, UNIT_DIAG=unit_diagonal, BLOCK=t.block, BLOCK_D=block_d(D),
        SUB=min(SUB, t.block), LEVELS=_levels(t.block), PRECISION=dot_precision(k.dtype),
        INV_PRECISION=inverse_precision(k.dtype), num_warps=t.warps, num_stages=NUM_STAGES,
    )
    return rho, linv


def _substitute(k: torch.Tensor, rhs: torch.Tensor, key_mask: torch.Tensor | None, rho: torch.Tensor,
                linv: torch.Tensor, head_dim: int, t: Tiles, *, transposed: bool, store_out: bool, store_op: bool,
                parts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """L⁻¹·rhs (or L⁻ᵀ·rhs): (fp32 solution, solution in the dtype of k); each is an
    empty tensor unless asked for. One launch per block row; ``parts`` ``[n, B, N,
    H_kv, D]`` are subtracted from rhs (the cached keys' contribution when decoding)."""
    B, N, HKV, D = k.shape
    scale, shift = _scalars(head_dim)
    bd = block_d(D)
    dv = min(t.block_dv, bd)
    n_blocks = triton.cdiv(N, t.block)
    full = (B, N, HKV, D)
    out = empty(full, dtype=torch.float32, device=k.device) if store_out else _nothing(torch.float32, k.device)
    op = empty(full, dtype=k.dtype, device=k.device) if store_op else _nothing(k.dtype, k.device)
    # the accumulator is first written at step 1 for block rows 2 ..
    acc = empty(full, dtype=torch.float32, device=k.device) if n_blocks > 2 else _nothing(torch.float32, k.device)
    n_parts = 0 if parts is None else parts.shape[0]
    parts = _nothing(torch.float32, k.device) if parts is None else parts
    for step in range(n_blocks):
        wrap_triton(_lucid_solve_kernel)[(1 if step == 0 else n_blocks - step, B * HKV, triton.cdiv(D, dv))](
            k, rhs, key_mask, rho, linv, parts, acc, out, op, N, HKV, D, n_parts, step, scale, shift,
            HAS_MASK=key_mask is not None, BLOCK=t.block, BLOCK_D=bd, BLOCK_DV=dv, PRECISION=dot_precision(k.dtype),
            INV_PRECISION=inverse_precision(k.dtype), TRANSPOSED=transposed, STORE_OUT=store_out, STORE_OP=store_op,
            num_warps=t.warps, num_stages=NUM_STAGES,
        )
    return out, op


def _key_gradient(k: torch.Tensor, key_mask: torch.Tensor | None, rho: torch.Tensor, vp: torch.Tensor,
                  dv: torch.Tensor, vp32: torch.Tensor, dv32: torch.Tensor, head_dim: int, eps: float,
                  unit_diagonal: bool, t: Tiles) -> torch.Tensor:
    """The preconditioner's dk (dtype of k) from V′ and dV as the products' operands (the
    dtype of k) and in fp32 (the diagonal's coefficients; the same tensors for fp32 k)."""
    B, N, HKV, D = k.shape
    scale, shift = _scalars(head_dim)
    bd = block_d(D)
    cols = min(t.dk_cols, bd)
    split = cols < bd
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    dkh = empty(k.shape, dtype=torch.float32, device=k.device) if split else dk
    wrap_triton(_lucid_dk_kernel)[(triton.cdiv(N, t.block), triton.cdiv(D, cols), B * HKV)](
        k, key_mask, rho, vp, dv, vp32, dv32, dkh, N, HKV, D, head_dim, eps, scale, shift,
        HAS_MASK=key_mask is not None, UNIT_DIAG=unit_diagonal, BLOCK=t.block, BLOCK_N=t.dk_block_n,
        BLOCK_D=bd, BLOCK_DK=cols, PRECISION=dot_precision(k.dtype), num_warps=t.dk_warps, num_stages=NUM_STAGES,
    )
    if split:
        wrap_triton(_lucid_norm_bwd_kernel)[(triton.cdiv(N, t.block), B * HKV)](
            k, key_mask, rho, dkh, vp32, dv32, dk, N, HKV, D, head_dim, eps, scale, shift,
            HAS_MASK=key_mask is not None, UNIT_DIAG=unit_diagonal, BLOCK=t.block, BLOCK_D=bd, num_warps=t.dk_warps,
        )
    return dk


def _cache_chunks(cache_len: int, programs: int, block: int, device: torch.device) -> tuple[int, int]:
    """(chunks, keys per chunk) splitting the cache so that about two programs per SM
    run (four programs in all on CPU, so tests cross chunk boundaries)."""
    tiles_c = triton.cdiv(cache_len, block)
    want = 2 * _sm_count(device) if device.type == "cuda" else 4
    n = max(1, min(tiles_c, triton.cdiv(want, max(programs, 1))))
    chunk = triton.cdiv(tiles_c, n) * block
    return triton.cdiv(cache_len, chunk), chunk


_SMS: dict = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _cache_view(t: torch.Tensor, width: int) -> torch.Tensor:
    """A cache tensor ``[B, C, H, D]`` as the kernels read it: rows of H·D columns at
    any batch stride (a view of the cache's storage), aligned, the head dim at
    ``width`` (an odd head dim pads: a copy of the cache per step)."""
    B, C, H, D = t.shape
    if D == width and t.stride(3) == 1 and t.stride(2) == D and (t.stride(1) == H * D or C <= 1) \
            and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0:
        return t
    return _as_launched(t, width)


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


@triton_op("laminae::lucid_precondition", mutates_args=())
def _lucid_precondition_op(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, head_dim: int,
                           eps: float, unit_diagonal: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(V′ fp32, V′ in the dtype of k (bf16/fp16 only, else empty), ρ, L_II⁻¹) for k, v
    as launched (``_as_launched``: a 16-divisible width holding ``head_dim`` columns)
    and key_mask int8 or None."""
    t = tiles(head_dim, k.dtype)
    low = k.dtype != torch.float32
    rho, linv = _prepare(k, key_mask, head_dim, eps, unit_diagonal, t)
    vp, vp_op = _substitute(k, v, key_mask, rho, linv, head_dim, t, transposed=False, store_out=True, store_op=low)
    return vp, vp_op, rho, linv


@triton_op("laminae::lucid_precondition_bwd", mutates_args=())
def _lucid_precondition_bwd_op(dvp: torch.Tensor, k: torch.Tensor, vp: torch.Tensor, vp_op: torch.Tensor,
                               rho: torch.Tensor, linv: torch.Tensor, key_mask: torch.Tensor | None, head_dim: int,
                               eps: float, unit_diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv) of the preconditioner, both in the dtype of k (dv = L⁻ᵀ dV′; V′ as saved:
    fp32, and for 16-bit k the operand copy)."""
    t = tiles(head_dim, k.dtype)
    low = k.dtype != torch.float32
    dv32, dv_op = _substitute(k, dvp, key_mask, rho, linv, head_dim, t, transposed=True, store_out=True,
                              store_op=low)
    if not low:
        return _key_gradient(k, key_mask, rho, vp, dv32, vp, dv32, head_dim, eps, unit_diagonal, t), dv32
    return _key_gradient(k, key_mask, rho, vp_op, dv_op, vp, dv32, head_dim, eps, unit_diagonal, t), dv_op


def _setup_context(ctx, inputs, output):
    k, v, key_mask, head_dim, eps, unit_diagonal = inputs
    vp, vp_op, rho, linv = output
    ctx.mark_non_differentiable(rho, linv)
    ctx.set_materialize_grads(False)
    # V′ in fp32 for the dk kernel's diagonal coefficients dV_i·V′_i, and the 16-bit copy
    # its products read: the attention over (k, V′) saves that copy too, so keeping it
    # costs no memory there and saves the backward a cast
    ctx.save_for_backward(k, vp, vp_op, rho, linv, key_mask)
    ctx.head_dim, ctx.eps, ctx.unit_diagonal = head_dim, eps, unit_diagonal
    ctx.v_dtype = v.dtype


def _backward(ctx, dvp, dvp_op, _drho, _dlinv):
    k, vp, vp_op, rho, linv, key_mask = ctx.saved_tensors
    grads = [g for g in (dvp, dvp_op) if g is not None]
    if not grads:
        return None, None, None, None, None, None
    rhs = (grads[0].float() if len(grads) == 1 else grads[0].float() + grads[1].float()).contiguous()
    dk, dv = _lucid_precondition_bwd_op(rhs, k, vp, vp_op, rho, linv, key_mask, ctx.head_dim, ctx.eps,
                                        ctx.unit_diagonal)
    return dk, dv.to(ctx.v_dtype), None, None, None, None


_lucid_precondition_op.register_autograd(_backward, setup_context=_setup_context)


@triton_op("laminae::lucid_precondition_extend", mutates_args=())
def _lucid_extend_op(k_cache: torch.Tensor, vp_cache: torch.Tensor, cache_mask: torch.Tensor | None,
                     k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, head_dim: int, eps: float,
                     unit_diagonal: bool) -> torch.Tensor:
    """V′ ``[B, T, H_kv, D]`` fp32 of T new keys after C cached ones (k, v as launched;
    the cache tensors ``_cache_view``s; both masks or neither)."""
    B, T, HKV, D = k.shape
    C = k_cache.shape[1]
    t = tiles(head_dim, k.dtype)
    rho, linv = _prepare(k, key_mask, head_dim, eps, unit_diagonal, t)
    parts = None
    if C:
        rows = DECODE_ROWS if T <= DECODE_ROWS else t.block
        n_rows = triton.cdiv(T, rows)
        n_parts, chunk = _cache_chunks(C, n_rows * B * HKV, t.block, k.device)
        parts = empty((n_parts, B, T, HKV, D), dtype=torch.float32, device=k.device)
        scale, shift = _scalars(head_dim)
        has_mask = key_mask is not None
        wrap_triton(_lucid_cache_panel_kernel)[(n_rows, n_parts, B * HKV)](
            k, k_cache, key_mask, cache_mask, rho, vp_cache, parts, T, C, HKV, D, head_dim, k_cache.stride(0),
            cache_mask.stride(0) if has_mask else 0, vp_cache.stride(0), chunk, eps, scale, shift,
            HAS_MASK=has_mask, ROWS=rows, BLOCK_C=t.block, BLOCK_D=block_d(D), PRECISION=dot_precision(k.dtype),
            num_warps=t.panel_warps, num_stages=NUM_STAGES,
        )
    vp, _ = _substitute(k, v, key_mask, rho, linv, head_dim, t, transposed=False, store_out=True, store_op=False,
                        parts=parts)
    return vp


def _extend_backward(ctx, grad):
    raise ConfigError("LUCID decoding steps on the Triton backend are inference-only (the cache holds detached "
                      "tensors); differentiate with backend='reference' or the prefill op lucid_precondition")


_lucid_extend_op.register_autograd(_extend_backward, setup_context=lambda ctx, inputs, output: None)


def _check_triton(k: torch.Tensor) -> None:
    if k.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"the Triton LUCID kernels support fp32/bf16/fp16 inputs, got {k.dtype}")
    limit = max_head_dim(k.dtype)
    if k.shape[-1] > limit:
        raise ShapeError(f"the Triton LUCID kernels support head_dim <= {limit} for {k.dtype} "
                         f"(64 for fp32, 128 for bf16/fp16), got {k.shape[-1]}; use backend='reference'")


def _preconditioned(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, eps: float,
                    unit_diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(V′ fp32, V′ in the dtype of k), differentiable; N ≥ 1."""
    head_dim = k.shape[-1]
    width = storage_dim(head_dim)
    vp, vp_op, _, _ = _lucid_precondition_op(_as_launched(k, width), _as_launched(v, width), _mask_arg(key_mask),
                                              head_dim, float(eps), bool(unit_diagonal))
    if width != head_dim:
        vp, vp_op = vp[..., :head_dim], (vp_op[..., :head_dim] if vp_op.numel() else vp_op)
    return vp, (vp if k.dtype == torch.float32 else vp_op)


def lucid_precondition(k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       eps: float = LUCID_ATTENTION_EPS, *, unit_diagonal: bool = False) -> torch.Tensor:
    """Triton V′ = L⁻¹V with the signature of
    :func:`laminae.primitives.lucid_attention.lucid_precondition_reference`:
    ``k``, ``v`` ``[B, N, H_kv, D]`` → V′ ``[B, N, H_kv, D]`` fp32, differentiable in k and v."""
    _check_triton(k)
    if k.shape[1] == 0:
        return torch.zeros(k.shape, dtype=torch.float32, device=k.device) + 0.0 * (k.sum() + v.sum())
    return _preconditioned(k, v, attention_mask, eps, unit_diagonal)[0]


def lucid_precondition_extend(k_cache: torch.Tensor, v_prime_cache: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, cache_mask: torch.Tensor | None = None,
                              attention_mask: torch.Tensor | None = None, eps: float = LUCID_ATTENTION_EPS, *,
                              unit_diagonal: bool = False) -> torch.Tensor:
    """V′ ``[B, T, H_kv, D]`` (fp32) of T new keys ``k`` and values ``v`` after C cached
    keys ``k_cache`` (raw, the dtype of k) whose preconditioned values are
    ``v_prime_cache`` (fp32), both ``[B, C, H_kv, D]``: the new rows of L V′ = V, the
    decoding step of :class:`~laminae.primitives.lucid_attention.LucidAttention` on the
    Triton backend. ``cache_mask`` ``(B, C)`` and ``attention_mask`` ``(B, T)`` keep masks.
    Inference only: the backward raises."""
    _check_triton(k)
    B, T, HKV, D = k.shape
    if k_cache.shape != (B, k_cache.shape[1], HKV, D) or v_prime_cache.shape != k_cache.shape:
        raise ShapeError(f"`k_cache` and `v_prime_cache` must be [B, C, H_kv, D] = [{B}, C, {HKV}, {D}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_prime_cache.shape)}")
    if v_prime_cache.dtype != torch.float32:
        raise DTypeError(f"`v_prime_cache` must be fp32 (the cache's V′), got {v_prime_cache.dtype}")
    if T == 0:
        return torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    C = k_cache.shape[1]
    if (cache_mask is None) != (attention_mask is None):
        cache_mask = torch.ones(B, C, dtype=torch.bool, device=k.device) if cache_mask is None else cache_mask
        attention_mask = torch.ones(B, T, dtype=torch.bool, device=k.device) if attention_mask is None else attention_mask
    width = storage_dim(D)
    v_prime = _lucid_extend_op(_cache_view(k_cache.to(k.dtype), width), _cache_view(v_prime_cache, width),
                               _mask_arg(cache_mask), _as_launched(k, width), _as_launched(v, width),
                               _mask_arg(attention_mask), D, float(eps), bool(unit_diagonal))
    return v_prime[..., :D] if width != D else v_prime


def lucid_attend(q: torch.Tensor, k: torch.Tensor, v_prime: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention of ``q`` ``[B, S, H, D]`` over (``k``, ``v_prime``)
    ``[B, N, H_kv, D]`` (all one dtype), query i at position N − S + i."""
    from ._flash import flash_attention

    return flash_attention(q, k, v_prime, attention_mask)


def lucid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    eps: float = LUCID_ATTENTION_EPS,
    *,
    upcast: bool = True,
    unit_diagonal: bool = False,
) -> torch.Tensor:
    """Triton LUCID attention with the signature of
    :func:`laminae.primitives.lucid_attention.lucid_attention_reference`.

    ``q`` ``[B, S, H, D]``, ``k``/``v`` ``[B, N, H_kv, D]`` (fp32/bf16/fp16, N ≥ S),
    ``attention_mask`` an optional ``(B, N)`` keep mask. Returns ``[B, S, H, D]`` in the input
    dtype. ``upcast`` is accepted for interchangeability: the kernels always
    accumulate in fp32; the attention reads V′ in the input dtype, written by the
    substitution itself."""
    check_lucid_inputs(q, k, v, attention_mask, eps)
    _check_triton(q)
    if q.shape[1] == 0:
        return torch.zeros_like(q) + 0.0 * (k.sum() + v.sum())
    _, v_prime = _preconditioned(k, v, attention_mask, eps, unit_diagonal)
    return lucid_attend(q, k, v_prime, attention_mask)


# ----------------------------------------------------------------------------
# Static configurations and the tour
# ----------------------------------------------------------------------------


def static_cases() -> Iterator[StaticCase]:
    """Every kernel at every configuration the launchers pick: per dtype and padded head
    dim, the masks and diagonal choices, the three substitution variants (forward,
    dV, decoding), the fused or split dk̂ epilogue and both cache-panel row tiles. The
    launchers pass 16-byte-aligned tensors and a head dim padded to a multiple of 16
    (``_as_launched``) and keep the sizes unspecialised, so each configuration has
    exactly one binary: the one compiled here with ``divisible``. bf16/fp16 at head
    dims 64 and 128 must build every matmul-shaped product on wgmma (``expect``)."""
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        torch_dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dt]
        precision, inv_precision = dot_precision(torch_dt), inverse_precision(torch_dt)
        wgmma = dt != "fp32"
        sizes = dict(N="i32", HKV="i32", D="i32")
        tags = {"dtype": dt}
        for bd, t in _TILES[_family(torch_dt)].items():
            expect = "HGMMA" if wgmma and bd >= 64 else ""

            def case(name, kernel, signature, constexprs, warps, matmul=True, also=()):
                pointers = tuple(a for a, ty in signature.items() if ty.startswith("*"))
                return StaticCase(name, kernel, signature, constexprs, warps, NUM_STAGES, tags=tags,
                                  expect=expect if matmul else "", divisible=pointers + ("D",) + also)

            cols = min(t.dk_cols, bd)
            for has_mask in (True, False):
                for unit in (False, True):
                    yield case("lucid_prep", _lucid_prep_kernel,
                               dict(k_ptr=p, mask_ptr="*i8", rho_ptr="*fp32", linv_ptr="*fp32") | sizes
                               | dict(head_dim="i32", eps="fp32", scale="fp32", shift="fp32"),
                               dict(HAS_MASK=has_mask, UNIT_DIAG=unit, BLOCK=t.block, BLOCK_D=bd,
                                    SUB=min(SUB, t.block), LEVELS=_levels(t.block), PRECISION=precision,
                                    INV_PRECISION=inv_precision), t.warps)
                    yield case("lucid_bwd_dk", _lucid_dk_kernel,
                               dict(k_ptr=p, mask_ptr="*i8", rho_ptr="*fp32", vp_ptr=p, dv_ptr=p, vp32_ptr="*fp32",
                                    dv32_ptr="*fp32", out_ptr=p if cols == bd else "*fp32") | sizes
                               | dict(head_dim="i32", eps="fp32", scale="fp32", shift="fp32"),
                               dict(HAS_MASK=has_mask, UNIT_DIAG=unit, BLOCK=t.block, BLOCK_N=t.dk_block_n,
                                    BLOCK_D=bd, BLOCK_DK=cols, PRECISION=precision), t.dk_warps)
                # forward (V′ in fp32 and, for 16-bit inputs, in their dtype), dV, decoding (fp32 V′ only)
                variants = {"lucid_solve": (p, False, True, wgmma), "lucid_bwd_dv": ("*fp32", True, True, wgmma)}
                if wgmma:
                    variants["lucid_decode_solve"] = (p, False, True, False)
                for name, (rhs, transposed, store_out, store_op) in variants.items():
                    yield case(name, _lucid_solve_kernel,
                               dict(k_ptr=p, rhs_ptr=rhs, mask_ptr="*i8", rho_ptr="*fp32", linv_ptr="*fp32",
                                    part_ptr="*fp32", r_ptr="*fp32", out_ptr="*fp32", op_ptr=p) | sizes
                               | dict(n_parts="i32", step="i32", scale="fp32", shift="fp32"),
                               dict(HAS_MASK=has_mask, BLOCK=t.block, BLOCK_D=bd, BLOCK_DV=min(t.block_dv, bd),
                                    PRECISION=precision, INV_PRECISION=inv_precision, TRANSPOSED=transposed,
                                    STORE_OUT=store_out, STORE_OP=store_op), t.warps)
                for rows in dict.fromkeys((DECODE_ROWS, t.block)):
                    yield case("lucid_decode_panel", _lucid_cache_panel_kernel,
                               dict(k_ptr=p, kc_ptr=p, mask_ptr="*i8", maskc_ptr="*i8", rho_ptr="*fp32",
                                    vpc_ptr="*fp32", part_ptr="*fp32", T="i32", C="i32", HKV="i32", D="i32",
                                    head_dim="i32", kc_bstride="i32", maskc_bstride="i32", vpc_bstride="i32",
                                    chunk="i32", eps="fp32", scale="fp32", shift="fp32"),
                               dict(HAS_MASK=has_mask, ROWS=rows, BLOCK_C=t.block, BLOCK_D=bd, PRECISION=precision),
                               t.panel_warps, matmul=rows >= 64, also=("kc_bstride", "vpc_bstride", "chunk"))
                if cols < bd:
                    for unit in (False, True):
                        yield case("lucid_bwd_norm", _lucid_norm_bwd_kernel,
                                   dict(k_ptr=p, mask_ptr="*i8", rho_ptr="*fp32", dkh_ptr="*fp32", vp32_ptr="*fp32",
                                        dv32_ptr="*fp32", dk_ptr=p) | sizes
                                   | dict(head_dim="i32", eps="fp32", scale="fp32", shift="fp32"),
                                   dict(HAS_MASK=has_mask, UNIT_DIAG=unit, BLOCK=t.block, BLOCK_D=bd), t.dk_warps,
                                   matmul=False)


def tour_case(device: torch.device):
    from laminae.primitives.lucid_attention import lucid_attention_reference

    from .tour import TourCase, attention_inputs

    inputs = attention_inputs(device, torch.Generator().manual_seed(0))
    return TourCase("lucid_attention (GQA 4/2, D=32, ragged)", lucid_attention, lucid_attention_reference,
                    inputs, ["q", "k", "v"])
