"""Engram kernels: the fused n-gram hash + table gather, its table-gradient reduction,
and the fused agreement gate of the layer fusion.

Lookup forward (``_engram_fwd_kernel``), one program per BLOCK_M rows (row = one
(batch, position) of the output), one launch for up to ``HEADS_PER_LAUNCH`` heads:

    phase 1, per order n:  a = Σ_k  c[t-n+1+k] · W_{n,k}[heads]ᵀ    (one tl.dot, fp32 "ieee")
                           id = (Σ_b 1[a_b > 0]·2^b) mod T           (legacy: int64(⌊|a_0|⌋) mod T)
                           ids[row, n, head] = id  (-1 where n > fit[row])
    phase 2, per D tile:   acc += Σ_head Σ_n table_head[id_n]        (ids kept in registers)
                           last launch: out = acc / (H·fit), else acc → fp32 scratch

``fit[row] = min(N, kept run ending at t)`` (torch, a running max over the keep mask;
``min(N, t+1)`` without padding) decides which orders are read: an n-gram never
reaches a padded position, whose compressed vector is never loaded, and a padded row
reads zeros. The tables are separate tensors (the module keeps the seed's
``nn.Embedding`` per head, and stacking them would copy H·T·D values on every call):
the kernel takes 8 table pointers and picks each unrolled head's at compile time;
more heads run in launches of 8 with an fp32 [rows, D] scratch between them.
The hash runs in exact fp32 (``input_precision="ieee"``) whatever the activation
dtype: a tf32 product would flip signs and change buckets. The ids ([rows, N, H]
int64) are an output and, with ``fit``, the only tensors saved for backward; nothing
[rows, T] (one-hot) is ever built.

Lookup backward, d table_h[id] = Σ g[row] / (H·fit[row]) over the (row, n) addressing
it, without atomics (bitwise reproducible): torch sorts the E = rows·N·H keys
``h·T + id`` stably (-1 → a sentinel sorted last); ``_engram_bwd_chunk_kernel`` takes
BLOCK_E sorted entries × BLOCK_D columns, gathers the scaled gradient rows and sums
every bucket's piece with one fp32 dot against the [BLOCK_E, BLOCK_E] 0/1 "same
bucket" matrix (a segmented sum; 16 FMAs per gathered element); a bucket whole inside
the chunk is stored once, the pieces of a bucket crossing chunk edges go to two
[chunks, D] buffers, and ``_engram_bwd_fixup_kernel`` (the chunk where that bucket
starts) adds them in chunk order (``searchsorted`` gives its end; static shapes). Work
per program is fixed: a hot bucket of m entries costs ⌈m / BLOCK_E⌉ serial adds, not m.

Fusion gate (``_fusion_gate_fwd_kernel`` / ``_fusion_gate_bwd_kernel``), BLOCK_M rows
of F ≤ 4096 columns held in registers: both RMSNorms, the scaled dot, the signed-sqrt
sigmoid and the product with the value; the backward is persistent (a grid of
``num_programs_for_rows``, each program strides over row blocks), recomputes the
forward, writes d(hidden_low), d(key_low), d(value) and keeps the two norm weights'
gradient sums in registers: one partial row per program, summed in a fixed order in
torch. The four projections stay ``F.linear``.
"""
from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import ConfigError, DTypeError, ShapeError
from laminae.primitives.engram import GATE_FLOOR, check_lookup_args, engram_orders_that_fit, full_keep_mask

from ._common import StaticCase, contiguous, empty, empty_like, num_programs_for_rows

__all__ = ["engram_lookup", "engram_lookup_fused", "engram_bucket_ids_triton", "engram_fusion_gate", "engram_fusion_gate_fused",
           "engram_fusion", "MAX_NGRAM", "MAX_FUSION_DIM"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Lookup tiles.
BLOCK_M = 16       # output rows per program
BLOCK_C = 32       # compress_dim chunk of one hash product
BLOCK_BITS = 32    # hash bits (≤ 24) padded to a tl.dot-friendly width
BLOCK_NG = 8       # register slots for the ids of every order
BLOCK_D = 32       # table-row chunk
NUM_WARPS = 4
# Heads of one lookup launch (the kernel takes that many table pointers). More heads run
# in launches of GROUP_HEADS with an fp32 [rows, D] scratch between them: a launch that
# stores the scratch at BLOCK_H 8 spills in the static check, at 4 it does not.
HEADS_PER_LAUNCH = 8
GROUP_HEADS = 4
# Table-gradient tiles: BWD_TILES["BLOCK_E"] sorted (bucket, row) entries × BLOCK_D columns per
# program (a dict so tests can shrink the chunk and make every bucket cross chunk edges).
BWD_TILES = {"BLOCK_E": 16, "BLOCK_D": 64}
MAX_NGRAM = BLOCK_NG
# Fusion gate.
MAX_FUSION_DIM = 4096
_GATE_TILE = 2048  # BLOCK_M · BLOCK_F elements per program (forward)
_GATE_TILE_BWD = 1024  # the backward keeps ~3x more live values per element


# ----------------------------------------------------------------------------
# Lookup kernels
# ----------------------------------------------------------------------------


@triton.jit
def _head_table(h: tl.constexpr, t0, t1, t2, t3, t4, t5, t6, t7):
    """Table pointer of the group's head h (a constexpr: the choice is made at compile time)."""
    if h == 0:
        tp = t0
    elif h == 1:
        tp = t1
    elif h == 2:
        tp = t2
    elif h == 3:
        tp = t3
    elif h == 4:
        tp = t4
    elif h == 5:
        tp = t5
    elif h == 6:
        tp = t6
    else:
        tp = t7
    return tp


@triton.jit
def _engram_fwd_kernel(c_ptr, proj_ptr, bw_ptr, t0, t1, t2, t3, t4, t5, t6, t7, fit_ptr, acc_ptr, out_ptr, ids_ptr,
                       N, S, S_FULL, P, DC, D, T, BITS, H, HEAD0, MAX_NGRAM,
                       LEGACY: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_BITS: tl.constexpr,
                       BLOCK_NG: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    cur = (rows // S) * S_FULL + P + rows % S   # this position's row in the prefix-extended `c`
    # orders that fit: min(N, kept run ending at t); 0 on padding, whose row reads zeros
    fit = tl.load(fit_ptr + rows, mask=row_mask, other=0)
    # one hash product for the group's heads: column j is bit j % BLOCK_BITS of head j // BLOCK_BITS
    cols_hb = tl.arange(0, BLOCK_H * BLOCK_BITS)
    bit = cols_hb % BLOCK_BITS
    head_of = HEAD0 + cols_hb // BLOCK_BITS
    hb_mask = (bit < BITS) & (head_of < H)
    bit_w = tl.load(bw_ptr + bit, mask=hb_mask, other=0.0)
    hh = tl.arange(0, BLOCK_H)
    head_ok = HEAD0 + hh < H
    ng = tl.arange(0, BLOCK_NG)
    # codes < 2^24 and ids < T: int32 keeps registers free
    ids_all = tl.full((BLOCK_M, BLOCK_NG, BLOCK_H), -1, tl.int32)

    # phase 1: hash every order for every head of the group, keep the bucket ids in registers
    for n in range(1, MAX_NGRAM + 1):
        # an order that fits never reaches padding: padded vectors (even NaN) are never loaded
        valid = fit >= n
        a = tl.zeros((BLOCK_M, BLOCK_H * BLOCK_BITS), dtype=tl.float32)
        for k in range(0, n):
            slot = (n * (n - 1)) // 2 + k
            src = cur - (n - 1) + k
            proj_rows = ((slot * H + head_of) * BITS + bit).to(tl.int64)
            term = tl.zeros((BLOCK_M, BLOCK_H * BLOCK_BITS), dtype=tl.float32)
            for c0 in range(0, DC, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                c_mask = cols < DC
                x = tl.load(c_ptr + src[:, None] * DC + cols[None, :],
                            mask=valid[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
                w = tl.load(proj_ptr + proj_rows[None, :] * DC + cols[:, None],
                            mask=c_mask[:, None] & hb_mask[None, :], other=0.0)
                term += tl.dot(x, w, input_precision="ieee")
            a += term
        if LEGACY:
            part = tl.where(bit[None, :] == 0, tl.abs(a), 0.0)
        else:
            part = tl.where((a > 0) & hb_mask[None, :], bit_w[None, :], 0.0)
        code = tl.sum(tl.reshape(part, (BLOCK_M, BLOCK_H, BLOCK_BITS)), axis=2)
        if LEGACY:
            # the reference truncates |a| to int64: an int32 conversion saturates (GPU) or
            # wraps (CPU) from 2^31 on and picks another bucket
            bucket = (code.to(tl.int64) % T).to(tl.int32)
        else:
            bucket = code.to(tl.int32) % T
        idx = tl.where(valid[:, None] & head_ok[None, :], bucket, -1)
        tl.store(ids_ptr + rows[:, None] * (MAX_NGRAM * H) + (n - 1) * H + HEAD0 + hh[None, :], idx.to(tl.int64),
                 mask=row_mask[:, None] & head_ok[None, :])
        ids_all = tl.where(ng[None, :, None] == n - 1, idx[:, None, :], ids_all)

    # phase 2: gather and sum the group's rows, D in chunks
    inv_count = 1.0 / (tl.maximum(fit, 1) * H).to(tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols < D)[None, :]
        offs = rows[:, None] * D + cols[None, :]
        if FIRST:
            acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        else:
            acc = tl.load(acc_ptr + offs, mask=mask, other=0.0)
        for h in tl.static_range(BLOCK_H):
            table_ptr = _head_table(h, t0, t1, t2, t3, t4, t5, t6, t7)
            ids_h = tl.sum(tl.where(hh[None, None, :] == h, ids_all, 0), axis=2)
            for n in range(0, MAX_NGRAM):
                idx = tl.sum(tl.where(ng[None, :] == n, ids_h, 0), axis=1)
                hit = mask & (idx >= 0)[:, None]
                acc += tl.load(table_ptr + idx.to(tl.int64)[:, None] * D + cols[None, :], mask=hit,
                               other=0.0).to(tl.float32)
        if LAST:
            tl.store(out_ptr + offs, (acc * inv_count[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(acc_ptr + offs, acc, mask=mask)


@triton.jit
def _engram_bwd_chunk_kernel(g_ptr, keys_ptr, rows_ptr, fit_ptr, dt_ptr, head_ptr, carry_ptr, E, D, HT, H,
                             BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """One chunk of BLOCK_E sorted entries × BLOCK_D columns. Sorted keys make each
    bucket's entries contiguous, so ``same[i, j] = key_i == key_j`` times the scaled
    gradient rows sums every bucket's piece (one exact fp32 dot; BLOCK_E FMAs per
    gathered element). A bucket whole inside the chunk is written to the table
    gradient; the piece continuing an earlier chunk's bucket goes to head[chunk], the
    piece of a bucket that starts here and runs on goes to carry[chunk] (the fix-up
    kernel joins them)."""
    chunk = tl.program_id(0)
    pid_d = tl.program_id(1)
    local = tl.arange(0, BLOCK_E)
    e = chunk.to(tl.int64) * BLOCK_E + local
    in_range = e < E
    key = tl.load(keys_ptr + e, mask=in_range, other=HT)          # HT: no bucket (order did not fit)
    nxt = tl.load(keys_ptr + e + 1, mask=e + 1 < E, other=-1)
    real = in_range & (key < HT)
    ends = key != nxt                                             # last entry of its bucket
    piece_end = ends | (local == BLOCK_E - 1)
    # the piece holding entry 0 continues the previous chunk's bucket when entry 0 does not start one
    key0 = tl.load(keys_ptr + chunk.to(tl.int64) * BLOCK_E)
    before0 = tl.load(keys_ptr + chunk.to(tl.int64) * BLOCK_E - 1, mask=chunk > 0, other=-1)
    continued = (key == key0) & (before0 == key0)
    complete = real & piece_end & ends & ~continued
    to_head = real & piece_end & continued
    to_carry = real & piece_end & ~ends & ~continued

    row = tl.load(rows_ptr + e, mask=real, other=0)
    count = (tl.load(fit_ptr + row, mask=real, other=1) * H).to(tl.float32)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    vals = tl.load(g_ptr + row[:, None] * D + cols[None, :], mask=real[:, None] & col_mask[None, :],
                   other=0.0).to(tl.float32) / count[:, None]
    same = tl.where(key[:, None] == key[None, :], 1.0, 0.0)
    sums = tl.dot(same, vals, input_precision="ieee")
    tl.store(dt_ptr + key[:, None] * D + cols[None, :], sums, mask=complete[:, None] & col_mask[None, :])
    side = chunk.to(tl.int64) * D + cols[None, :] + 0 * local[:, None]
    tl.store(head_ptr + side, sums, mask=to_head[:, None] & col_mask[None, :])
    tl.store(carry_ptr + side, sums, mask=to_carry[:, None] & col_mask[None, :])


@triton.jit
def _engram_bwd_fixup_kernel(keys_ptr, seg_end_ptr, dt_ptr, head_ptr, carry_ptr, E, D, HT,
                             BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """The bucket that starts in this chunk and runs past its end: carry[chunk] plus
    the head pieces of the chunks it covers, added in chunk order."""
    chunk = tl.program_id(0)
    pid_d = tl.program_id(1)
    first = chunk.to(tl.int64) * BLOCK_E
    last = tl.minimum(first + BLOCK_E, E) - 1
    key = tl.load(keys_ptr + last)
    nxt = tl.load(keys_ptr + last + 1, mask=last + 1 < E, other=-1)
    before = tl.load(keys_ptr + first - 1, mask=first > 0, other=-1)
    starts_here = (tl.load(keys_ptr + first) != key) | (before != key)
    if (key < HT) & (nxt == key) & starts_here:
        cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        col_mask = cols < D
        acc = tl.load(carry_ptr + chunk.to(tl.int64) * D + cols, mask=col_mask, other=0.0)
        end_chunk = (tl.load(seg_end_ptr + chunk) + BLOCK_E - 1) // BLOCK_E
        head = head_ptr + (chunk.to(tl.int64) + 1) * D + cols
        for _ in range(chunk + 1, end_chunk):
            acc += tl.load(head, mask=col_mask, other=0.0)
            head += D
        tl.store(dt_ptr + key * D + cols, acc, mask=col_mask)


# (legacy hash, BLOCK_H) -> (BLOCK_C, num_warps, num_stages): the fp32 hash operands
# [16, BLOCK_C] x [BLOCK_C, BLOCK_H·BLOCK_BITS] live in registers (FMA dots), so wide head
# groups take narrower compress_dim chunks, more warps and, at 8 sign-hash heads, one
# load in flight less (3 stages spill 16 B there with fp32 activations); each entry is
# spill-free in the static check.
LOOKUP_TILES = {(False, 1): (32, 4, 3), (False, 2): (32, 4, 3), (False, 4): (32, 8, 3), (False, 8): (16, 8, 2),
                (True, 1): (32, 4, 3), (True, 2): (32, 4, 3), (True, 4): (32, 4, 3), (True, 8): (16, 4, 3)}


def lookup_tiles(heads: int, legacy: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_H, BLOCK_C, BLOCK_BITS, num_warps, num_stages) of a lookup launch: the heads of one
    launch padded to a power of two; the legacy hash has one bit per head, so 16
    columns (the narrowest tl.dot) instead of 32."""
    block_h = triton.next_power_of_2(heads if heads <= HEADS_PER_LAUNCH else GROUP_HEADS)
    block_bits = 16 if legacy else BLOCK_BITS
    block_c, warps, stages = LOOKUP_TILES[(bool(legacy), block_h)]
    return block_h, block_c, block_bits, warps, stages


def _max_ngram(num_slots: int) -> int:
    return int(round((math.sqrt(8 * num_slots + 1) - 1) / 2))


@triton_op("laminae::engram_lookup", mutates_args=())
def engram_lookup_fused(
    full: torch.Tensor, hash_projs: torch.Tensor, bit_weights: torch.Tensor, tables: list[torch.Tensor],
    fit: torch.Tensor, prefix_len: int, legacy_trunc: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read for the last ``S - prefix_len`` positions of ``full`` [B, S, Dc].

    ``hash_projs`` [slots, H, bits, Dc] fp32 (bits = 1 for legacy), ``bit_weights``
    [bits] fp32, ``tables`` H contiguous [T, D], ``fit`` [B·(S-P)] int32: orders read
    per output row (:func:`~laminae.primitives.engram.engram_orders_that_fit`; 0 on
    padding). Returns ``(out [B, S-P, D], ids [B·(S-P), N, H] int64)``.
    """
    batch, seq_full, dc = full.shape
    seq = seq_full - prefix_len
    heads = len(tables)
    table_size, d = tables[0].shape
    max_ngram = _max_ngram(hash_projs.shape[0])
    bits = hash_projs.shape[2]
    n_rows = batch * seq
    out = empty((batch, seq, d), dtype=full.dtype, device=full.device)
    ids = empty((n_rows, max_ngram, heads), dtype=torch.int64, device=full.device)
    if n_rows == 0:
        return out, ids
    per_launch = heads if heads <= HEADS_PER_LAUNCH else GROUP_HEADS
    groups = triton.cdiv(heads, per_launch)
    acc = empty((n_rows, d), dtype=torch.float32, device=full.device) if groups > 1 else None
    block_h, block_c, block_bits, warps, stages = lookup_tiles(heads, legacy_trunc)
    grid = (triton.cdiv(n_rows, BLOCK_M),)
    for g in range(groups):
        group = tables[g * per_launch:(g + 1) * per_launch]
        group = group + [group[0]] * (HEADS_PER_LAUNCH - len(group))   # unused pointer slots
        wrap_triton(_engram_fwd_kernel)[grid](
            full, hash_projs, bit_weights, *group, fit, acc, out, ids,
            n_rows, seq, seq_full, prefix_len, dc, d, table_size, bits, heads, g * per_launch, max_ngram,
            LEGACY=legacy_trunc, FIRST=g == 0, LAST=g == groups - 1, BLOCK_H=block_h,
            BLOCK_M=BLOCK_M, BLOCK_C=block_c, BLOCK_BITS=block_bits, BLOCK_NG=BLOCK_NG, BLOCK_D=BLOCK_D,
            num_warps=warps, num_stages=stages,
        )
    return out, ids


@triton_op("laminae::engram_lookup_bwd", mutates_args=())
def _engram_lookup_bwd(g: torch.Tensor, ids: torch.Tensor, fit: torch.Tensor, table_size: int,
                       out_dim: int) -> torch.Tensor:
    """d table_h[id] = Σ g[row] / (H·fit[row]) over the (row, order) pairs addressing it.

    No atomics: the (h·T + id) keys are sorted stably (static shapes), each chunk of
    sorted entries sums its buckets with a segmented scan, and a bucket spanning
    chunks is joined in chunk order: bitwise reproducible, and a hot bucket costs
    ⌈count / BLOCK_E⌉ serial steps instead of count."""
    n_rows, max_ngram, heads = ids.shape
    dtab = torch.zeros((heads * table_size, out_dim), dtype=torch.float32, device=g.device)
    if n_rows == 0:
        return dtab.view(heads, table_size, out_dim)
    sentinel = heads * table_size
    head_offset = torch.arange(heads, device=g.device, dtype=torch.int64) * table_size
    keys = torch.where(ids >= 0, ids + head_offset, sentinel).reshape(-1)
    sorted_keys, order = torch.sort(keys, stable=True)
    rows = (order // (max_ngram * heads)).contiguous()
    n_entries = sorted_keys.numel()
    block_e, block_d = BWD_TILES["BLOCK_E"], BWD_TILES["BLOCK_D"]
    chunks = triton.cdiv(n_entries, block_e)
    last = torch.clamp(torch.arange(1, chunks + 1, device=g.device) * block_e, max=n_entries) - 1
    seg_end = torch.searchsorted(sorted_keys, sorted_keys[last], right=True)
    head_part = empty((chunks, out_dim), dtype=torch.float32, device=g.device)
    carry_part = empty((chunks, out_dim), dtype=torch.float32, device=g.device)
    grid = (chunks, triton.cdiv(out_dim, block_d))
    wrap_triton(_engram_bwd_chunk_kernel)[grid](
        g, sorted_keys, rows, fit, dtab, head_part, carry_part, n_entries, out_dim, sentinel, heads,
        BLOCK_E=block_e, BLOCK_D=block_d, num_warps=NUM_WARPS)
    wrap_triton(_engram_bwd_fixup_kernel)[grid](
        sorted_keys, seg_end, dtab, head_part, carry_part, n_entries, out_dim, sentinel,
        BLOCK_E=block_e, BLOCK_D=block_d, num_warps=NUM_WARPS)
    return dtab.view(heads, table_size, out_dim)


def _lookup_setup_context(ctx, inputs, output):
    full, hash_projs, bit_weights, tables, fit, prefix_len, legacy_trunc = inputs
    out, ids = output
    ctx.save_for_backward(ids, fit)
    ctx.mark_non_differentiable(ids)
    ctx.table_size, ctx.out_dim = tables[0].shape
    ctx.table_dtype = tables[0].dtype


def _lookup_backward(ctx, g_out, g_ids):
    ids, fit = ctx.saved_tensors
    dtab = _engram_lookup_bwd(g_out.contiguous(), ids, fit, ctx.table_size, ctx.out_dim)
    dtables = [dtab[h].to(ctx.table_dtype) for h in range(dtab.shape[0])]
    return None, None, None, dtables, None, None, None


engram_lookup_fused.register_autograd(_lookup_backward, setup_context=_lookup_setup_context)


def _prepare_lookup(compressed, hash_projs, bit_weights, tables, prefix, legacy_trunc, attention_mask=None,
                    prefix_mask=None):
    max_ngram, table_list = check_lookup_args(compressed, hash_projs, bit_weights, tables, prefix, legacy_trunc,
                                              attention_mask, prefix_mask)
    if compressed.dtype not in _KERNEL_DTYPES:
        raise DTypeError(f"Triton Engram lookup supports fp32/bf16/fp16 `compressed`, got {compressed.dtype}")
    if table_list[0].dtype not in _KERNEL_DTYPES:
        raise DTypeError(f"Triton Engram lookup supports fp32/bf16/fp16 tables, got {table_list[0].dtype}")
    if table_list[0].dtype not in (torch.float32, compressed.dtype):
        raise DTypeError(f"Triton Engram lookup needs tables in fp32 or in compressed's dtype ({compressed.dtype}), "
                         f"got {table_list[0].dtype}")
    if max_ngram > MAX_NGRAM:
        raise ConfigError(f"the Triton Engram lookup supports max_ngram <= {MAX_NGRAM}, got {max_ngram}")
    projs = hash_projs.float()
    if legacy_trunc:
        projs = projs.unsqueeze(2)
    if projs.shape[2] > BLOCK_BITS:
        raise ConfigError(f"the Triton Engram lookup supports at most {BLOCK_BITS} hash bits, got {projs.shape[2]}")
    batch, seq = compressed.shape[:2]
    prefix_len = 0
    full = compressed
    if prefix is not None and prefix.shape[1] > 0:
        prefix_len = prefix.shape[1]
        full = torch.cat([prefix.to(compressed.dtype), compressed], dim=1)
    keep = full_keep_mask(batch, prefix_len, seq, attention_mask, prefix_mask if prefix_len else None,
                          compressed.device)
    if keep is None:
        keep = torch.ones(1, prefix_len + seq, dtype=torch.bool, device=compressed.device)
    fit = engram_orders_that_fit(keep, max_ngram)[:, prefix_len:].expand(batch, seq)
    fit = fit.to(torch.int32).contiguous().view(-1)
    full, projs = contiguous(full, projs)
    bw = bit_weights.float().contiguous() if not legacy_trunc else torch.ones(1, device=full.device)
    return full, projs, bw, [t.contiguous() for t in table_list], fit, prefix_len


def engram_lookup(
    compressed: torch.Tensor,
    hash_projs: torch.Tensor,
    bit_weights: torch.Tensor,
    tables: torch.Tensor | Sequence[torch.Tensor],
    *,
    prefix: torch.Tensor | None = None,
    legacy_trunc: bool = False,
    attention_mask: torch.Tensor | None = None,
    prefix_mask: torch.Tensor | None = None,
    deterministic: bool = True,
) -> torch.Tensor:
    """Triton Engram read with the signature of
    :func:`laminae.primitives.engram.engram_lookup_reference`.

    ``compressed`` ``[B, S, Dc]`` fp32/bf16/fp16, ``tables`` ``[H, T, D]`` or H ``[T, D]``,
    ``attention_mask`` ``[B, S]`` / ``prefix_mask`` ``[B, P]`` keep masks; returns
    ``[B, S, D]`` in compressed's dtype. Differentiable in the tables only; the table
    gradient is deterministic (``deterministic`` is accepted for compatibility).
    """
    del deterministic  # the backward has no atomics: always reproducible
    full, projs, bw, table_list, fit, prefix_len = _prepare_lookup(
        compressed, hash_projs, bit_weights, tables, prefix, legacy_trunc, attention_mask, prefix_mask)
    out, _ = engram_lookup_fused(full, projs, bw, table_list, fit, prefix_len, bool(legacy_trunc))
    return out


def engram_bucket_ids_triton(
    compressed: torch.Tensor,
    hash_projs: torch.Tensor,
    bit_weights: torch.Tensor,
    tables: torch.Tensor | Sequence[torch.Tensor],
    *,
    prefix: torch.Tensor | None = None,
    legacy_trunc: bool = False,
    attention_mask: torch.Tensor | None = None,
    prefix_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The bucket ids the kernel addressed, ``[B, S, N, H]`` int64 (-1: order does not fit),
    for the positions of ``compressed`` (the reference's ids sliced past the prefix)."""
    full, projs, bw, table_list, fit, prefix_len = _prepare_lookup(
        compressed, hash_projs, bit_weights, tables, prefix, legacy_trunc, attention_mask, prefix_mask)
    with torch.no_grad():
        _, ids = engram_lookup_fused(full, projs, bw, table_list, fit, prefix_len, bool(legacy_trunc))
    batch, seq = compressed.shape[:2]
    return ids.view(batch, seq, ids.shape[1], ids.shape[2])


# ----------------------------------------------------------------------------
# Fusion gate kernels
# ----------------------------------------------------------------------------


@triton.jit
def _gate_forward_math(hd, kp, wh, wk, F_DIM, eps, sqrt_f, GATE_FLOOR: tl.constexpr):
    rh = tl.math.rsqrt(tl.sum(hd * hd, axis=1) / F_DIM + eps)
    rk = tl.math.rsqrt(tl.sum(kp * kp, axis=1) / F_DIM + eps)
    hn = hd * rh[:, None] * wh[None, :]
    kn = kp * rk[:, None] * wk[None, :]
    a = tl.sum(hn * kn, axis=1) / sqrt_f
    abs_a = tl.abs(a)
    sign = tl.where(a > 0, 1.0, tl.where(a < 0, -1.0, 0.0))
    gate = tl.sigmoid(tl.sqrt(tl.maximum(abs_a, GATE_FLOOR)) * sign)
    return rh, rk, hn, kn, abs_a, gate


@triton.jit
def _load_gate_rows(hd_ptr, kp_ptr, v_ptr, rows, cols, N, F_DIM):
    mask = (rows < N)[:, None] & (cols < F_DIM)[None, :]
    offs = rows[:, None] * F_DIM + cols[None, :]
    hd = tl.load(hd_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    kp = tl.load(kp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return hd, kp, v, mask, offs


@triton.jit
def _fusion_gate_fwd_kernel(hd_ptr, kp_ptr, v_ptr, wh_ptr, wk_ptr, out_ptr, N, F_DIM, eps, sqrt_f,
                            GATE_FLOOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_F)
    col_mask = cols < F_DIM
    hd, kp, v, mask, offs = _load_gate_rows(hd_ptr, kp_ptr, v_ptr, rows, cols, N, F_DIM)
    wh = tl.load(wh_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    wk = tl.load(wk_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    _, _, _, _, _, gate = _gate_forward_math(hd, kp, wh, wk, F_DIM, eps, sqrt_f, GATE_FLOOR)
    tl.store(out_ptr + offs, (gate[:, None] * v).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fusion_gate_bwd_kernel(g_ptr, hd_ptr, kp_ptr, v_ptr, wh_ptr, wk_ptr, dhd_ptr, dkp_ptr, dv_ptr,
                            dwh_part_ptr, dwk_part_ptr, N, F_DIM, eps, sqrt_f,
                            GATE_FLOOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    """Persistent: program p takes row blocks p, p + P, p + 2P, ... and keeps the two
    norm weights' gradient sums in registers; one partial row per program, reduced
    in a fixed order by the caller (no atomics)."""
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_F)
    col_mask = cols < F_DIM
    wh = tl.load(wh_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    wk = tl.load(wk_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dwh = tl.zeros((BLOCK_F,), dtype=tl.float32)
    dwk = tl.zeros((BLOCK_F,), dtype=tl.float32)
    for start in range(pid * BLOCK_M, N, num_progs * BLOCK_M):
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        hd, kp, v, mask, offs = _load_gate_rows(hd_ptr, kp_ptr, v_ptr, rows, cols, N, F_DIM)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rh, rk, hn, kn, abs_a, gate = _gate_forward_math(hd, kp, wh, wk, F_DIM, eps, sqrt_f, GATE_FLOOR)
        tl.store(dv_ptr + offs, (g * gate[:, None]).to(dv_ptr.dtype.element_ty), mask=mask)
        d_gate = tl.sum(g * v, axis=1)
        d_s = d_gate * gate * (1.0 - gate)
        # d/da [sign(a)·√max(|a|, floor)] = 1/(2√|a|) above the floor, 0 below it
        d_a = tl.where(abs_a >= GATE_FLOOR, d_s / (2.0 * tl.sqrt(tl.maximum(abs_a, GATE_FLOOR))), 0.0) / sqrt_f
        d_hd, dwh_rows = _rms_norm_bwd(d_a[:, None] * kn, hd, rh, wh, F_DIM)
        d_kp, dwk_rows = _rms_norm_bwd(d_a[:, None] * hn, kp, rk, wk, F_DIM)
        dwh += dwh_rows
        dwk += dwk_rows
        tl.store(dhd_ptr + offs, d_hd.to(dhd_ptr.dtype.element_ty), mask=mask)
        tl.store(dkp_ptr + offs, d_kp.to(dkp_ptr.dtype.element_ty), mask=mask)
    tl.store(dwh_part_ptr + pid.to(tl.int64) * F_DIM + cols, dwh, mask=col_mask)
    tl.store(dwk_part_ptr + pid.to(tl.int64) * F_DIM + cols, dwk, mask=col_mask)


@triton.jit
def _rms_norm_bwd(dy, x, r, w, F_DIM):
    # y = x·r·w  →  dw = Σ_rows dy·x·r,  dx = r·u − x·r³·mean(u·x),  u = dy·w
    u = dy * w[None, :]
    dx = r[:, None] * u - x * (r * r * r * tl.sum(u * x, axis=1) / F_DIM)[:, None]
    return dx, tl.sum(dy * x * r[:, None], axis=0)


def _gate_blocks(fusion_dim: int, backward: bool = False) -> tuple[int, int, int]:
    block_f = max(16, triton.next_power_of_2(fusion_dim))
    block_m = max(1, min(64, (_GATE_TILE_BWD if backward else _GATE_TILE) // block_f))
    num_warps = 8 if block_f >= 4096 else 4
    return block_m, block_f, num_warps


@triton_op("laminae::engram_fusion_gate", mutates_args=())
def engram_fusion_gate_fused(hidden_low: torch.Tensor, key_low: torch.Tensor, value: torch.Tensor,
                             hidden_norm_weight: torch.Tensor, ngram_norm_weight: torch.Tensor,
                             eps: float) -> torch.Tensor:
    """``g · value`` over rows of [N, F] (see :func:`engram_fusion_gate`)."""
    n, f = value.shape
    out = empty_like(value)
    if n == 0:
        return out
    block_m, block_f, warps = _gate_blocks(f)
    wrap_triton(_fusion_gate_fwd_kernel)[(triton.cdiv(n, block_m),)](
        hidden_low, key_low, value, hidden_norm_weight, ngram_norm_weight, out, n, f, eps, math.sqrt(f),
        GATE_FLOOR=GATE_FLOOR, BLOCK_M=block_m, BLOCK_F=block_f, num_warps=warps)
    return out


@triton_op("laminae::engram_fusion_gate_bwd", mutates_args=())
def _engram_fusion_gate_bwd(g: torch.Tensor, hidden_low: torch.Tensor, key_low: torch.Tensor, value: torch.Tensor,
                            hidden_norm_weight: torch.Tensor, ngram_norm_weight: torch.Tensor, eps: float,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, f = value.shape
    block_m, block_f, warps = _gate_blocks(f, backward=True)
    programs = num_programs_for_rows(triton.cdiv(n, block_m), value.device) if n > 0 else 0
    d_hidden, d_key, d_value = empty_like(hidden_low), empty_like(key_low), empty_like(value)
    dwh_part = empty((programs, f), dtype=torch.float32, device=value.device)
    dwk_part = empty((programs, f), dtype=torch.float32, device=value.device)
    if n > 0:
        wrap_triton(_fusion_gate_bwd_kernel)[(programs,)](
            g, hidden_low, key_low, value, hidden_norm_weight, ngram_norm_weight, d_hidden, d_key, d_value,
            dwh_part, dwk_part, n, f, eps, math.sqrt(f),
            GATE_FLOOR=GATE_FLOOR, BLOCK_M=block_m, BLOCK_F=block_f, num_warps=warps)
    return d_hidden, d_key, d_value, dwh_part, dwk_part


def _gate_setup_context(ctx, inputs, output):
    hidden_low, key_low, value, wh, wk, eps = inputs
    ctx.save_for_backward(hidden_low, key_low, value, wh, wk)
    ctx.eps = eps


def _gate_backward(ctx, g):
    hidden_low, key_low, value, wh, wk = ctx.saved_tensors
    d_hidden, d_key, d_value, dwh_part, dwk_part = _engram_fusion_gate_bwd(
        g.contiguous(), hidden_low, key_low, value, wh, wk, ctx.eps)
    return d_hidden, d_key, d_value, dwh_part.sum(0).to(wh.dtype), dwk_part.sum(0).to(wk.dtype), None


engram_fusion_gate_fused.register_autograd(_gate_backward, setup_context=_gate_setup_context)


def engram_fusion_gate(
    hidden_low: torch.Tensor,
    key_low: torch.Tensor,
    value: torch.Tensor,
    hidden_norm_weight: torch.Tensor,
    ngram_norm_weight: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Triton twin of :func:`laminae.primitives.engram.engram_fusion_gate_reference`.

    ``hidden_low``, ``key_low``, ``value``: ``[..., F]`` (same shape and dtype, fp32/bf16/
    fp16, F ≤ 4096); norm weights ``[F]``. Returns ``[..., F]`` in value's dtype.
    """
    for name, t in (("hidden_low", hidden_low), ("key_low", key_low), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _KERNEL_DTYPES:
            raise DTypeError(f"Triton Engram fusion gate supports fp32/bf16/fp16 `{name}`, got {t.dtype}")
        if t.shape != value.shape or t.dim() == 0:
            raise ShapeError(f"`{name}` must have the shape of `value` {tuple(value.shape)}, got {tuple(t.shape)}")
    if len({hidden_low.dtype, key_low.dtype, value.dtype}) > 1:
        raise DTypeError(f"`hidden_low`/`key_low`/`value` must share one dtype, got "
                         f"{hidden_low.dtype}, {key_low.dtype}, {value.dtype}")
    f = value.shape[-1]
    for name, w in (("hidden_norm_weight", hidden_norm_weight), ("ngram_norm_weight", ngram_norm_weight)):
        if not isinstance(w, torch.Tensor) or w.shape != (f,):
            raise ShapeError(f"`{name}` must have shape ({f},), got {tuple(getattr(w, 'shape', ()))}")
        if w.dtype not in _KERNEL_DTYPES:
            raise DTypeError(f"Triton Engram fusion gate supports fp32/bf16/fp16 `{name}`, got {w.dtype}")
    if f > MAX_FUSION_DIM:
        raise ConfigError(f"the Triton Engram fusion gate holds a row in registers: fusion_dim must be "
                          f"<= {MAX_FUSION_DIM}, got {f}")
    shape = value.shape
    # the [F] weights go in as fp32 (autograd casts their gradients back)
    hd, kp, v, wh, wk = contiguous(hidden_low.reshape(-1, f), key_low.reshape(-1, f), value.reshape(-1, f),
                                   hidden_norm_weight.float(), ngram_norm_weight.float())
    return engram_fusion_gate_fused(hd, kp, v, wh, wk, float(eps)).reshape(shape)


def engram_fusion(
    hidden: torch.Tensor,
    ngram: torch.Tensor,
    hidden_down_weight: torch.Tensor,
    key_proj_weight: torch.Tensor,
    value_proj_weight: torch.Tensor,
    out_proj_weight: torch.Tensor,
    hidden_norm_weight: torch.Tensor,
    ngram_norm_weight: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Triton twin of :func:`laminae.primitives.engram.engram_fusion_reference`: the four
    projections with ``F.linear`` (cuBLAS), the gate fused."""
    gated = engram_fusion_gate(F.linear(hidden, hidden_down_weight), F.linear(ngram, key_proj_weight),
                               F.linear(ngram, value_proj_weight), hidden_norm_weight, ngram_norm_weight, eps)
    return hidden + F.linear(gated, out_proj_weight)


# ----------------------------------------------------------------------------
# Launchable configurations and the tour
# ----------------------------------------------------------------------------


def static_cases() -> Iterator[StaticCase]:
    """Each case with the pointers Triton's launcher specialises as 16-byte aligned: every
    one but the tables t0..t7, which may be the heads of one stacked ``[H, T, D]``
    tensor (views at offsets of T·D elements, aligned for some T·D only)."""
    import dataclasses

    for case in _static_cases():
        aligned = tuple(k for k, v in case.signature.items() if v.startswith("*") and not k[1:].isdigit())
        yield dataclasses.replace(case, divisible=aligned)


def _static_cases() -> Iterator[StaticCase]:
    # (compressed/output dtype, table dtype): tables are usually fp32 master weights
    lookup_dtypes = [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"), ("fp16", "fp32")]
    # one launch of BLOCK_H heads (1..8 heads); more heads: launches of GROUP_HEADS that
    # start (FIRST), continue or finish (LAST) the fp32 scratch sum
    launches = [(h, True, True) for h in (1, 2, 3, 5)]
    launches += [(9, True, False), (9, False, False), (9, False, True)]
    for c_dt, t_dt in lookup_dtypes:
        for legacy in (False, True):
            for heads, first, last in launches:
                block_h, block_c, block_bits, warps, stages = lookup_tiles(heads, legacy)
                yield StaticCase(
                    "engram_fwd", _engram_fwd_kernel,
                    dict(c_ptr=f"*{c_dt}", proj_ptr="*fp32", bw_ptr="*fp32",
                         **{f"t{i}": f"*{t_dt}" for i in range(HEADS_PER_LAUNCH)},
                         fit_ptr="*i32", acc_ptr="*fp32", out_ptr=f"*{c_dt}", ids_ptr="*i64", N="i32", S="i32",
                         S_FULL="i32", P="i32", DC="i32", D="i32", T="i32", BITS="i32", H="i32", HEAD0="i32",
                         MAX_NGRAM="i32"),
                    dict(LEGACY=legacy, FIRST=first, LAST=last, BLOCK_H=block_h, BLOCK_M=BLOCK_M, BLOCK_C=block_c,
                         BLOCK_BITS=block_bits, BLOCK_NG=BLOCK_NG, BLOCK_D=BLOCK_D),
                    warps, stages, tags={"dtype": c_dt, "table": t_dt})
    tiles = dict(BLOCK_E=BWD_TILES["BLOCK_E"], BLOCK_D=BWD_TILES["BLOCK_D"])
    for dt in ("fp32", "bf16", "fp16"):
        yield StaticCase(
            "engram_bwd_chunk", _engram_bwd_chunk_kernel,
            dict(g_ptr=f"*{dt}", keys_ptr="*i64", rows_ptr="*i64", fit_ptr="*i32", dt_ptr="*fp32", head_ptr="*fp32",
                 carry_ptr="*fp32", E="i32", D="i32", HT="i32", H="i32"),
            tiles, NUM_WARPS, tags={"dtype": dt})
    yield StaticCase(
        "engram_bwd_fixup", _engram_bwd_fixup_kernel,
        dict(keys_ptr="*i64", seg_end_ptr="*i64", dt_ptr="*fp32", head_ptr="*fp32", carry_ptr="*fp32", E="i32",
             D="i32", HT="i32"),
        tiles, NUM_WARPS, tags={"dtype": "fp32"})
    block_f = 16
    while block_f <= MAX_FUSION_DIM:
        block_m, _, warps = _gate_blocks(block_f)
        block_m_bwd, _, warps_bwd = _gate_blocks(block_f, backward=True)
        const = dict(GATE_FLOOR=GATE_FLOOR, BLOCK_M=block_m, BLOCK_F=block_f)
        const_bwd = dict(GATE_FLOOR=GATE_FLOOR, BLOCK_M=block_m_bwd, BLOCK_F=block_f)
        for dt in ("fp32", "bf16", "fp16"):
            p = f"*{dt}"
            yield StaticCase("fusion_gate_fwd", _fusion_gate_fwd_kernel,
                             dict(hd_ptr=p, kp_ptr=p, v_ptr=p, wh_ptr="*fp32", wk_ptr="*fp32", out_ptr=p,
                                  N="i32", F_DIM="i32", eps="fp32", sqrt_f="fp32"), const, warps, tags={"dtype": dt})
            yield StaticCase("fusion_gate_bwd", _fusion_gate_bwd_kernel,
                             dict(g_ptr=p, hd_ptr=p, kp_ptr=p, v_ptr=p, wh_ptr="*fp32", wk_ptr="*fp32",
                                  dhd_ptr=p, dkp_ptr=p, dv_ptr=p, dwh_part_ptr="*fp32", dwk_part_ptr="*fp32",
                                  N="i32", F_DIM="i32", eps="fp32", sqrt_f="fp32"), const_bwd, warps_bwd,
                             tags={"dtype": dt})
        block_f *= 2


def tour_case(device: torch.device):
    from laminae.primitives.engram import (MultiHeadHashLookup, engram_fusion_gate_reference,
                                           engram_lookup_reference)

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    lookup = MultiHeadHashLookup(num_heads=2, table_size=61, compress_dim=24, out_dim=96, max_ngram=3)
    compressed = torch.randn(2, 40, 24, generator=gen)
    compressed = compressed / compressed.norm(dim=-1, keepdim=True)
    lookup_inputs = {
        "compressed": compressed.to(device),
        "hash_projs": lookup.hash_projs().to(device),
        "bit_weights": lookup.bit_weights.to(device),
        "tables": torch.randn(2, 61, 96, generator=gen).to(device),
    }
    f = 48
    gate_inputs = {
        "hidden_low": torch.randn(2 * 40, f, generator=gen).to(device),
        "key_low": torch.randn(2 * 40, f, generator=gen).to(device),
        "value": torch.randn(2 * 40, f, generator=gen).to(device),
        "hidden_norm_weight": (1 + 0.1 * torch.randn(f, generator=gen)).to(device),
        "ngram_norm_weight": (1 + 0.1 * torch.randn(f, generator=gen)).to(device),
    }
    return [
        TourCase("engram lookup (H=2, T=61, N=3)", engram_lookup, engram_lookup_reference, lookup_inputs, ["tables"]),
        TourCase("engram fusion gate (F=48)", engram_fusion_gate, engram_fusion_gate_reference, gate_inputs,
                 list(gate_inputs)),
    ]
