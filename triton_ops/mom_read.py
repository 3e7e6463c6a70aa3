"""MoM read kernels: per-token attention over the ``Tk·bs`` selected bank slots only.

Inputs (see :func:`laminae.primitives.mom_read.mom_read_reference`): ``q`` ``[B, S, H, hd]``,
bank keys/values ``[E·bs, H·hd]`` shared by the batch, ``top_idx`` ``[B, S, Tk]`` and
fp32 log-gates ``lg = log(max(g, 1e-9))`` ``[B, S, Tk]`` (computed in torch, so autograd
carries the gate gradient through the clamp and the router). No dense ``[B, S, E·bs]``
bias exists anywhere: a slot outside a token's selected blocks is never loaded.

Forward   ``_mom_fwd_kernel``, grid (B·S tokens, H): for each selected block t, an
          online softmax over its slots in chunks of ``BLOCK_N`` gives the block's
          partial (m_t, ℓ_t, u_t) without bias; the partials are merged with the
          log-gates by a second online softmax across blocks (a_t = lg_t + m_t):
          o = Σ_t e^{a_t−M} u_t / Σ_t e^{a_t−M} ℓ_t, LSE = M + log Σ_t e^{a_t−M} ℓ_t.
          Rows of a token differ in which slots they read, so scores are elementwise
          products and row sums (no tensor-core tile is shared by two tokens).
Backward  ``_mom_bwd_token_kernel``, same grid: δ = dO·o, recomputed
          P_j = exp(q·k_j/√hd + lg_t − LSE), dS_j = P_j (dO·v_j − δ); writes dq and,
          per head and block, the mass W_t = Σ_{j∈t} P_j and c_t = Σ_{j∈t} P_j dP_j;
          torch forms dlg_t = Σ_{j∈t} dS_j = Σ_t' (W_t' c_t − W_t c_t') (a pairwise
          form free of the cancellation c_t − W_t·δ has when W_t ≈ 1) and sums heads.
          ``_mom_bwd_bank_kernel``, grid (E · slot chunks, H): the (token, t) pairs are
          stably sorted by block in torch (as in a grouped MoE GEMM), so every pair
          tile of block e reads the same K/V rows and the scores are one ``tl.dot``;
          each program owns its slots and accumulates dK, dV over all pairs of its
          block on chip: deterministic, no atomics, exactly 0 for unselected blocks.

Head dims are padded to ``max(16, next_power_of_2(hd))`` with masked loads; bases
and gathered row indices are int64. fp32 accumulation for every dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import DTypeError, ShapeError
from laminae.primitives._validation import check_tensor
from laminae.primitives.mom_read import mom_log_gates

from ._common import StaticCase, dot_precision, empty, triton_dtype

__all__ = ["mom_read", "mom_read_fwd", "MoMTiles", "tiles", "static_cases", "tour_case", "MAX_HEAD_DIM"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_HEAD_DIM = 128


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _mom_fwd_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, lg_ptr, o_ptr, lse_ptr,
                    H, HD, TK, BS, qk_scale,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    D = H * HD
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    col = h * HD + offs_d
    q = tl.load(q_ptr + n * D + col, mask=d_ok, other=0.0).to(tl.float32)

    big_m = tl.full([], float("-inf"), tl.float32)   # running max of a_t (base 2)
    big_l = tl.zeros([], dtype=tl.float32)           # Σ_t e^{a_t − M} ℓ_t
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)     # Σ_t e^{a_t − M} u_t
    for t in range(0, TK):
        e = tl.load(idx_ptr + n * TK + t).to(tl.int64)
        lg2 = tl.load(lg_ptr + n * TK + t) * 1.4426950408889634
        # block t's own online softmax (no bias)
        m_t = tl.full([], float("-inf"), tl.float32)
        l_t = tl.zeros([], dtype=tl.float32)
        u_t = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for start in range(0, BS, BLOCK_N):
            j = start + offs_n
            j_ok = j < BS
            rows = e * BS + j
            kv_mask = j_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + rows[:, None] * D + col[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * qk_scale
            s = tl.where(j_ok, s, float("-inf"))
            m_new = tl.maximum(m_t, tl.max(s, axis=0))
            p = tl.exp2(s - m_new)
            corr = tl.exp2(m_t - m_new)
            v = tl.load(v_ptr + rows[:, None] * D + col[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            l_t = l_t * corr + tl.sum(p, axis=0)
            u_t = u_t * corr + tl.sum(p[:, None] * v, axis=0)
            m_t = m_new
        # merge the block partial with its log-gate
        a_t = lg2 + m_t
        m_next = tl.maximum(big_m, a_t)
        c_old = tl.exp2(big_m - m_next)
        c_t = tl.exp2(a_t - m_next)
        big_l = big_l * c_old + c_t * l_t
        acc = acc * c_old + c_t * u_t
        big_m = m_next
    o = acc / big_l
    tl.store(o_ptr + n * D + col, o.to(o_ptr.dtype.element_ty), mask=d_ok)
    tl.store(lse_ptr + n * H + h, (big_m + tl.log2(big_l)) * 0.6931471805599453)


@triton.jit
def _mom_bwd_token_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, lg_ptr, o_ptr, lse_ptr, do_ptr,
                          dq_ptr, delta_ptr, wc_ptr,
                          H, HD, TK, BS, qk_scale, sm_scale,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    D = H * HD
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    col = h * HD + offs_d
    q = tl.load(q_ptr + n * D + col, mask=d_ok, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + n * D + col, mask=d_ok, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + n * D + col, mask=d_ok, other=0.0).to(tl.float32)
    delta = tl.sum(do * o, axis=0)
    tl.store(delta_ptr + n * H + h, delta)
    lse2 = tl.load(lse_ptr + n * H + h) * 1.4426950408889634

    dq = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for t in range(0, TK):
        e = tl.load(idx_ptr + n * TK + t).to(tl.int64)
        lg2 = tl.load(lg_ptr + n * TK + t) * 1.4426950408889634
        mass = tl.zeros([], dtype=tl.float32)   # W_t = Σ_{j∈t} P_j
        mdp = tl.zeros([], dtype=tl.float32)    # c_t = Σ_{j∈t} P_j dP_j
        for start in range(0, BS, BLOCK_N):
            j = start + offs_n
            j_ok = j < BS
            rows = e * BS + j
            kv_mask = j_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + rows[:, None] * D + col[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + rows[:, None] * D + col[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * qk_scale + lg2
            p = tl.where(j_ok, tl.exp2(s - lse2), 0.0)
            dp = tl.sum(v * do[None, :], axis=1)
            ds = p * (dp - delta)
            dq += tl.sum(ds[:, None] * k, axis=0)
            mass += tl.sum(p, axis=0)
            mdp += tl.sum(p * dp, axis=0)
        wc = wc_ptr + ((n * H + h) * TK + t) * 2
        tl.store(wc, mass)
        tl.store(wc + 1, mdp)
    tl.store(dq_ptr + n * D + col, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _mom_bwd_bank_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr,
                         pair_tok_ptr, pair_lg_ptr, offsets_ptr, dk_ptr, dv_ptr,
                         H, HD, BS, qk_scale, sm_scale,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    chunks = tl.cdiv(BS, BLOCK_N)
    e = (pid // chunks).to(tl.int64)
    D = H * HD
    j = (pid % chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HD
    j_ok = j < BS
    col = h * HD + offs_d
    kv_off = (e * BS + j)[:, None] * D + col[None, :]
    kv_mask = j_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    for p0 in range(lo, hi, BLOCK_M):
        pm = p0 + offs_m
        p_ok = pm < hi
        tok = tl.load(pair_tok_ptr + pm, mask=p_ok, other=0).to(tl.int64)
        plg2 = tl.load(pair_lg_ptr + pm, mask=p_ok, other=0.0) * 1.4426950408889634
        q_mask = p_ok[:, None] & d_ok[None, :]
        q_off = tok[:, None] * D + col[None, :]
        q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
        do = tl.load(do_ptr + q_off, mask=q_mask, other=0.0)
        lse2 = tl.load(lse_ptr + tok * H + h, mask=p_ok, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_ptr + tok * H + h, mask=p_ok, other=0.0)
        # transposed scores [BLOCK_N slots, BLOCK_M pairs]
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale + plg2[None, :]
        pt = tl.where(j_ok[:, None] & p_ok[None, :], tl.exp2(st - lse2[None, :]), 0.0)
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
class MoMTiles:
    """``token_n``/``token_warps``: slot chunk and warps of the two token-major kernels;
    ``bank_m``/``bank_n``/``bank_warps``: pair tile, slot tile and warps of the bank
    gradient kernel (both ≥ 16: they feed ``tl.dot``)."""

    token_n: int
    token_warps: int
    bank_m: int
    bank_n: int
    bank_warps: int


_TILES: dict[int, MoMTiles] = {
    16: MoMTiles(32, 2, 16, 32, 4),
    32: MoMTiles(16, 2, 16, 32, 4),
    64: MoMTiles(32, 4, 16, 32, 4),
    128: MoMTiles(32, 4, 16, 32, 8),
}


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def tiles(head_dim: int, dtype: torch.dtype) -> MoMTiles:
    """Launch tiles for ``head_dim`` (tests may monkeypatch this to force small
    chunks, so small blocks still span several of them)."""
    return _TILES[block_d(head_dim)]


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _scales(head_dim: int) -> tuple[float, float]:
    sm_scale = 1.0 / math.sqrt(head_dim)
    return sm_scale * LOG2E, sm_scale


@triton_op("laminae::mom_read_fwd", mutates_args=())
def mom_read_fwd(q: torch.Tensor, k_bank: torch.Tensor, v_bank: torch.Tensor, top_idx: torch.Tensor,
                 log_gates: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, S, H, hd], lse [B, S, H] fp32)`` for contiguous q/k/v, int64 ``top_idx``
    and fp32 ``log_gates`` ``[B, S, Tk]``."""
    B, S, H, hd = q.shape
    tk = top_idx.shape[-1]
    o = empty(q.shape, dtype=q.dtype, device=q.device)
    lse = empty((B, S, H), dtype=torch.float32, device=q.device)
    t = tiles(hd, q.dtype)
    qk_scale, _ = _scales(hd)
    wrap_triton(_mom_fwd_kernel)[(B * S, H)](
        q, k_bank, v_bank, top_idx, log_gates, o, lse, H, hd, tk, block_size, qk_scale,
        BLOCK_N=t.token_n, BLOCK_D=block_d(hd), num_warps=t.token_warps,
    )
    return o, lse


@triton_op("laminae::mom_read_bwd", mutates_args=())
def _mom_read_bwd(do: torch.Tensor, q: torch.Tensor, k_bank: torch.Tensor, v_bank: torch.Tensor,
                  top_idx: torch.Tensor, log_gates: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, S, H, hd = q.shape
    tk = top_idx.shape[-1]
    slots = k_bank.shape[0]
    num_blocks = slots // block_size
    t = tiles(hd, q.dtype)
    qk_scale, sm_scale = _scales(hd)
    bd = block_d(hd)
    dq = empty(q.shape, dtype=q.dtype, device=q.device)
    delta = empty((B, S, H), dtype=torch.float32, device=q.device)
    wc = empty((B, S, H, tk, 2), dtype=torch.float32, device=q.device)
    wrap_triton(_mom_bwd_token_kernel)[(B * S, H)](
        q, k_bank, v_bank, top_idx, log_gates, o, lse, do, dq, delta, wc,
        H, hd, tk, block_size, qk_scale, sm_scale,
        BLOCK_N=t.token_n, BLOCK_D=bd, num_warps=t.token_warps,
    )
    # Routed pairs (token, t) sorted by block: the pairs of block e are
    # pair_tok[offsets[e]:offsets[e + 1]] (a stable sort, so the order is fixed).
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    pair_tok = torch.div(order, tk, rounding_mode="floor")
    pair_lg = log_gates.reshape(-1)[order].contiguous()
    offsets = torch.zeros(num_blocks + 1, dtype=torch.int64, device=q.device)
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=num_blocks), 0)
    dk = empty(k_bank.shape, dtype=k_bank.dtype, device=q.device)
    dv = empty(v_bank.shape, dtype=v_bank.dtype, device=q.device)
    grid = (num_blocks * triton.cdiv(block_size, t.bank_n), H)
    wrap_triton(_mom_bwd_bank_kernel)[grid](
        q, k_bank, v_bank, do, lse, delta, pair_tok, pair_lg, offsets, dk, dv,
        H, hd, block_size, qk_scale, sm_scale,
        BLOCK_M=t.bank_m, BLOCK_N=t.bank_n, BLOCK_D=bd, PRECISION=dot_precision(q.dtype),
        num_warps=t.bank_warps,
    )
    # dlg_t = Σ_{j∈t} P_j (dP_j − δ) = c_t − W_t·Σ_t' c_t' (δ = Σ_t' c_t', Σ_t' W_t' = 1)
    #       = Σ_t' (W_t' c_t − W_t c_t'),
    # the pairwise form: when one block holds almost all the mass (W_t ≈ 1, c_t ≈ δ)
    # every term is still a product of small numbers, where c_t − W_t·δ would cancel.
    mass, mdp = wc.unbind(-1)
    pairwise = mass.unsqueeze(-2) * mdp.unsqueeze(-1) - mass.unsqueeze(-1) * mdp.unsqueeze(-2)
    return dq, dk, dv, pairwise.sum(-1).sum(2)


def _setup_context(ctx, inputs, output):
    q, k_bank, v_bank, top_idx, log_gates, block_size = inputs
    o, lse = output
    ctx.block_size = block_size
    ctx.save_for_backward(q, k_bank, v_bank, top_idx, log_gates, o, lse)


def _backward(ctx, do, _dlse):
    q, k_bank, v_bank, top_idx, log_gates, o, lse = ctx.saved_tensors
    dq, dk, dv, dlg = _mom_read_bwd(do.contiguous(), q, k_bank, v_bank, top_idx, log_gates, o, lse,
                                    ctx.block_size)
    return dq, dk, dv, None, dlg, None


mom_read_fwd.register_autograd(_backward, setup_context=_setup_context)


def mom_read(
    q: torch.Tensor,
    k_bank: torch.Tensor,
    v_bank: torch.Tensor,
    top_idx: torch.Tensor,
    top_gates: torch.Tensor,
    block_size: int,
    bias_in_activation_dtype: bool = False,
) -> torch.Tensor:
    """Triton MoM read with the signature of
    :func:`laminae.primitives.mom_read.mom_read_reference`.

    ``q`` ``[B, S, H, hd]`` (hd ≤ 128), ``k_bank``/``v_bank`` ``[E·bs, H·hd]`` (one dtype
    among fp32/bf16/fp16), ``top_idx`` ``[B, S, Tk]`` integer, distinct per token,
    in [0, E), ``top_gates`` ``[B, S, Tk]``. Differentiable in q, k_bank, v_bank and
    top_gates; returns ``[B, S, H, hd]`` in ``q``'s dtype.
    """
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"Triton MoM read supports fp32/bf16/fp16 inputs, got {getattr(q, 'dtype', type(q))}")
    check_tensor("q", q, ndim=4, layout="[batch, seq, num_heads, head_dim]")
    B, S, H, hd = q.shape
    if S == 0:
        raise ShapeError(f"`q` must hold at least one token, got shape {tuple(q.shape)}")
    if hd > MAX_HEAD_DIM:
        raise ShapeError(f"Triton MoM read supports head_dim <= {MAX_HEAD_DIM}, got {hd}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ShapeError(f"`block_size` must be a positive int, got {block_size!r}")
    check_tensor("k_bank", k_bank, shape=(None, H * hd), dtypes=(q.dtype,), layout="[slots, num_heads * head_dim]")
    check_tensor("v_bank", v_bank, shape=tuple(k_bank.shape), dtypes=(q.dtype,),
                 layout="[slots, num_heads * head_dim]")
    slots = k_bank.shape[0]
    if slots == 0 or slots % block_size:
        raise ShapeError(f"bank rows ({slots}) must be a positive multiple of block_size ({block_size})")
    num_blocks = slots // block_size
    integer = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    check_tensor("top_idx", top_idx, shape=(B, S, None), dtypes=integer, layout="[batch, seq, top_blocks]")
    tk = top_idx.shape[-1]
    if not 1 <= tk <= num_blocks:
        raise ShapeError(f"`top_idx` must select 1..{num_blocks} blocks per token, got {tk}")
    check_tensor("top_gates", top_gates, shape=(B, S, tk), layout="[batch, seq, top_blocks]")
    if not torch.compiler.is_compiling():
        if bool(((top_idx < 0) | (top_idx >= num_blocks)).any()):
            raise ValueError(f"`top_idx` values must lie in [0, {num_blocks})")
        srt = top_idx.sort(dim=-1).values
        if tk > 1 and bool((srt[..., 1:] == srt[..., :-1]).any()):
            raise ValueError("`top_idx` repeats a block within a token; selected blocks must be distinct")
    lg = mom_log_gates(top_gates, q.dtype if bias_in_activation_dtype else None).float()
    o, _ = mom_read_fwd(q.contiguous(), k_bank.contiguous(), v_bank.contiguous(),
                        top_idx.to(torch.int64).contiguous(), lg.contiguous(), block_size)
    return o


# ----------------------------------------------------------------------------
# Static configurations and tour
# ----------------------------------------------------------------------------


def static_cases() -> Iterator[StaticCase]:
    """Every (dtype, padded head dim) configuration of the three kernels."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dt = triton_dtype(dtype)
        p = f"*{dt}"
        for bd, t in _TILES.items():
            tags = {"dtype": dt}
            yield StaticCase("mom_fwd", _mom_fwd_kernel,
                             dict(q_ptr=p, k_ptr=p, v_ptr=p, idx_ptr="*i64", lg_ptr="*fp32", o_ptr=p, lse_ptr="*fp32",
                                  H="i32", HD="i32", TK="i32", BS="i32", qk_scale="fp32"),
                             dict(BLOCK_N=t.token_n, BLOCK_D=bd), t.token_warps, tags=tags)
            yield StaticCase("mom_bwd_token", _mom_bwd_token_kernel,
                             dict(q_ptr=p, k_ptr=p, v_ptr=p, idx_ptr="*i64", lg_ptr="*fp32", o_ptr=p,
                                  lse_ptr="*fp32", do_ptr=p, dq_ptr=p, delta_ptr="*fp32", wc_ptr="*fp32",
                                  H="i32", HD="i32", TK="i32", BS="i32", qk_scale="fp32", sm_scale="fp32"),
                             dict(BLOCK_N=t.token_n, BLOCK_D=bd), t.token_warps, tags=tags)
            yield StaticCase("mom_bwd_bank", _mom_bwd_bank_kernel,
                             dict(q_ptr=p, k_ptr=p, v_ptr=p, do_ptr=p, lse_ptr="*fp32", delta_ptr="*fp32",
                                  pair_tok_ptr="*i64", pair_lg_ptr="*fp32", offsets_ptr="*i64", dk_ptr=p, dv_ptr=p,
                                  H="i32", HD="i32", BS="i32", qk_scale="fp32", sm_scale="fp32"),
                             dict(BLOCK_M=t.bank_m, BLOCK_N=t.bank_n, BLOCK_D=bd, PRECISION=dot_precision(dtype)),
                             t.bank_warps, tags=tags)


def tour_case(device: torch.device):
    from laminae.primitives.mom_read import mom_read_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    B, S, H, hd, E, bs, tk = 2, 16, 2, 16, 6, 8, 2
    logits = torch.randn(B, S, E, generator=gen)
    top_values, top_idx = logits.topk(tk, dim=-1)
    inputs = {
        "q": torch.randn(B, S, H, hd, generator=gen).to(device),
        "k_bank": torch.randn(E * bs, H * hd, generator=gen).to(device),
        "v_bank": torch.randn(E * bs, H * hd, generator=gen).to(device),
        "top_idx": top_idx.to(device),
        "top_gates": torch.softmax(top_values, -1).to(device),
        "block_size": bs,
    }
    return TourCase(f"mom_read (E={E}, bs={bs}, top {tk})", mom_read, mom_read_reference, inputs,
                    ["q", "k_bank", "v_bank", "top_gates"])
