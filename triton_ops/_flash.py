"""Causal softmax flash attention: the forward and backward kernels other attention
mechanisms build on.

Layout and visibility (the toolkit's attention convention):

- ``q`` is ``[B, S, H, D]``; ``k`` and ``v`` are ``[B, N, H_kv, D]`` with ``N ≥ S``
  and ``H % H_kv == 0`` (query head ``h`` reads kv head ``h // (H // H_kv)``).
- Query ``i`` sits at absolute position ``N − S + i`` (``S == N``: a plain forward;
  ``S < N``: decoding after a cache of ``N − S`` keys).
- Key ``j`` is visible to query ``i`` iff ``j ≤ N − S + i`` and ``key_mask[b, j]``;
  with a sliding ``window`` W also ``N − S + i − j < W`` (the query and the W − 1
  positions before it; key blocks wholly outside the window are skipped).
- A query with no visible key returns 0 and has log-sum-exp ``−inf``.

Forward   grid ``(cdiv(S, BLOCK_M), B·H)``: online softmax over key blocks in fp32
          (base-2 exponentials), never holding an S×N matrix. Writes ``O = P·V`` in
          the dtype of the output buffer the caller allocates (callers that add an
          epilogue, such as affine-scaled attention, ask for fp32) and the per-row
          natural log-sum-exp ``[B, H, S]`` in fp32.
Backward  ``delta = rowsum(dO·O)`` (torch, or the caller's own fused row kernel);
          a dq kernel over query blocks and a dk/dv kernel over key blocks that
          loops over the query heads of its kv group, so GQA gradients are summed
          on chip. Both recompute ``P = exp(s − lse)``.

The head dim is padded to ``max(16, next_power_of_2(D))`` with masked loads
(``tl.dot`` needs every dimension ≥ 16); offsets of the batch/head bases are int64.
Tiles depend on the padded head dim and the dtype (:func:`tiles`), sized for Hopper
and checked for spills by the static sm_90 check.

Public pieces: :func:`flash_forward` / :func:`flash_backward` (plain launchers a
caller's ``triton_op`` can use), the differentiable op :func:`flash_attention`
and :func:`flash_attention_reference`, and :func:`static_cases`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import ConfigError, DTypeError, ShapeError

from ._common import StaticCase, dot_precision, empty

__all__ = [
    "FlashTiles",
    "MAX_HEAD_DIM",
    "tiles",
    "flash_forward",
    "flash_backward",
    "flash_attention",
    "flash_attention_reference",
    "static_cases",
]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _visible(rows, cols, S, N, mask_ptr, b, HAS_MASK: tl.constexpr, WINDOW):
    """[BLOCK_M, BLOCK_N] bool: query row i sees key col j (causal, in range, kept,
    within WINDOW positions when WINDOW > 0)."""
    vis = (cols[None, :] <= (N - S + rows)[:, None]) & (rows < S)[:, None] & (cols < N)[None, :]
    vis = vis & ((WINDOW <= 0) | ((N - S + rows)[:, None] - cols[None, :] < WINDOW))
    if HAS_MASK:
        keep = tl.load(mask_ptr + b * N + cols, mask=cols < N, other=0)
        vis = vis & (keep != 0)[None, :]
    return vis


@triton.jit
def _window_first_key(first_query_pos, WINDOW, BLOCK_N: tl.constexpr):
    """First key block any query at or after ``first_query_pos`` can see (0 without a window)."""
    lo = tl.maximum(first_query_pos - WINDOW + 1, 0)
    return tl.where(WINDOW > 0, (lo // BLOCK_N) * BLOCK_N, 0)


@triton.jit
def _flash_fwd_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, lse_ptr,
                      S, N, H, HKV, D, qk_scale, WINDOW,
                      HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kvh = h // (H // HKV)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_base = q_ptr + (b * S * H + h) * D
    k_base = k_ptr + (b * N * HKV + kvh) * D
    v_base = v_ptr + (b * N * HKV + kvh) * D
    row_ok = rows < S
    q = tl.load(q_base + rows[:, None] * (H * D) + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # keys past the last query of this block are never visible
    hi = tl.minimum(N, N - S + (pid_m + 1) * BLOCK_M)
    lo = _window_first_key(N - S + pid_m * BLOCK_M, WINDOW, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols < N)[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * (HKV * D) + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(_visible(rows, cols, S, N, mask_ptr, b, HAS_MASK, WINDOW), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        corr = tl.exp2(m_i - m_shift)
        l_i = l_i * corr + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * (HKV * D) + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    empty_row = l_i == 0.0
    l_safe = tl.where(empty_row, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty_row, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    o_base = o_ptr + (b * S * H + h) * D
    tl.store(o_base + rows[:, None] * (H * D) + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + (b * H + h) * S + rows, lse, mask=row_ok)


@triton.jit
def _flash_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                         S, N, H, HKV, D, qk_scale, sm_scale, WINDOW,
                         HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    kvh = h // (H // HKV)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_ok = rows < S
    q_off = (b * S * H + h) * D + rows[:, None] * (H * D) + offs_d[None, :]
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    do = tl.load(do_ptr + q_off, mask=q_mask, other=0.0)
    lse = tl.load(lse_ptr + (b * H + h) * S + rows, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + (b * H + h) * S + rows, mask=row_ok, other=0.0)
    k_base = k_ptr + (b * N * HKV + kvh) * D
    v_base = v_ptr + (b * N * HKV + kvh) * D

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    hi = tl.minimum(N, N - S + (pid_m + 1) * BLOCK_M)
    lo = _window_first_key(N - S + pid_m * BLOCK_M, WINDOW, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols < N)[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * (HKV * D) + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * (HKV * D) + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(_visible(rows, cols, S, N, mask_ptr, b, HAS_MASK, WINDOW), s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(dq_ptr + q_off, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _flash_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                           S, N, H, HKV, D, qk_scale, sm_scale, WINDOW,
                           HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    b = (pid_bkv // HKV).to(tl.int64)
    kvh = pid_bkv % HKV
    group = H // HKV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_off = (b * N * HKV + kvh) * D + cols[:, None] * (HKV * D) + offs_d[None, :]
    kv_mask = (cols < N)[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # the first query that can see key pid_n·BLOCK_N, rounded down to a query block
    lo = tl.maximum(pid_n * BLOCK_N - (N - S), 0)
    lo = (lo // BLOCK_M) * BLOCK_M
    # the last query that can see the last key of this block, with a window
    hi = tl.where(WINDOW > 0, tl.minimum(S, (pid_n + 1) * BLOCK_N - 1 + WINDOW - (N - S)), S)
    for g in range(0, group):
        h = kvh * group + g
        q_base = (b * S * H + h) * D
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + offs_m
            row_ok = rows < S
            q_off = q_base + rows[:, None] * (H * D) + offs_d[None, :]
            q_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
            do = tl.load(do_ptr + q_off, mask=q_mask, other=0.0)
            lse = tl.load(lse_ptr + (b * H + h) * S + rows, mask=row_ok, other=0.0)
            lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
            delta = tl.load(delta_ptr + (b * H + h) * S + rows, mask=row_ok, other=0.0)
            # transposed scores sᵀ [BLOCK_N, BLOCK_M]: key rows, query columns
            st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
            vis = tl.trans(_visible(rows, cols, S, N, mask_ptr, b, HAS_MASK, WINDOW))
            pt = tl.exp2(tl.where(vis, st, float("-inf")) - lse2[None, :])
            dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
            dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)
    tl.store(dk_ptr + kv_off, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


# ----------------------------------------------------------------------------
# Tiles
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FlashTiles:
    """Tile sizes and warps of the three kernels for one padded head dim."""

    fwd_m: int
    fwd_n: int
    fwd_warps: int
    dq_m: int
    dq_n: int
    dq_warps: int
    dkdv_m: int
    dkdv_n: int
    dkdv_warps: int
    stages: int = 2


# Keyed by BLOCK_D; sized for sm_90 (228 KB shared memory and 64K registers per SM)
# and checked to compile without spills by the static check. fp32 inputs take exact
# ("ieee") products, which run on the FMA units and hold their operands in
# registers, hence smaller tiles than bf16/fp16 (tensor cores).
_TILES_16BIT: dict[int, FlashTiles] = {
    16: FlashTiles(64, 64, 4, 64, 64, 4, 64, 64, 4),
    32: FlashTiles(64, 64, 4, 64, 64, 4, 64, 64, 4),
    64: FlashTiles(64, 64, 4, 64, 64, 4, 32, 64, 8),
    128: FlashTiles(64, 32, 4, 64, 32, 8, 32, 32, 8),
    256: FlashTiles(64, 16, 8, 32, 32, 8, 16, 16, 8),
}
_TILES_FP32: dict[int, FlashTiles] = {
    16: FlashTiles(64, 64, 4, 32, 32, 4, 32, 32, 4),
    32: FlashTiles(64, 32, 8, 64, 32, 8, 16, 32, 4),
    64: FlashTiles(64, 32, 8, 64, 32, 8, 32, 32, 8),
    128: FlashTiles(16, 32, 8, 32, 32, 8, 32, 32, 8),
    256: FlashTiles(16, 32, 8, 16, 32, 8, 16, 16, 8),
}


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def tiles(head_dim: int, dtype: torch.dtype) -> FlashTiles:
    """Launch tiles for ``head_dim`` and the input dtype (tests may monkeypatch this
    to force small tiles, so short sequences still span several blocks)."""
    table = _TILES_FP32 if dtype == torch.float32 else _TILES_16BIT
    return table[block_d(head_dim)]


# ----------------------------------------------------------------------------
# Launchers (usable inside another op's body)
# ----------------------------------------------------------------------------


def _check_dims(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"Triton flash attention supports fp32/bf16/fp16 inputs, got {q.dtype}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ShapeError(f"Triton flash attention supports head_dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}")
    if k.shape[1] < q.shape[1]:
        raise ShapeError(f"keys must cover the query positions (N >= S), got S={q.shape[1]}, N={k.shape[1]}")
    if q.shape[2] % k.shape[2]:
        raise ShapeError(f"kv heads ({k.shape[2]}) must divide query heads ({q.shape[2]})")


def mask_arg(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A (B, N) keep mask as contiguous int8 for the kernels (None stays None)."""
    return None if key_mask is None else key_mask.to(torch.int8).contiguous()


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                  out_dtype: torch.dtype | None = None, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(O, lse)``: ``O = softmax(q·kᵀ/√D + mask)·v`` ``[B, S, H, D]`` in ``out_dtype``
    (default: the dtype of ``q``) and the natural log-sum-exp ``[B, H, S]`` fp32.

    ``q``, ``k``, ``v`` must be contiguous; ``key_mask`` is None or contiguous int8
    (see :func:`mask_arg`)."""
    B, S, H, D = q.shape
    N, HKV = k.shape[1], k.shape[2]
    t = tiles(D, q.dtype)
    o = empty((B, S, H, D), dtype=out_dtype or q.dtype, device=q.device)
    lse = empty((B, H, S), dtype=torch.float32, device=q.device)
    wrap_triton(_flash_fwd_kernel)[(triton.cdiv(S, t.fwd_m), B * H)](
        q, k, v, key_mask, o, lse, S, N, H, HKV, D, LOG2E / math.sqrt(D), window,
        HAS_MASK=key_mask is not None, BLOCK_M=t.fwd_m, BLOCK_N=t.fwd_n, BLOCK_D=block_d(D),
        PRECISION=dot_precision(q.dtype), num_warps=t.fwd_warps, num_stages=t.stages,
    )
    return o, lse


def flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                   do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, window: int = 0,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` for upstream ``do`` ``[B, S, H, D]`` (the dtype of ``q``), given
    the forward's ``lse`` and ``delta = rowsum(do·O)`` ``[B, H, S]`` fp32. All
    contiguous; gradients in the dtypes of q, k, v, summed over each GQA group."""
    B, S, H, D = q.shape
    N, HKV = k.shape[1], k.shape[2]
    t = tiles(D, q.dtype)
    dq = empty(q.shape, dtype=q.dtype, device=q.device)
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    dv = empty(v.shape, dtype=v.dtype, device=v.device)
    common = dict(HAS_MASK=key_mask is not None, BLOCK_D=block_d(D), PRECISION=dot_precision(q.dtype),
                  num_stages=t.stages)
    scale = 1.0 / math.sqrt(D)
    wrap_triton(_flash_bwd_dq_kernel)[(triton.cdiv(S, t.dq_m), B * H)](
        q, k, v, key_mask, do, lse, delta, dq, S, N, H, HKV, D, scale * LOG2E, scale, window,
        BLOCK_M=t.dq_m, BLOCK_N=t.dq_n, num_warps=t.dq_warps, **common,
    )
    wrap_triton(_flash_bwd_dkdv_kernel)[(triton.cdiv(N, t.dkdv_n), B * HKV)](
        q, k, v, key_mask, do, lse, delta, dk, dv, S, N, H, HKV, D, scale * LOG2E, scale, window,
        BLOCK_M=t.dkdv_m, BLOCK_N=t.dkdv_n, num_warps=t.dkdv_warps, **common,
    )
    return dq, dk, dv


# ----------------------------------------------------------------------------
# The differentiable op
# ----------------------------------------------------------------------------


@triton_op("laminae::flash_attention_fwd", mutates_args=())
def _flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_mask: torch.Tensor | None, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_forward(q, k, v, key_mask, window=window)


@triton_op("laminae::flash_attention_bwd", mutates_args=())
def _flash_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                         do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, window: int = 0,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_backward(q, k, v, key_mask, do, lse, delta, window)


def _setup_context(ctx, inputs, output):
    q, k, v, key_mask = inputs[:4]
    o, lse = output
    ctx.save_for_backward(q, k, v, key_mask, o, lse)
    ctx.window = inputs[4] if len(inputs) > 4 else 0


def _backward(ctx, do, _dlse):
    q, k, v, key_mask, o, lse = ctx.saved_tensors
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1).permute(0, 2, 1).contiguous()
    dq, dk, dv = _flash_attention_bwd(q, k, v, key_mask, do, lse, delta, ctx.window)
    return dq, dk, dv, None, None


_flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    key_mask: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal softmax attention ``[B, S, H, D]`` (differentiable in q, k, v); the
    signature of :func:`flash_attention_reference`. ``window`` W: each query sees
    itself and the W − 1 positions before it (sliding-window attention)."""
    _check_dims(q, k)
    window = _check_window(window)
    o, _ = _flash_attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), mask_arg(key_mask), window)
    return o


def _check_window(window: int | None) -> int:
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"`window` must be None or a positive int, got {window!r}")
    return window


def flash_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              key_mask: torch.Tensor | None = None, window: int | None = None, *,
                              upcast: bool = True) -> torch.Tensor:
    """Plain causal softmax attention with the same conventions (materialises P)."""
    dtype = q.dtype
    compute = torch.promote_types(dtype, torch.float32) if upcast else dtype
    B, S, H, D = q.shape
    N, group = k.shape[1], H // k.shape[2]
    qc = q.to(compute)
    kc = k.to(compute).repeat_interleave(group, dim=2)
    vc = v.to(compute).repeat_interleave(group, dim=2)
    scores = torch.einsum("bshd,bnhd->bhsn", qc, kc) / math.sqrt(D)
    distance = torch.arange(S, device=q.device)[:, None] + (N - S) - torch.arange(N, device=q.device)[None, :]
    visible = (distance >= 0) & (distance < (_check_window(window) or N + 1))
    visible = visible[None, None]
    if key_mask is not None:
        visible = visible & key_mask.to(q.device).bool()[:, None, None, :]
    any_visible = visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~any_visible, 0.0)
    p = torch.softmax(scores, dim=-1).masked_fill(~visible, 0.0)
    return torch.einsum("bhsn,bnhd->bshd", p, vc).to(dtype)


# ----------------------------------------------------------------------------
# Static configurations
# ----------------------------------------------------------------------------


def static_cases(out_dtypes: tuple[str, ...] | None = None) -> Iterator[StaticCase]:
    """Every (dtype, head-dim tile, mask) configuration the three kernels launch with.

    ``out_dtypes`` lists extra forward output dtypes (an epilogue caller stores O in
    fp32 for bf16/fp16 inputs)."""
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        precision = dot_precision(torch.float32 if dt == "fp32" else torch.bfloat16)
        for bd, t in (_TILES_FP32 if dt == "fp32" else _TILES_16BIT).items():
            for has_mask in (True, False):
                tags = {"dtype": dt}
                base = dict(HAS_MASK=has_mask, BLOCK_D=bd, PRECISION=precision)
                for o_dt in dict.fromkeys((dt, *(out_dtypes or ()))):
                    yield StaticCase(
                        "flash_fwd", _flash_fwd_kernel,
                        dict(q_ptr=p, k_ptr=p, v_ptr=p, mask_ptr="*i8", o_ptr=f"*{o_dt}", lse_ptr="*fp32",
                             S="i32", N="i32", H="i32", HKV="i32", D="i32", qk_scale="fp32", WINDOW="i32"),
                        dict(base, BLOCK_M=t.fwd_m, BLOCK_N=t.fwd_n), t.fwd_warps, t.stages,
                        tags=tags | ({"out": o_dt} if o_dt != dt else {}))
                bwd_sig = dict(q_ptr=p, k_ptr=p, v_ptr=p, mask_ptr="*i8", do_ptr=p, lse_ptr="*fp32",
                               delta_ptr="*fp32")
                scalars = dict(S="i32", N="i32", H="i32", HKV="i32", D="i32", qk_scale="fp32", sm_scale="fp32",
                               WINDOW="i32")
                yield StaticCase("flash_bwd_dq", _flash_bwd_dq_kernel, bwd_sig | dict(dq_ptr=p) | scalars,
                                 dict(base, BLOCK_M=t.dq_m, BLOCK_N=t.dq_n), t.dq_warps, t.stages, tags=tags)
                yield StaticCase("flash_bwd_dkdv", _flash_bwd_dkdv_kernel,
                                 bwd_sig | dict(dk_ptr=p, dv_ptr=p) | scalars,
                                 dict(base, BLOCK_M=t.dkdv_m, BLOCK_N=t.dkdv_n), t.dkdv_warps, t.stages, tags=tags)
