"""Spelling Bee kernels: fused gather–rotate–average forward, deterministic sorted-segment backward.

Forward ``_bee_fwd_kernel``, grid (N/BLOCK_T, (d/2)/BLOCK_J): each program takes BLOCK_T
tokens and BLOCK_J rotary pairs (columns j and j + d/2). For each of the 16 slots it
loads the tokens' byte codes from ``byte_ids[id]``, gathers the two halves of those
``byte_embed`` rows, rotates them with the slot's cos/sin (a [16, d/2] fp32 table) and
accumulates in fp32; then writes ½·(e_tok + s), with s = NaN for an id outside [0, V)
(the tables are never read at such an id). Memory-bound: ``byte_embed`` is 256
rows and stays in L2, so the traffic is ids, e_tok and the output.

Backward: d byte_embed[c] = ½·Σ_{n,i: code(n,i)=c} w(n,i)·R_{−p_i}·g_n is a segmented sum
of N·16 rotated gradient rows into 256 rows. Scattering them with atomics is a contention
hot spot (byte 0, common letters) and not reproducible in fp32; a dense 256-way indicator
matmul costs 2·256·16·N·d FLOPs for it. Instead (the sorted-segments idea of Engram's
table gradient, here with 256 long segments rather than many short ones) torch sorts each
token slice's (token, slot) entries by byte (int16 keys, stable, static shapes:
``_sorted_entries``) and ``_bee_bwd_kernel``, grid (slices, parts, (d/2)/BLOCK_J), walks
one part of a slice — a run of whole bytes — in chunks of BLOCK_E entries: gathers the
gradient rows, rotates them back with the slot's cos/sin, and sums each byte in sorted
order (a chunk inside one byte's run is one masked sum; a chunk with several bytes takes
one step per byte), then stores each byte's row once. Every row of a slice's fp32
partial [slices, 256, d] is written by one program at most (the rest stay zero); torch
sums the slices in a fixed order. The result is bitwise reproducible. Entries that add
nothing are never read: ids outside [0, V), zero-weight pads (modes 1 and 2), and in
mode 0 a token's trailing run of byte-0 slots becomes one entry whose rotation is the
run's summed cos/sin. About 10 FLOPs per live entry and column instead of 512; bytes:
each live entry's gradient row from L2, the sort, and the partials (docs/mechanisms).

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

from ._common import StaticCase, empty, triton_dtype

__all__ = ["spelling_bee", "spelling_bee_op"]

FWD_BLOCK_T, FWD_BLOCK_J, FWD_WARPS = 32, 64, 8
# Backward: sorted (token, slot) entries per step × rotary pairs per program
BWD_BLOCK_E, BWD_BLOCK_J, BWD_WARPS = 64, 32, 4
# tokens per backward slice: each slice is sorted on its own (int16 byte keys) and writes
# one [256, d] fp32 partial, summed in torch
BWD_ROWS_PER_SLICE = 8192
# programs per slice and column block, each a run of whole bytes: enough programs in flight
# to hide the latency of the dependent gathers, none for tiny inputs
BWD_PARTS, BWD_ENTRIES_PER_PART = 16, 2048
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
def _bee_bwd_kernel(g_ptr, order_ptr, keys_ptr, bounds_ptr, tail_ptr, weight_ptr, cos_ptr, sin_ptr, part_ptr,
                    HALF, entries_per_slice, parts, MODE: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_J: tl.constexpr):
    """One part of a token slice × BLOCK_J rotary pairs: a run of whole bytes of the slice's
    (token, slot) entries sorted by byte, summed byte by byte in sorted order (a segmented
    sum; no atomics, fixed order). Each byte is stored once, when the walk leaves it."""
    pid_s = tl.program_id(0)
    pid_p = tl.program_id(1)
    pid_j = tl.program_id(2)
    cols = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    col_mask = cols < HALF
    d = 2 * HALF
    first = tl.load(bounds_ptr + pid_s * (parts + 1) + pid_p)
    live_end = tl.load(bounds_ptr + pid_s * (parts + 1) + pid_p + 1)
    slice_base = pid_s.to(tl.int64) * entries_per_slice  # positions in the slice, entries global
    keys_ptr += slice_base
    order_ptr += slice_base
    part = part_ptr + pid_s.to(tl.int64) * 256 * d
    scale = 0.5 if MODE == 2 else 0.5 / 16
    row = -1                                            # the byte being summed
    acc_lo = tl.zeros([BLOCK_J], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_J], dtype=tl.float32)
    for e0 in range(first, live_end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        in_range = e < live_end
        key = tl.load(keys_ptr + e, mask=in_range, other=256).to(tl.int32)
        entry = slice_base + tl.load(order_ptr + e, mask=in_range, other=0)
        tok = entry // 16
        slot = (entry % 16).to(tl.int32)
        if MODE == 0:
            # the first slot of a token's trailing run of byte-0 slots stands for the whole run:
            # its rotation is the run's summed cos/sin (rows 16 + slot of the tables)
            tail = tl.load(tail_ptr + tok, mask=in_range, other=16)
            slot = tl.where(slot < tail, slot, 16 + slot)
        m2 = in_range[:, None] & col_mask[None, :]
        c = tl.load(cos_ptr + slot[:, None] * HALF + cols[None, :], mask=m2, other=0.0)
        s = tl.load(sin_ptr + slot[:, None] * HALF + cols[None, :], mask=m2, other=0.0)
        g_row = g_ptr + tok[:, None] * d + cols[None, :]
        g_lo = tl.load(g_row, mask=m2, other=0.0).to(tl.float32)
        g_hi = tl.load(g_row + HALF, mask=m2, other=0.0).to(tl.float32)
        # R_{-p}: (x, y) -> (x·cos + y·sin, y·cos − x·sin)
        v_lo = g_lo * c + g_hi * s
        v_hi = g_hi * c - g_lo * s
        if MODE == 2:
            w = tl.load(weight_ptr + tok, mask=in_range, other=0.0)[:, None]
            v_lo = v_lo * w
            v_hi = v_hi * w
        # the chunk's bytes in increasing order; a chunk inside one long byte run takes one step
        k = tl.min(key, axis=0)
        k_last = tl.max(tl.where(in_range, key, -1), axis=0)
        while k <= k_last:
            hit = (key == k)[:, None]
            p_lo = tl.sum(tl.where(hit, v_lo, 0.0), axis=0)
            p_hi = tl.sum(tl.where(hit, v_hi, 0.0), axis=0)
            if k > row:
                # the walk left byte `row`: its sum is complete (stores inline: the
                # interpreter pays for every nested @triton.jit call)
                if row >= 0:
                    tl.store(part + row * d + cols, acc_lo * scale, mask=col_mask)
                    tl.store(part + row * d + HALF + cols, acc_hi * scale, mask=col_mask)
                row = k
                acc_lo = p_lo
                acc_hi = p_hi
            else:
                acc_lo += p_lo
                acc_hi += p_hi
            k = tl.min(tl.where(key > k, key, 256), axis=0)
    if row >= 0:
        tl.store(part + row * d + cols, acc_lo * scale, mask=col_mask)
        tl.store(part + row * d + HALF + cols, acc_hi * scale, mask=col_mask)


def _block_j(half: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(half)))


def bwd_config(dtype: str) -> tuple[dict, int, int]:
    """(constexprs without MODE, num_warps, num_stages) of ``_bee_bwd_kernel``: the launch,
    the static cases and the tests select through this function. One configuration for
    every dtype and width: BLOCK_E sorted entries × BLOCK_J pairs (a 32-pair half row is
    two 32-byte sectors in 16-bit, four in fp32)."""
    return dict(BLOCK_E=BWD_BLOCK_E, BLOCK_J=BWD_BLOCK_J), BWD_WARPS, 2


def bwd_parts(n: int) -> int:
    """Programs per slice (and column block): one per BWD_ENTRIES_PER_PART entry slots of a
    slice, at most BWD_PARTS (a runtime argument, not a compiled configuration)."""
    return max(1, min(BWD_PARTS, min(n, BWD_ROWS_PER_SLICE) * SLOTS // BWD_ENTRIES_PER_PART))


def _sorted_entries(ids: torch.Tensor, byte_ids: torch.Tensor, byte_len: torch.Tensor, mode_code: int,
                    rows_per_slice: int, parts: int):
    """The (token, slot) entries of the byte-table gradient, sorted by byte within each token
    slice of ``rows_per_slice`` tokens.

    A slice's keys are its entries' bytes (int16, so the radix sort has two passes), or 256
    for an entry that adds nothing (an id outside [0, V); a zero-weight pad in modes 1 and 2;
    in mode 0 the byte-0 slots of a token's trailing run after its first; the padding of
    the last slice): those sort to the end and are never read. A stable sort keeps each
    byte's entries in token order, so the sum has one fixed order. Each slice's live
    entries are cut into ``parts`` runs of whole bytes of about equal length (a byte never
    straddles two). Returns, per slice [slices, rows_per_slice·16]: the sorted keys and the
    positions in the slice they came from; the part bounds [slices, parts + 1]; the
    per-token tail (mode 0: first slot of the trailing byte-0 run) and weight (mode 2: 1/√n)."""
    n = ids.numel()
    vocab = byte_ids.shape[0]
    valid = (ids >= 0) & (ids < vocab)
    tok = torch.where(valid, ids, 0)
    codes = byte_ids[tok].to(torch.int16)                                   # [N, 16]
    slot = torch.arange(SLOTS, device=ids.device)
    tail = weight = None
    if mode_code == 0:
        tail = ((codes != 0) * (slot + 1)).amax(-1).to(torch.int32)
        live = slot <= tail[:, None]
    else:
        n_real = byte_len[tok].to(torch.int32)
        live = slot < n_real[:, None]
        if mode_code == 2:
            weight = torch.rsqrt(n_real.clamp_min(1).to(torch.float32))
    keys = torch.where(live & valid[:, None], codes, 256).to(torch.int16)
    slices = triton.cdiv(n, rows_per_slice)
    keys = torch.nn.functional.pad(keys, (0, 0, 0, slices * rows_per_slice - n), value=256)
    sorted_keys, order = torch.sort(keys.view(slices, rows_per_slice * SLOTS), dim=1, stable=True)
    live_end = torch.searchsorted(sorted_keys, torch.full((slices, 1), 256, dtype=torch.int16, device=ids.device))
    per_part = rows_per_slice * SLOTS // parts
    nominal = torch.minimum(torch.arange(parts, device=ids.device) * per_part, live_end)
    # each part starts at the first entry of the byte under its nominal start
    first_of_byte = torch.searchsorted(sorted_keys, sorted_keys.gather(1, nominal.clamp_max(sorted_keys.shape[1] - 1)))
    bounds = torch.cat([torch.where(nominal < live_end, first_of_byte, live_end), live_end], dim=1)
    return sorted_keys, order, bounds.contiguous(), tail, weight


def _rotation_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[32, d/2]: the 16 slot rotations, then their suffix sums Σ_{i' ≥ i} (summed in fp64,
    rounded once) for mode 0's trailing byte-0 runs."""
    def suffix(t):
        return torch.flip(torch.cumsum(torch.flip(t.double(), [0]), 0), [0]).to(t.dtype)

    return torch.cat([cos, suffix(cos)]).contiguous(), torch.cat([sin, suffix(sin)]).contiguous()


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
    if n == 0:
        return torch.zeros((256, d), dtype=torch.float32, device=g.device)
    const, warps, stages = bwd_config(triton_dtype(g.dtype))
    parts = bwd_parts(n)
    keys, order, bounds, tail, weight = _sorted_entries(ids, byte_ids, byte_len, mode_code, BWD_ROWS_PER_SLICE,
                                                        parts)
    cos2, sin2 = _rotation_tables(cos, sin)
    slices = bounds.shape[0]
    # rows of bytes a slice never saw stay zero
    partials = torch.zeros((slices, 256, d), dtype=torch.float32, device=g.device)
    # a mode's unused per-token table is never read; a tensor of its type stands in for it
    if tail is None:
        tail = torch.zeros(1, dtype=torch.int32, device=g.device)
    wrap_triton(_bee_bwd_kernel)[(slices, parts, triton.cdiv(half, const["BLOCK_J"]))](
        g, order, keys, bounds, tail, cos2 if weight is None else weight,
        cos2, sin2, partials, half, BWD_ROWS_PER_SLICE * SLOTS, parts, MODE=mode_code, **const,
        num_warps=warps, num_stages=stages,
    )
    return partials[0] if slices == 1 else partials.sum(0)


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
    """Every pointer compiles 16-byte aligned (``divisible``), as Triton's launcher
    specialises it: the ids, embeddings and byte tables arrive contiguous (converted
    copies where they were not), the rotation and sort tables, the partials and the
    output are fresh. HALF (d/2) is not declared: the configurations serve every d."""
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        for mode in (0, 1, 2):
            for block_j in (16, 32, 64):
                yield StaticCase("bee_fwd", _bee_fwd_kernel,
                                 dict(ids_ptr="*i64", etok_ptr=p, emb_ptr=p, bytes_ptr="*i16", len_ptr="*i16",
                                      cos_ptr="*fp32", sin_ptr="*fp32", out_ptr=p, N="i32", V="i32", HALF="i32"),
                                 dict(SLOTS=SLOTS, MODE=mode, BLOCK_T=FWD_BLOCK_T, BLOCK_J=block_j), FWD_WARPS,
                                 tags={"dtype": dt}, divisible=("ids_ptr", "etok_ptr", "emb_ptr", "bytes_ptr", "len_ptr",
                                                                "cos_ptr", "sin_ptr", "out_ptr"))
            const, warps, stages = bwd_config(dt)
            # a gather and a segmented sum: no tl.dot, so no tensor-core instruction to expect
            yield StaticCase("bee_bwd", _bee_bwd_kernel,
                             dict(g_ptr=p, order_ptr="*i64", keys_ptr="*i16", bounds_ptr="*i64", tail_ptr="*i32",
                                  weight_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", part_ptr="*fp32",
                                  HALF="i32", entries_per_slice="i32", parts="i32"),
                             dict(MODE=mode, **const), warps, stages, tags={"dtype": dt},
                             divisible=("g_ptr", "order_ptr", "keys_ptr", "bounds_ptr", "tail_ptr", "weight_ptr", "cos_ptr",
                                        "sin_ptr", "part_ptr", "entries_per_slice"))


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
