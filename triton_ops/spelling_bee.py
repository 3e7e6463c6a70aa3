"""Spelling Bee kernels: fused gather–rotate–average forward, deterministic scatter backward.

Forward ``_bee_fwd_kernel``, grid (N/BLOCK_T, (d/2)/BLOCK_J): each program takes BLOCK_T
tokens and BLOCK_J rotary pairs (columns j and j + d/2). For each of the 16 slots it
loads the tokens' byte codes from ``byte_ids[id]``, gathers the two halves of those
``byte_embed`` rows, rotates them with the slot's cos/sin (a [16, d/2] fp32 table) and
accumulates in fp32; then writes ½·(e_tok + s), with s = NaN for an id outside [0, V)
(the tables are never read at such an id). Memory-bound: ``byte_embed`` is 256
rows and stays in L2, so the traffic is ids, e_tok and the output.

Backward ``_bee_bwd_kernel``: d byte_embed[c] = ½·Σ_{n,i: code(n,i)=c} w(n,i)·R_{−p_i}·g_n.
Instead of scattering N·16 rows into 256 rows with atomics (a contention hot spot on
byte 0 and common letters, and not deterministic in fp32), each program owns a block
of BLOCK_C byte values × BLOCK_J pairs and a slice of the tokens, and reduces with
tensor-core matmuls: for a chunk of BLOCK_N tokens and slot i it builds, in registers
only, the [BLOCK_C, BLOCK_N] indicator (code(n, i) == c)·w(n, i) and multiplies it with
the rotated-back gradient chunk R_{−p_i}·g ([BLOCK_N, BLOCK_J] per half). Each output
element is owned by exactly one program per token slice; the slices' fp32 partials
[S, 256, d] are summed in torch in a fixed order. The result is bitwise reproducible.
The matmul does 2·256·16·N·d FLOPs (69 GFLOP at N = 16k, d = 512: tensor-core work
for bf16); no sort, no data-dependent shape, no host sync.

``d e_tok = ½·g`` is a scale left to torch (also for out-of-range ids: their NaN comes from
s, which adds nothing to the byte table's gradient). Saved for backward: nothing but the ids
(the byte table, lengths and rotary table are buffers or recomputed).
"""
from __future__ import annotations

from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import ConfigError, DTypeError
from laminae.primitives.spelling_bee import MODES, PAD_MODES, SLOTS, spelling_bee_rotary

from ._common import StaticCase, dot_precision, empty, triton_dtype

__all__ = ["spelling_bee", "spelling_bee_op"]

FWD_BLOCK_T, FWD_BLOCK_J, FWD_WARPS = 32, 64, 8
BWD_BLOCK_C, BWD_BLOCK_J = 64, 64
# tokens per tl.dot step (the K dimension): 64 on bf16/fp16 tensor cores; fp32 products
# in "ieee" precision run on the FMA units, where a 64-deep step spills registers (sm_90)
BWD_BLOCK_N = {"fp32": 16, "bf16": 64, "fp16": 64}
# tokens per backward program slice: enough work per program, enough programs per GPU
BWD_ROWS_PER_SLICE = 2048
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _mode_code(pad_mode: str, mode: str) -> int:
    """0: fixed mean with embedded pads; 1: fixed mean, zero pads; 2: 1/√n over real bytes."""
    if mode == "masked_sqrt":
        return 2
    return 1 if pad_mode == "zero" else 0


@triton.jit
def _slot_weight(n_real, slot, SLOTS: tl.constexpr, MODE: tl.constexpr):
    """Weight of one slot for a block of tokens with ``n_real`` real bytes (fp32)."""
    if MODE == 0:
        w = tl.full(n_real.shape, 1.0 / SLOTS, tl.float32)
    elif MODE == 1:
        w = tl.where(slot < n_real, 1.0 / SLOTS, 0.0)
    else:
        w = tl.where(slot < n_real, tl.rsqrt(tl.maximum(n_real, 1.0)), 0.0)
    return w


@triton.jit
def _bee_fwd_kernel(ids_ptr, etok_ptr, emb_ptr, bytes_ptr, len_ptr, cos_ptr, sin_ptr, out_ptr, N, V, HALF,
                    SLOTS: tl.constexpr, MODE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    col_mask = cols < HALF
    tok = tl.load(ids_ptr + rows, mask=rows < N, other=0).to(tl.int64)
    # out-of-range ids (possible when the id check is off) read nothing and get s = NaN below
    in_vocab = (tok >= 0) & (tok < V)
    valid = (rows < N) & in_vocab
    n_real = tl.load(len_ptr + tok, mask=valid, other=0).to(tl.float32)
    mask = valid[:, None] & col_mask[None, :]
    d = 2 * HALF
    acc_lo = tl.zeros((BLOCK_T, BLOCK_J), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_T, BLOCK_J), dtype=tl.float32)
    for slot in range(SLOTS):
        code = tl.load(bytes_ptr + tok * SLOTS + slot, mask=valid, other=0).to(tl.int64)
        row_ptr = emb_ptr + code[:, None] * d + cols[None, :]
        u_lo = tl.load(row_ptr, mask=mask, other=0.0).to(tl.float32)
        u_hi = tl.load(row_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + slot * HALF + cols, mask=col_mask, other=0.0)[None, :]
        s = tl.load(sin_ptr + slot * HALF + cols, mask=col_mask, other=0.0)[None, :]
        w = _slot_weight(n_real, slot, SLOTS, MODE)[:, None]
        acc_lo += w * (u_lo * c - u_hi * s)
        acc_hi += w * (u_hi * c + u_lo * s)
    acc_lo = tl.where(in_vocab[:, None], acc_lo, float("nan"))
    acc_hi = tl.where(in_vocab[:, None], acc_hi, float("nan"))
    out_mask = (rows < N)[:, None] & col_mask[None, :]
    offs = rows[:, None] * d + cols[None, :]
    e_lo = tl.load(etok_ptr + offs, mask=out_mask, other=0.0).to(tl.float32)
    e_hi = tl.load(etok_ptr + offs + HALF, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (0.5 * (e_lo + acc_lo)).to(out_ptr.dtype.element_ty), mask=out_mask)
    tl.store(out_ptr + offs + HALF, (0.5 * (e_hi + acc_hi)).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _bee_bwd_kernel(ids_ptr, g_ptr, bytes_ptr, len_ptr, cos_ptr, sin_ptr, part_ptr, N, V, HALF, rows_per_slice,
                    SLOTS: tl.constexpr, MODE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_J: tl.constexpr, PRECISION: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_j = tl.program_id(1)
    pid_s = tl.program_id(2)
    byte_vals = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    col_mask = cols < HALF
    d = 2 * HALF
    start = pid_s * rows_per_slice
    end = tl.minimum(start + rows_per_slice, N)
    acc_lo = tl.zeros((BLOCK_C, BLOCK_J), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_C, BLOCK_J), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        tok = tl.load(ids_ptr + rows, mask=rows < end, other=0).to(tl.int64)
        valid = (rows < end) & (tok >= 0) & (tok < V)
        n_real = tl.load(len_ptr + tok, mask=valid, other=0).to(tl.float32)
        gmask = valid[:, None] & col_mask[None, :]
        offs = rows[:, None] * d + cols[None, :]
        g_lo = tl.load(g_ptr + offs, mask=gmask, other=0.0).to(tl.float32)
        g_hi = tl.load(g_ptr + offs + HALF, mask=gmask, other=0.0).to(tl.float32)
        for slot in range(SLOTS):
            # code -1 for masked tokens never equals a byte value
            code = tl.load(bytes_ptr + tok * SLOTS + slot, mask=valid, other=-1).to(tl.int32)
            w = _slot_weight(n_real, slot, SLOTS, MODE)
            hit = code[None, :] == byte_vals[:, None]
            if MODE == 0:
                # constant weight: an exact 0/1 indicator, the 1/16 is applied once at the end
                ind = tl.where(hit, 1.0, 0.0)
            else:
                ind = tl.where(hit, w[None, :], 0.0)
            c = tl.load(cos_ptr + slot * HALF + cols, mask=col_mask, other=0.0)[None, :]
            s = tl.load(sin_ptr + slot * HALF + cols, mask=col_mask, other=0.0)[None, :]
            # R_{-p}: (x, y) -> (x·cos + y·sin, y·cos − x·sin)
            r_lo = (g_lo * c + g_hi * s).to(g_ptr.dtype.element_ty)
            r_hi = (g_hi * c - g_lo * s).to(g_ptr.dtype.element_ty)
            ind = ind.to(g_ptr.dtype.element_ty)
            acc_lo += tl.dot(ind, r_lo, input_precision=PRECISION)
            acc_hi += tl.dot(ind, r_hi, input_precision=PRECISION)
    scale = 0.5 / SLOTS if MODE == 0 else 0.5
    pmask = (byte_vals < 256)[:, None] & col_mask[None, :]
    poffs = pid_s.to(tl.int64) * 256 * d + byte_vals[:, None] * d + cols[None, :]
    tl.store(part_ptr + poffs, acc_lo * scale, mask=pmask)
    tl.store(part_ptr + poffs + HALF, acc_hi * scale, mask=pmask)


def bwd_warps(dtype: str, block_j: int) -> int:
    # fp32 at 32 pairs: ptxas caps 8 warps at 128 registers and spills; 4 warps fit in 167
    return 4 if dtype == "fp32" and block_j == 32 else 8


def _block_j(half: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(half)))


@triton_op("laminae::spelling_bee", mutates_args=())
def spelling_bee_op(ids: torch.Tensor, e_tok: torch.Tensor, byte_embed: torch.Tensor, byte_ids: torch.Tensor,
                    byte_len: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode_code: int) -> torch.Tensor:
    """ids [N] int, e_tok [N, d], byte_embed [256, d] (e_tok's dtype) → [N, d]."""
    n, d = e_tok.shape
    half = d // 2
    out = empty((n, d), dtype=e_tok.dtype, device=e_tok.device)
    block_j = _block_j(half, FWD_BLOCK_J)
    wrap_triton(_bee_fwd_kernel)[(triton.cdiv(n, FWD_BLOCK_T), triton.cdiv(half, block_j))](
        ids, e_tok, byte_embed, byte_ids, byte_len, cos, sin, out, n, byte_ids.shape[0], half,
        SLOTS=SLOTS, MODE=mode_code, BLOCK_T=FWD_BLOCK_T, BLOCK_J=block_j, num_warps=FWD_WARPS,
    )
    return out


@triton_op("laminae::spelling_bee_bwd", mutates_args=())
def _spelling_bee_bwd(g: torch.Tensor, ids: torch.Tensor, byte_ids: torch.Tensor, byte_len: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, mode_code: int) -> torch.Tensor:
    n, d = g.shape
    half = d // 2
    block_j = _block_j(half, BWD_BLOCK_J)
    slices = max(1, triton.cdiv(n, BWD_ROWS_PER_SLICE))
    block_n = BWD_BLOCK_N[triton_dtype(g.dtype)]
    partials = empty((slices, 256, d), dtype=torch.float32, device=g.device)
    wrap_triton(_bee_bwd_kernel)[(triton.cdiv(256, BWD_BLOCK_C), triton.cdiv(half, block_j), slices)](
        ids, g, byte_ids, byte_len, cos, sin, partials, n, byte_ids.shape[0], half, BWD_ROWS_PER_SLICE,
        SLOTS=SLOTS, MODE=mode_code, BLOCK_C=BWD_BLOCK_C, BLOCK_N=block_n, BLOCK_J=block_j,
        PRECISION=dot_precision(g.dtype), num_warps=bwd_warps(triton_dtype(g.dtype), block_j),
    )
    return partials.sum(0)


def _setup_context(ctx, inputs, output):
    ids, e_tok, byte_embed, byte_ids, byte_len, cos, sin, mode_code = inputs
    ctx.save_for_backward(ids, byte_ids, byte_len, cos, sin)
    ctx.mode_code = mode_code
    ctx.embed_dtype = byte_embed.dtype


def _backward(ctx, g):
    ids, byte_ids, byte_len, cos, sin = ctx.saved_tensors
    g = g.contiguous()
    d_embed = _spelling_bee_bwd(g, ids, byte_ids, byte_len, cos, sin, ctx.mode_code).to(ctx.embed_dtype)
    return None, 0.5 * g, d_embed, None, None, None, None, None


spelling_bee_op.register_autograd(_backward, setup_context=_setup_context)


def spelling_bee(
    input_ids: torch.Tensor,
    token_embeddings: torch.Tensor,
    byte_embed: torch.Tensor,
    byte_ids: torch.Tensor,
    byte_len: torch.Tensor,
    *,
    rope_theta: float = 10000.0,
    byte_position_offset: int = 0,
    pad_mode: str = "embed",
    mode: str = "mean",
) -> torch.Tensor:
    """Triton Spelling Bee with the signature of
    :func:`laminae.primitives.spelling_bee.spelling_bee_reference`.

    ``input_ids`` [...] int32/int64, ``token_embeddings`` [..., d] fp32/bf16/fp16 (d even),
    ``byte_embed`` [256, d], ``byte_ids`` [V, 16], ``byte_len`` [V]. Returns [..., d] in
    token_embeddings' dtype.
    """
    ids, e_tok = input_ids, token_embeddings
    if e_tok.dtype not in _KERNEL_DTYPES:
        raise DTypeError(f"Triton Spelling Bee supports fp32/bf16/fp16 e_tok, got {e_tok.dtype}")
    if pad_mode not in PAD_MODES or mode not in MODES:
        raise ConfigError(f"`pad_mode` must be in {PAD_MODES} and `mode` in {MODES}, got {pad_mode!r}, {mode!r}")
    d = e_tok.shape[-1]
    if d % 2 or byte_embed.shape != (256, d):
        raise ConfigError(f"`byte_embed` must be [256, d] with d even, got {tuple(byte_embed.shape)} for d={d}")
    cos, sin = spelling_bee_rotary(d, rope_theta, byte_position_offset, SLOTS, e_tok.device)
    # one kernel specialisation per activation dtype: int64 ids, int16 byte tables
    out = spelling_bee_op(ids.reshape(-1).to(torch.int64).contiguous(), e_tok.reshape(-1, d).contiguous(),
                          byte_embed.to(e_tok.dtype).contiguous(), byte_ids.to(torch.int16).contiguous(),
                          byte_len.to(torch.int16).contiguous(), cos, sin, _mode_code(pad_mode, mode))
    return out.view(e_tok.shape)


def static_cases() -> Iterator[StaticCase]:
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        for mode in (0, 1, 2):
            for block_j in (16, 32, 64):
                yield StaticCase("bee_fwd", _bee_fwd_kernel,
                                 dict(ids_ptr="*i64", etok_ptr=p, emb_ptr=p, bytes_ptr="*i16", len_ptr="*i16",
                                      cos_ptr="*fp32", sin_ptr="*fp32", out_ptr=p, N="i32", V="i32", HALF="i32"),
                                 dict(SLOTS=SLOTS, MODE=mode, BLOCK_T=FWD_BLOCK_T, BLOCK_J=block_j), FWD_WARPS,
                                 tags={"dtype": dt})
                yield StaticCase("bee_bwd", _bee_bwd_kernel,
                                 dict(ids_ptr="*i64", g_ptr=p, bytes_ptr="*i16", len_ptr="*i16", cos_ptr="*fp32",
                                      sin_ptr="*fp32", part_ptr="*fp32", N="i32", V="i32", HALF="i32",
                                      rows_per_slice="i32"),
                                 dict(SLOTS=SLOTS, MODE=mode, BLOCK_C=BWD_BLOCK_C, BLOCK_N=BWD_BLOCK_N[dt],
                                      BLOCK_J=block_j, PRECISION="ieee" if dt == "fp32" else "tf32"),
                                 bwd_warps(dt, block_j), tags={"dtype": dt})


def tour_case(device: torch.device):
    from laminae.primitives.spelling_bee import byte_table_from_strings, spelling_bee_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    vocab, d, rows = 300, 128, 2 * 64
    words = [bytes(torch.randint(0, 256, (int(k),), generator=gen).tolist())
             for k in torch.randint(0, 20, (vocab,), generator=gen)]
    byte_ids, byte_len = byte_table_from_strings(words)
    inputs = {
        "input_ids": torch.randint(0, vocab, (rows,), generator=gen).to(device),
        "token_embeddings": torch.randn(rows, d, generator=gen).to(device),
        "byte_embed": (0.5 * torch.randn(256, d, generator=gen)).to(device),
        "byte_ids": byte_ids.to(device),
        "byte_len": byte_len.to(device),
    }
    return TourCase("spelling_bee (V=300, d=128)", spelling_bee, spelling_bee_reference, inputs,
                    ["token_embeddings", "byte_embed"])
