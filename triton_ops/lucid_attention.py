"""LUCID preconditioned attention: Triton kernels.

The preconditioner V′ = L⁻¹V (L_ij = exp(s·k̂_i·k̂_j − √d), j ≤ i) is one op with
three kernels; the attention of q over (k, V′) is the toolkit's causal flash
attention (``_flash.py``). Autograd sums the two key gradients (the softmax's and
the preconditioner's).

Preconditioner forward ``_lucid_solve_kernel``, grid ``(B·H_kv,)``
    Block forward substitution, sequential over block rows I of ``BLOCK`` keys:
    ``rhs = V_I − Σ_{J<I} L_IJ V′_J`` with each tile ``L_IJ`` recomputed from k̂
    (``tl.dot`` then exp), then the diagonal block solved in registers, one row at a
    time (column-oriented: ``x_r = rhs_r / L_rr``, ``rhs −= L[:, r]·x_r``). k̂ is
    recomputed from k for every tile (one row reduction); V′ is written in fp32 and
    read back by later block rows of the same program. Memory O(BLOCK² + BLOCK·D).
Preconditioner backward (given dV′ from the attention backward)
    ``_lucid_dv_kernel``, grid ``(B·H_kv,)``: reverse block substitution
    ``Lᵀ dV = dV′`` (block rows from last to first; the off-diagonal tile ``L_JI`` is
    the same exp(Gram) tile read transposed; the diagonal block solved in registers
    from its last row up). dV in fp32.
    ``_lucid_dk_kernel``, grid ``(cdiv(N, BLOCK), B·H_kv)``: fully parallel. For key
    block I, ``dk̂_I = s·Σ_J dS_IJ k̂_J + s·Σ_J dS_JIᵀ k̂_J`` with
    ``dS = −(dV V′ᵀ) ⊙ L`` on the allowed lower triangle (J ≤ I and J ≥ I loops,
    tiles recomputed), then the RMS-norm backward ``dk = ρ(dk̂ − k̂(k̂·dk̂)/d)``.
Saved for backward: k (raw), V′ (fp32), the keep mask. Recomputed: k̂, ρ, L tiles.
Never materialised: any N×N matrix.

Padding keys (keep mask 0) have a zero row and column in L and a unit diagonal;
their k̂ is taken as 0, so they get no preconditioner gradient.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
# Row sums call tl.reduce with tl.sum's own combine function: the same code on the GPU,
# but the interpreter runs it through numpy without re-entering a jit function, which
# keeps the row-by-row solves fast enough for the CPU test suite.
from triton.language.standard import _sum_combine

from laminae.primitives._errors import DTypeError, ShapeError
from laminae.primitives.lucid_attention import LUCID_ATTENTION_EPS, check_lucid_inputs

from ._common import StaticCase, dot_precision, empty

__all__ = ["lucid_attention", "lucid_precondition", "lucid_attend", "max_head_dim", "static_cases", "tour_case"]


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _keep_rows(mask_ptr, b, rows, N, HAS_MASK: tl.constexpr):
    keep = rows < N
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + b * N + rows, mask=rows < N, other=0) != 0)
    return keep


@triton.jit
def _khat_tile(k_base, rows, keep, row_stride, D, eps, BLOCK_D: tl.constexpr):
    """(k̂, ρ) for a tile of rows in fp32; rows not kept (padding, past N) get k̂ = 0."""
    offs_d = tl.arange(0, BLOCK_D)
    m = keep[:, None] & (offs_d < D)[None, :]
    k = tl.load(k_base + rows[:, None] * row_stride + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    rho = 1.0 / tl.sqrt(tl.reduce(k * k, 1, _sum_combine) / D + eps)
    rho = tl.where(keep, rho, 0.0)
    return k * rho[:, None], rho


@triton.jit
def _l_tile(kh_i, kh_j, allowed, scale, shift, PRECISION: tl.constexpr):
    """exp(s·k̂_i·k̂_j − √d) where allowed, else 0."""
    s = tl.dot(kh_i, tl.trans(kh_j), input_precision=PRECISION) * scale - shift
    return tl.where(allowed, tl.exp(s), 0.0)


@triton.jit
def _unit_triangular_solve(t, rhs, n_rows, BLOCK: tl.constexpr, UPPER: tl.constexpr):
    """Solve ``t·x = rhs`` for a triangular [BLOCK, BLOCK] tile ``t`` (lower, or upper when
    ``UPPER``) in registers, row by row over the first ``n_rows`` rows.

    Rows are first scaled by the inverse diagonal, so the loop runs on a unit triangle:
    column-oriented, ``x_r`` is final when reached and is eliminated from the remaining
    rows (``rhs −= t[:, r]·x_r``); at the end ``rhs`` holds x."""
    offs = tl.arange(0, BLOCK)
    eye = offs[None, :] == offs[:, None]
    inv = 1.0 / tl.reduce(tl.where(eye, t, 0.0), 1, _sum_combine)
    m = tl.where(eye, 0.0, t * inv[:, None])
    rhs = rhs * inv[:, None]
    for it in range(0, n_rows):
        if UPPER:
            r = n_rows - 1 - it
        else:
            r = it
        sel = offs == r
        col = tl.reduce(tl.where(sel[None, :], m, 0.0), 1, _sum_combine)  # column r of the unit triangle
        x_r = tl.reduce(tl.where(sel[:, None], rhs, 0.0), 0, _sum_combine)  # final x_r
        rhs -= col[:, None] * x_r[None, :]
    return rhs


@triton.jit
def _lucid_solve_kernel(k_ptr, v_ptr, mask_ptr, vp_ptr, N, HKV, D, eps, scale, shift,
                        HAS_MASK: tl.constexpr, UNIT_DIAG: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    row_stride = HKV * D
    base = (b * N * HKV + kvh) * D
    k_base = k_ptr + base
    v_base = v_ptr + base
    vp_base = vp_ptr + base
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    for start in range(0, N, BLOCK):
        rows = start + offs
        keep_i = _keep_rows(mask_ptr, b, rows, N, HAS_MASK)
        kh_i, _ = _khat_tile(k_base, rows, keep_i, row_stride, D, eps, BLOCK_D)
        io = rows[:, None] * row_stride + offs_d[None, :]
        io_mask = (rows < N)[:, None] & d_ok[None, :]
        rhs = tl.load(v_base + io, mask=io_mask, other=0.0).to(tl.float32)
        # rhs = V_I − Σ_{J<I} L_IJ V′_J  (every column of an earlier block is below the diagonal)
        for start_j in range(0, start, BLOCK):
            cols = start_j + offs
            keep_j = _keep_rows(mask_ptr, b, cols, N, HAS_MASK)
            kh_j, _ = _khat_tile(k_base, cols, keep_j, row_stride, D, eps, BLOCK_D)
            l_ij = _l_tile(kh_i, kh_j, keep_i[:, None] & keep_j[None, :], scale, shift, PRECISION)
            vp_j = tl.load(vp_base + cols[:, None] * row_stride + offs_d[None, :],
                           mask=(cols < N)[:, None] & d_ok[None, :], other=0.0)
            rhs -= tl.dot(l_ij, vp_j, input_precision=PRECISION)
        # diagonal block L_II = Λ(I + M), M strictly lower: solve (I + M) x = Λ⁻¹ rhs in registers
        eye = offs[None, :] == offs[:, None]
        l_ii = _l_tile(kh_i, kh_i, (offs[None, :] < offs[:, None]) | eye, scale, shift, PRECISION)
        # padding keys and rows past N: unit diagonal, nothing off the diagonal
        l_ii = tl.where(keep_i[:, None] & keep_i[None, :], l_ii, tl.where(eye, 1.0, 0.0))
        if UNIT_DIAG:
            l_ii = tl.where(eye, 1.0, l_ii)
        x = _unit_triangular_solve(l_ii, rhs, tl.minimum(BLOCK, N - start), BLOCK, False)
        tl.store(vp_base + io, x, mask=io_mask)
        tl.debug_barrier()  # later block rows of this program read these V′ rows


@triton.jit
def _lucid_dv_kernel(k_ptr, mask_ptr, dvp_ptr, dv_ptr, N, HKV, D, eps, scale, shift,
                     HAS_MASK: tl.constexpr, UNIT_DIAG: tl.constexpr, BLOCK: tl.constexpr,
                     BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    row_stride = HKV * D
    base = (b * N * HKV + kvh) * D
    k_base = k_ptr + base
    dv_base = dv_ptr + base
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    n_blocks = tl.cdiv(N, BLOCK)
    for it in range(0, n_blocks):
        start = (n_blocks - 1 - it) * BLOCK
        rows = start + offs
        keep_i = _keep_rows(mask_ptr, b, rows, N, HAS_MASK)
        kh_i, _ = _khat_tile(k_base, rows, keep_i, row_stride, D, eps, BLOCK_D)
        io = rows[:, None] * row_stride + offs_d[None, :]
        io_mask = (rows < N)[:, None] & d_ok[None, :]
        rhs = tl.load(dvp_ptr + base + io, mask=io_mask, other=0.0).to(tl.float32)
        # rhs = dV′_I − Σ_{J>I} L_JIᵀ dV_J ; the Gram tile is symmetric, so [I, J] of exp(S) is L_JIᵀ
        for start_j in range(start + BLOCK, N, BLOCK):
            cols = start_j + offs
            keep_j = _keep_rows(mask_ptr, b, cols, N, HAS_MASK)
            kh_j, _ = _khat_tile(k_base, cols, keep_j, row_stride, D, eps, BLOCK_D)
            l_ji_t = _l_tile(kh_i, kh_j, keep_i[:, None] & keep_j[None, :], scale, shift, PRECISION)
            dv_j = tl.load(dv_base + cols[:, None] * row_stride + offs_d[None, :],
                           mask=(cols < N)[:, None] & d_ok[None, :], other=0.0)
            rhs -= tl.dot(l_ji_t, dv_j, input_precision=PRECISION)
        # diagonal block L_IIᵀ (upper), held as lt[a, c] = L[c, a]; solved in registers
        eye = offs[None, :] == offs[:, None]
        lt = _l_tile(kh_i, kh_i, (offs[None, :] > offs[:, None]) | eye, scale, shift, PRECISION)
        lt = tl.where(keep_i[:, None] & keep_i[None, :], lt, tl.where(eye, 1.0, 0.0))
        if UNIT_DIAG:
            lt = tl.where(eye, 1.0, lt)
        x = _unit_triangular_solve(lt, rhs, tl.minimum(BLOCK, N - start), BLOCK, True)
        tl.store(dv_base + io, x, mask=io_mask)
        tl.debug_barrier()  # earlier block rows of this program read these dV rows


@triton.jit
def _lucid_dk_kernel(k_ptr, mask_ptr, vp_ptr, dv_ptr, dk_ptr, N, HKV, D, eps, scale, shift,
                     HAS_MASK: tl.constexpr, UNIT_DIAG: tl.constexpr, BLOCK: tl.constexpr,
                     BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    row_stride = HKV * D
    base = (b * N * HKV + kvh) * D
    k_base = k_ptr + base
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    start = pid_n * BLOCK
    rows = start + offs
    keep_i = _keep_rows(mask_ptr, b, rows, N, HAS_MASK)
    kh_i, rho_i = _khat_tile(k_base, rows, keep_i, row_stride, D, eps, BLOCK_D)
    io = rows[:, None] * row_stride + offs_d[None, :]
    io_mask = (rows < N)[:, None] & d_ok[None, :]
    vp_i = tl.load(vp_ptr + base + io, mask=io_mask, other=0.0)
    dv_i = tl.load(dv_ptr + base + io, mask=io_mask, other=0.0)
    acc = tl.zeros((BLOCK, BLOCK_D), dtype=tl.float32)
    # I as the row: dS_IJ = −(dV_I V′_Jᵀ) ⊙ L_IJ for j ≤ i
    for start_j in range(0, start + BLOCK, BLOCK):
        cols = start_j + offs
        keep_j = _keep_rows(mask_ptr, b, cols, N, HAS_MASK)
        kh_j, _ = _khat_tile(k_base, cols, keep_j, row_stride, D, eps, BLOCK_D)
        allowed = (cols[None, :] <= rows[:, None]) & keep_i[:, None] & keep_j[None, :]
        if UNIT_DIAG:  # a constant diagonal has no gradient
            allowed = allowed & (cols[None, :] != rows[:, None])
        l_ij = _l_tile(kh_i, kh_j, allowed, scale, shift, PRECISION)
        vp_j = tl.load(vp_ptr + base + cols[:, None] * row_stride + offs_d[None, :],
                       mask=(cols < N)[:, None] & d_ok[None, :], other=0.0)
        ds = -tl.dot(dv_i, tl.trans(vp_j), input_precision=PRECISION) * l_ij
        acc += tl.dot(ds, kh_j, input_precision=PRECISION)
    # I as the column: dS_JIᵀ = −(V′_I dV_Jᵀ) ⊙ L_JIᵀ for j ≥ i (the diagonal counts twice)
    for start_j in range(start, N, BLOCK):
        cols = start_j + offs
        keep_j = _keep_rows(mask_ptr, b, cols, N, HAS_MASK)
        kh_j, _ = _khat_tile(k_base, cols, keep_j, row_stride, D, eps, BLOCK_D)
        allowed = (cols[None, :] >= rows[:, None]) & keep_i[:, None] & keep_j[None, :]
        if UNIT_DIAG:
            allowed = allowed & (cols[None, :] != rows[:, None])
        l_ji_t = _l_tile(kh_i, kh_j, allowed, scale, shift, PRECISION)
        dv_j = tl.load(dv_ptr + base + cols[:, None] * row_stride + offs_d[None, :],
                       mask=(cols < N)[:, None] & d_ok[None, :], other=0.0)
        ds_t = -tl.dot(vp_i, tl.trans(dv_j), input_precision=PRECISION) * l_ji_t
        acc += tl.dot(ds_t, kh_j, input_precision=PRECISION)
    dkh = acc * scale
    # RMS-norm backward: dk = ρ·(dk̂ − k̂·(k̂·dk̂)/d)
    dk = rho_i[:, None] * (dkh - kh_i * (tl.reduce(kh_i * dkh, 1, _sum_combine) / D)[:, None])
    tl.store(dk_ptr + base + io, dk.to(dk_ptr.dtype.element_ty), mask=io_mask)


# ----------------------------------------------------------------------------
# Tiles
# ----------------------------------------------------------------------------

# (BLOCK, num_warps) per padded head dim, for fp32 (exact "ieee" products on CUDA
# cores) and for bf16/fp16 (tensor cores), sized for sm_90 without spills (see
# ``python -m laminae.triton_ops._static lucid_attention``). Head dims above the
# largest key have no spill-free tile and are rejected.
# The tiles were sized at 2 pipeline stages; at Triton's default 3 the fp32 solve at
# D = 16 and the bf16/fp16 dV kernel at D = 32 spill on sm_90 (static check).
NUM_STAGES = 2
_TILES: dict[str, dict[int, tuple[int, int]]] = {
    "fp32": {16: (32, 4), 32: (32, 8), 64: (16, 8)},
    "low": {16: (64, 4), 32: (64, 4), 64: (32, 8), 128: (16, 8)},
}


def _family(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "low"


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def max_head_dim(dtype: torch.dtype) -> int:
    return max(_TILES[_family(dtype)])


def tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK, num_warps) for ``head_dim`` and ``dtype`` (tests monkeypatch this to
    force small blocks)."""
    return _TILES[_family(dtype)][block_d(head_dim)]


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _mask_arg(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if key_mask is None else key_mask.to(torch.int8).contiguous()


def _scalars(head_dim: int) -> tuple[float, float]:
    return 1.0 / math.sqrt(head_dim), math.sqrt(head_dim)


@triton_op("laminae::lucid_precondition", mutates_args=())
def _lucid_precondition_op(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                           eps: float, unit_diagonal: bool) -> torch.Tensor:
    """V′ = L⁻¹V ``[B, N, H_kv, D]`` in fp32 (k, v contiguous, key_mask int8 or None)."""
    B, N, HKV, D = k.shape
    block, warps = tiles(D, k.dtype)
    scale, shift = _scalars(D)
    vp = empty((B, N, HKV, D), dtype=torch.float32, device=k.device)
    wrap_triton(_lucid_solve_kernel)[(B * HKV,)](
        k, v, key_mask, vp, N, HKV, D, eps, scale, shift,
        HAS_MASK=key_mask is not None, UNIT_DIAG=unit_diagonal, BLOCK=block, BLOCK_D=block_d(D),
        PRECISION=dot_precision(k.dtype), num_warps=warps, num_stages=NUM_STAGES,
    )
    return vp


@triton_op("laminae::lucid_precondition_bwd", mutates_args=())
def _lucid_precondition_bwd_op(dvp: torch.Tensor, k: torch.Tensor, vp: torch.Tensor,
                               key_mask: torch.Tensor | None, eps: float,
                               unit_diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv) of the preconditioner: dv = L⁻ᵀ dV′ in fp32, dk in the dtype of k."""
    B, N, HKV, D = k.shape
    block, warps = tiles(D, k.dtype)
    scale, shift = _scalars(D)
    dv = empty((B, N, HKV, D), dtype=torch.float32, device=k.device)
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    common = dict(HAS_MASK=key_mask is not None, UNIT_DIAG=unit_diagonal, BLOCK=block, BLOCK_D=block_d(D),
                  PRECISION=dot_precision(k.dtype), num_warps=warps, num_stages=NUM_STAGES)
    wrap_triton(_lucid_dv_kernel)[(B * HKV,)](k, key_mask, dvp, dv, N, HKV, D, eps, scale, shift, **common)
    wrap_triton(_lucid_dk_kernel)[(triton.cdiv(N, block), B * HKV)](
        k, key_mask, vp, dv, dk, N, HKV, D, eps, scale, shift, **common)
    return dk, dv


def _setup_context(ctx, inputs, output):
    k, v, key_mask, eps, unit_diagonal = inputs
    ctx.save_for_backward(k, output, key_mask)
    ctx.eps, ctx.unit_diagonal = eps, unit_diagonal
    ctx.v_dtype = v.dtype


def _backward(ctx, dvp):
    k, vp, key_mask = ctx.saved_tensors
    dk, dv = _lucid_precondition_bwd_op(dvp.float().contiguous(), k, vp, key_mask, ctx.eps, ctx.unit_diagonal)
    return dk, dv.to(ctx.v_dtype), None, None, None


_lucid_precondition_op.register_autograd(_backward, setup_context=_setup_context)


def _check_triton(k: torch.Tensor) -> None:
    if k.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"the Triton LUCID kernels support fp32/bf16/fp16 inputs, got {k.dtype}")
    limit = max_head_dim(k.dtype)
    if k.shape[-1] > limit:
        raise ShapeError(f"the Triton LUCID kernels support head_dim <= {limit} for {k.dtype} "
                         f"(64 for fp32, 128 for bf16/fp16), got {k.shape[-1]}; use backend='reference'")


def lucid_precondition(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                       eps: float = LUCID_ATTENTION_EPS, *, unit_diagonal: bool = False) -> torch.Tensor:
    """Triton V′ = L⁻¹V with the signature of
    :func:`laminae.primitives.lucid_attention.lucid_precondition_reference`:
    ``k``, ``v`` ``[B, N, H_kv, D]`` → V′ ``[B, N, H_kv, D]`` fp32, differentiable in k and v."""
    _check_triton(k)
    if k.shape[1] == 0:
        return torch.zeros(k.shape, dtype=torch.float32, device=k.device) + 0.0 * (k.sum() + v.sum())
    return _lucid_precondition_op(k.contiguous(), v.contiguous(), _mask_arg(key_mask), float(eps),
                                  bool(unit_diagonal))


def lucid_attend(q: torch.Tensor, k: torch.Tensor, v_prime: torch.Tensor,
                 key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention of ``q`` ``[B, S, H, D]`` over (``k``, ``v_prime``)
    ``[B, N, H_kv, D]`` (all one dtype), query i at position N − S + i."""
    from ._flash import flash_attention

    return flash_attention(q, k, v_prime, key_mask)


def lucid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    eps: float = LUCID_ATTENTION_EPS,
    *,
    upcast: bool = True,
    unit_diagonal: bool = False,
) -> torch.Tensor:
    """Triton LUCID attention with the signature of
    :func:`laminae.primitives.lucid_attention.lucid_attention_reference`.

    ``q`` ``[B, S, H, D]``, ``k``/``v`` ``[B, N, H_kv, D]`` (fp32/bf16/fp16, N ≥ S),
    ``key_mask`` an optional ``(B, N)`` keep mask. Returns ``[B, S, H, D]`` in the input
    dtype. ``upcast`` is accepted for interchangeability: the kernels always
    accumulate in fp32 and keep V′ in fp32 for the solve; the attention reads V′ in the
    input dtype."""
    check_lucid_inputs(q, k, v, key_mask, eps)
    _check_triton(q)
    if q.shape[1] == 0:
        return torch.zeros_like(q) + 0.0 * (k.sum() + v.sum())
    v_prime = lucid_precondition(k, v, key_mask, eps, unit_diagonal=unit_diagonal)
    return lucid_attend(q, k, v_prime.to(q.dtype), key_mask)


# ----------------------------------------------------------------------------
# Static configurations and the tour
# ----------------------------------------------------------------------------


def static_cases() -> Iterator[StaticCase]:
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        precision = "ieee" if dt == "fp32" else "tf32"
        scalars = dict(N="i32", HKV="i32", D="i32", eps="fp32", scale="fp32", shift="fp32")
        for bd, (block, warps) in _TILES["fp32" if dt == "fp32" else "low"].items():
            for has_mask, unit in ((True, False), (False, False), (True, True), (False, True)):
                const = dict(HAS_MASK=has_mask, UNIT_DIAG=unit, BLOCK=block, BLOCK_D=bd, PRECISION=precision)
                tags = {"dtype": dt}
                yield StaticCase("lucid_solve", _lucid_solve_kernel,
                                 dict(k_ptr=p, v_ptr=p, mask_ptr="*i8", vp_ptr="*fp32") | scalars,
                                 const, warps, NUM_STAGES, tags=tags)
                yield StaticCase("lucid_bwd_dv", _lucid_dv_kernel,
                                 dict(k_ptr=p, mask_ptr="*i8", dvp_ptr="*fp32", dv_ptr="*fp32") | scalars,
                                 const, warps, NUM_STAGES, tags=tags)
                yield StaticCase("lucid_bwd_dk", _lucid_dk_kernel,
                                 dict(k_ptr=p, mask_ptr="*i8", vp_ptr="*fp32", dv_ptr="*fp32", dk_ptr=p) | scalars,
                                 const, warps, NUM_STAGES, tags=tags)


def tour_case(device: torch.device):
    from laminae.primitives.lucid_attention import lucid_attention_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    B, S, H, HKV, D = 2, 64, 4, 2, 32
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, :9] = False  # left padding in the second row
    keep[0, 50:53] = False  # a few holes
    inputs = {
        "q": torch.randn(B, S, H, D, generator=gen).to(device),
        "k": torch.randn(B, S, HKV, D, generator=gen).to(device),
        "v": torch.randn(B, S, HKV, D, generator=gen).to(device),
        "key_mask": keep.to(device),
    }
    return TourCase("lucid_attention (GQA 4/2, D=32, ragged)", lucid_attention, lucid_attention_reference,
                    inputs, ["q", "k", "v"])
