"""Affine-scaled attention kernels: the toolkit's causal flash attention plus a
row-wise epilogue, through the identity

    O = α·(P·V) + (α_ma − α)·v̄          v̄_t = mean of the values visible to query t

Forward   v̄ and the visible-key count N_t by fp32 cumulative sums (torch; with a
          cache the sums include the cached keys); O_flash = P·V (fp32) and the
          log-sum-exp by ``_flash``; one row-wise kernel writes
          ``out = α·O_flash + (α_ma − α)·v̄`` in the input dtype.
Backward  one row-wise kernel reads the upstream g once and writes
            g′ = α·g                     (the flash backward's upstream),
            δ  = Σ_d g′·O_flash          (its row term),
            dα = Σ_d g·(O_flash − v̄),   dα_ma partials Σ_d g·v̄,
            w  = (α_ma − α)/N_t·g        (the v̄ path);
          the flash backward with g′ gives dq, dk, dv; the v̄ path adds to dv the
          reverse cumulative sum over queries of w, summed over the GQA group and
          masked by the key keep mask (torch).
A query with no visible key has N_t = 0: its output, v̄ and w are 0.
"""
from __future__ import annotations

from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import DTypeError, ShapeError
from laminae.primitives._validation import check_tensor

from . import _flash
from ._common import StaticCase, empty

__all__ = ["affine_scaled_attention", "affine_scaled_attention_fwd"]

ROW_BLOCK = 16
ROW_WARPS = 4


@triton.jit
def _affine_combine_kernel(of_ptr, vbar_ptr, alpha_ptr, ama_ptr, out_ptr, R, H, HKV, D,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[r] = α[r]·O_flash[r] + (α_ma[h] − α[r])·v̄[kv row of r] over rows r of [B·S·H, D]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < D)[None, :]
    h = rows % H
    kv_rows = (rows // H) * HKV + h // (H // HKV)
    a = tl.load(alpha_ptr + rows, mask=row_ok, other=0.0)
    ama = tl.load(ama_ptr + h, mask=row_ok, other=0.0)
    of = tl.load(of_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
    vbar = tl.load(vbar_ptr + kv_rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
    out = a[:, None] * of + (ama - a)[:, None] * vbar
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _affine_bwd_rows_kernel(g_ptr, of_ptr, vbar_ptr, alpha_ptr, ama_ptr, nvis_ptr,
                            gs_ptr, delta_ptr, dalpha_ptr, gvbar_ptr, w_ptr, R, S, H, HKV, D,
                            BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < D)[None, :]
    h = rows % H
    bs = rows // H                       # b·S + s
    kv_rows = bs * HKV + h // (H // HKV)
    offs = rows[:, None] * D + cols[None, :]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    of = tl.load(of_ptr + offs, mask=mask, other=0.0)
    vbar = tl.load(vbar_ptr + kv_rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
    a = tl.load(alpha_ptr + rows, mask=row_ok, other=0.0)
    ama = tl.load(ama_ptr + h, mask=row_ok, other=0.0)
    n = tl.load(nvis_ptr + bs, mask=row_ok, other=0.0)
    c = tl.where(n > 0, (ama - a) / tl.where(n > 0, n, 1.0), 0.0)
    gs = g * a[:, None]
    tl.store(gs_ptr + offs, gs.to(gs_ptr.dtype.element_ty), mask=mask)
    tl.store(w_ptr + offs, g * c[:, None], mask=mask)
    # δ in the [B, H, S] layout of the flash backward
    b = bs // S
    s = bs % S
    tl.store(delta_ptr + (b * H + h) * S + s, tl.sum(gs * of, 1), mask=row_ok)
    gv = tl.sum(g * vbar, 1)
    tl.store(dalpha_ptr + rows, tl.sum(g * of, 1) - gv, mask=row_ok)
    tl.store(gvbar_ptr + rows, gv, mask=row_ok)


def _row_grid(rows: int):
    return (triton.cdiv(rows, ROW_BLOCK),)


def _running_mean(v: torch.Tensor, key_mask: torch.Tensor | None, queries: int):
    """(v̄ ``[B, S, H_kv, D]`` fp32, N_t ``[B, S]`` fp32) for the last ``queries`` positions."""
    B, N = v.shape[0], v.shape[1]
    past = N - queries
    vf = v.float()
    if key_mask is None:
        count = torch.arange(past + 1, N + 1, device=v.device, dtype=torch.float32).expand(B, queries)
    else:
        keep = key_mask.float()
        vf = vf * keep[:, :, None, None]
        count = keep.cumsum(1)[:, past:]
    vsum = vf[:, past:].cumsum(1)
    if past:
        vsum = vsum + vf[:, :past].sum(1, keepdim=True)
    vbar = vsum / count.clamp_min(1.0)[:, :, None, None]
    return vbar.contiguous(), count.contiguous()


@triton_op("laminae::affine_scaled_attention_fwd", mutates_args=())
def affine_scaled_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, alpha_ma: torch.Tensor,
    key_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, O_flash, lse, v̄, N_t)`` for contiguous q/k/v, fp32 ``alpha`` ``[B, S, H]``
    and ``alpha_ma`` ``[H]``, and an int8 ``key_mask`` or None."""
    B, S, H, D = q.shape
    vbar, count = _running_mean(v, key_mask, S)
    o_flash, lse = _flash.flash_forward(q, k, v, key_mask, out_dtype=torch.float32)
    out = empty(q.shape, dtype=q.dtype, device=q.device)
    rows = B * S * H
    wrap_triton(_affine_combine_kernel)[_row_grid(rows)](
        o_flash, vbar, alpha, alpha_ma, out, rows, H, k.shape[2], D,
        BLOCK_R=ROW_BLOCK, BLOCK_D=_flash.block_d(D), num_warps=ROW_WARPS,
    )
    return out, o_flash, lse, vbar, count


@triton_op("laminae::affine_scaled_attention_bwd", mutates_args=())
def _affine_scaled_attention_bwd(
    g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor,
    alpha_ma: torch.Tensor, key_mask: torch.Tensor | None, o_flash: torch.Tensor, lse: torch.Tensor,
    vbar: torch.Tensor, count: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, S, H, D = q.shape
    N, HKV = k.shape[1], k.shape[2]
    rows = B * S * H
    g_scaled = empty(q.shape, dtype=q.dtype, device=q.device)
    w = empty(q.shape, dtype=torch.float32, device=q.device)
    delta = empty((B, H, S), dtype=torch.float32, device=q.device)
    dalpha = empty((B, S, H), dtype=torch.float32, device=q.device)
    g_vbar = empty((B, S, H), dtype=torch.float32, device=q.device)
    wrap_triton(_affine_bwd_rows_kernel)[_row_grid(rows)](
        g, o_flash, vbar, alpha, alpha_ma, count, g_scaled, delta, dalpha, g_vbar, w, rows, S, H, HKV, D,
        BLOCK_R=ROW_BLOCK, BLOCK_D=_flash.block_d(D), num_warps=ROW_WARPS,
    )
    dq, dk, dv = _flash.flash_backward(q, k, v, key_mask, g_scaled, lse, delta)
    # v̄ path: key j gets Σ over the queries t that see it of (α_ma − α_t)/N_t·g_t, summed
    # over the heads of its kv group: a reverse cumulative sum over t, read at the first
    # query that sees j (t = j − (N − S), or 0 for cached keys).
    w_kv = w.view(B, S, HKV, H // HKV, D).sum(3)
    suffix = w_kv.flip(1).cumsum(1).flip(1)
    first_query = (torch.arange(N, device=q.device) - (N - S)).clamp_min(0)
    dv_mean = suffix[:, first_query]
    if key_mask is not None:
        dv_mean = dv_mean * key_mask.float()[:, :, None, None]
    dv = (dv.float() + dv_mean).to(v.dtype)
    dalpha_ma = g_vbar.sum(dim=(0, 1))
    return dq, dk, dv, dalpha, dalpha_ma


def _setup_context(ctx, inputs, output):
    q, k, v, alpha, alpha_ma, key_mask = inputs
    _, o_flash, lse, vbar, count = output
    ctx.save_for_backward(q, k, v, alpha, alpha_ma, key_mask, o_flash, lse, vbar, count)


def _backward(ctx, g, *_unused):
    q, k, v, alpha, alpha_ma, key_mask, o_flash, lse, vbar, count = ctx.saved_tensors
    dq, dk, dv, dalpha, dalpha_ma = _affine_scaled_attention_bwd(
        g.contiguous(), q, k, v, alpha, alpha_ma, key_mask, o_flash, lse, vbar, count)
    return dq, dk, dv, dalpha, dalpha_ma, None


affine_scaled_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def affine_scaled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    alpha_ma: torch.Tensor,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton affine-scaled attention with the signature of
    :func:`laminae.primitives.affine_scaled_attention.affine_scaled_attention_reference`.

    ``q`` ``[B, S, H, D]``, ``k``/``v`` ``[B, N, H_kv, D]`` (fp32/bf16/fp16, one dtype,
    ``N ≥ S``, ``D ≤ 256``), ``alpha`` ``[B, S, H]``, ``alpha_ma`` ``[H]``, ``key_mask``
    ``(B, N)``. Differentiable in q, k, v, alpha and alpha_ma; returns ``[B, S, H, D]``
    in the dtype of ``q``.
    """
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise DTypeError(f"Triton affine-scaled attention supports fp32/bf16/fp16 inputs, got {q.dtype}")
    check_tensor("q", q, ndim=4, layout="[batch, seq, num_heads, head_dim]")
    B, S, H, D = q.shape
    check_tensor("k", k, shape=(B, None, None, D), dtypes=(q.dtype,), layout="[batch, keys, num_kv_heads, head_dim]")
    check_tensor("v", v, shape=tuple(k.shape), dtypes=(q.dtype,), layout="[batch, keys, num_kv_heads, head_dim]")
    check_tensor("alpha", alpha, shape=(B, S, H), layout="[batch, seq, num_heads]")
    check_tensor("alpha_ma", alpha_ma, shape=(H,), layout="[num_heads]")
    if key_mask is not None:
        check_tensor("key_mask", key_mask, shape=(B, k.shape[1]), dtypes=None, layout="(batch, keys)")
    if S == 0:
        raise ShapeError(f"`q` must hold at least one query position, got shape {tuple(q.shape)}")
    _flash._check_dims(q, k)
    out, *_ = affine_scaled_attention_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), alpha.float().contiguous(),
        alpha_ma.float().contiguous(), _flash.mask_arg(key_mask))
    return out


def static_cases() -> Iterator[StaticCase]:
    """The row kernels at each padded head dim and dtype, plus every flash configuration
    (with the fp32 O_flash the epilogue reads)."""
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        for bd in (16, 32, 64, 128, 256):
            const = dict(BLOCK_R=ROW_BLOCK, BLOCK_D=bd)
            yield StaticCase("affine_combine", _affine_combine_kernel,
                             dict(of_ptr="*fp32", vbar_ptr="*fp32", alpha_ptr="*fp32", ama_ptr="*fp32", out_ptr=p,
                                  R="i32", H="i32", HKV="i32", D="i32"), const, ROW_WARPS, tags={"dtype": dt})
            yield StaticCase("affine_bwd_rows", _affine_bwd_rows_kernel,
                             dict(g_ptr=p, of_ptr="*fp32", vbar_ptr="*fp32", alpha_ptr="*fp32", ama_ptr="*fp32",
                                  nvis_ptr="*fp32", gs_ptr=p, delta_ptr="*fp32", dalpha_ptr="*fp32",
                                  gvbar_ptr="*fp32", w_ptr="*fp32", R="i32", S="i32", H="i32", HKV="i32", D="i32"),
                             const, ROW_WARPS, tags={"dtype": dt})
    yield from _flash.static_cases(out_dtypes=("fp32",))


def tour_case(device: torch.device):
    from laminae.primitives.affine_scaled_attention import affine_scaled_attention_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    B, S, H, HKV, D = 2, 64, 4, 2, 32
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, :5] = False      # left padding
    keep[1, -9:] = False     # right padding
    keep[1, 20:23] = False   # a hole
    inputs = {
        "q": torch.randn(B, S, H, D, generator=gen).to(device),
        "k": torch.randn(B, S, HKV, D, generator=gen).to(device),
        "v": torch.randn(B, S, HKV, D, generator=gen).to(device),
        "alpha": torch.rand(B, S, H, generator=gen).to(device),
        "alpha_ma": torch.rand(H, generator=gen).to(device),
        "key_mask": keep.to(device),
    }
    return TourCase("affine_scaled_attention (GQA 4/2, ragged mask)", affine_scaled_attention,
                    affine_scaled_attention_reference, inputs, ["q", "k", "v", "alpha"])
