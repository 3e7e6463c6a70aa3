"""The launches of DERF, Elo and affine-scaled attention at a goal shape, for
:mod:`bench.estimate`: programs, tensor-core FLOPs, ALU slots, compulsory bytes and
serial steps per launch, from the kernels' own tile tables.

ALU slots per score element (one fp32 op = 1, one ex2/rcp/lg2 = MUFU = 8), read off
the kernel code:

- DERF weight: α·s + b, −z², ex2 (+ its log2 e multiply), |z|, 1 + z/2 and its rcp, the
  degree-10 Horner polynomial, t·P·gauss, sign select, γ·half: 9 + 2·MUFU + 10 = 35;
  the causal test (compare, and, select) 3 more on a tile that needs it; the 16-bit
  forward's rescale to the running max (|w|, max, ·1/ref, convert, sum) 5; each
  backward's dw, dz, the parameter sums or w·rden and converts 14.
- Elo: per kernel the exponentials (1–2 ex2), the in-tile column scans (a 64-row
  ``tl.cumsum``: log2 64 = 6 shuffle+add steps, 12 slots), the masks and products;
  summed per launch below.
"""
from __future__ import annotations

import math

try:
    from .estimate import MUFU, STEP_S, Launch, causal_tiles, diagonal_tiles
except ImportError:   # bench/report.py run as a script
    from estimate import MUFU, STEP_S, Launch, causal_tiles, diagonal_tiles

GOAL = [(8, 2048, 16, 16, 64), (8, 2048, 16, 4, 64), (8, 2048, 8, 8, 128), (8, 2048, 8, 2, 128)]
ITEM = 2  # bf16
DERF_WEIGHT = 9 + 2 * MUFU + 10
CAUSAL_TEST = 3


def goal_id(shape) -> str:
    return "B{}-S{}-H{}-KV{}-D{}".format(*shape)


def attention_flops(shape) -> dict:
    """Causal attention's useful FLOPs (as bench/_attention.py counts them)."""
    b, s, h, _, d = shape
    fwd = 2 * 2 * b * h * d * s * s / 2
    return {"fwd": fwd, "fwd+bwd": 3.5 * fwd}


def _bytes(shape):
    b, s, h, hkv, d = shape
    return b * s * h * d * ITEM, b * s * hkv * d * ITEM


def _elements(tiles, bm, bn):
    return tiles * bm * bn


def derf(shape, *, split: bool = True) -> dict:
    """DERF attention's launches per mode; ``split`` False: every tile tests the causal
    bound (before the full/diagonal split; after it, the configurations in
    ``derf.UNSPLIT`` still do)."""
    import torch

    from laminae.triton_ops.derf import TILES, _split

    b, s, h, hkv, d = shape
    bd = max(16, 1 << (d - 1).bit_length())
    q_bytes, kv_bytes = _bytes(shape)
    out = []
    bm, bn, _, _ = TILES[("fwd", "16bit")][bd]
    tiles = causal_tiles(s, bm, bn)
    diag = diagonal_tiles(s, bm, bn) if split and _split("fwd", torch.bfloat16, bd) else tiles
    per_bh = _elements(tiles, bm, bn) * (DERF_WEIGHT + 5) + _elements(diag, bm, bn) * CAUSAL_TEST
    fwd = [Launch("derf", "derf_fwd", (f"BLOCK_D={bd}", "HAS_MASK=False"), math.ceil(s / bm) * b * h,
                  tc_flops=b * h * tiles * 4 * bm * bn * d, alu_slots=b * h * per_bh,
                  bytes=q_bytes * 2 + 2 * kv_bytes + q_bytes * 2 + b * h * s * 4,  # q, k, v; out and fp32 out
                  serial_steps=math.ceil(s / bn), note=f"{bm}×{bn}, {tiles} tiles/head, {diag} diagonal")]
    bwd = [Launch("derf", "derf_bwd_delta", (f"BLOCK_D={bd}",), math.ceil(s / 16) * b * h,
                  bytes=q_bytes + 2 * q_bytes + b * h * s * 4, note="δ rows")]
    bm, bn, _, _ = TILES[("dq", "16bit")][bd]
    tiles = causal_tiles(s, bm, bn)
    diag = diagonal_tiles(s, bm, bn) if split and _split("dq", torch.bfloat16, bd) else tiles
    per_bh = _elements(tiles, bm, bn) * (DERF_WEIGHT + 14) + _elements(diag, bm, bn) * CAUSAL_TEST
    bwd.append(Launch("derf", "derf_bwd_dq", (f"BLOCK_D={bd}", "HAS_MASK=False"), math.ceil(s / bm) * b * h,
                      tc_flops=b * h * tiles * 6 * bm * bn * d, alu_slots=b * h * per_bh,
                      bytes=3 * q_bytes + 2 * kv_bytes, serial_steps=math.ceil(s / bn),
                      note=f"{bm}×{bn}, {tiles} tiles/head, {diag} diagonal"))
    bm, bn, _, _ = TILES[("dkdv", "16bit")][bd]     # queries BLOCK_M stream past a key block BLOCK_N
    tiles = causal_tiles(s, bn, bm)                   # the same triangle, walked by key blocks
    diag = diagonal_tiles(s, bn, bm) if split and _split("dkdv", torch.bfloat16, bd) else tiles
    per_bh = _elements(tiles, bm, bn) * (DERF_WEIGHT + 14) + _elements(diag, bm, bn) * CAUSAL_TEST
    bwd.append(Launch("derf", "derf_bwd_dkdv", (f"BLOCK_D={bd}", "HAS_MASK=False"), math.ceil(s / bn) * b * hkv,
                      tc_flops=b * h * tiles * 8 * bm * bn * d, alu_slots=b * h * per_bh,
                      bytes=2 * q_bytes + 4 * kv_bytes, serial_steps=(h // hkv) * math.ceil(s / bm),
                      note=f"{bn}×{bm}, {tiles} tiles/head, {diag} diagonal"))
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def elo(shape, *, delta_kernel: bool = True) -> dict:
    """Elo attention's launches; ``delta_kernel`` False: before the δ row kernel (torch's
    upcasts, product, sum and transposing copy: 28 bytes per element, five passes)."""
    from laminae.triton_ops.elo_attention import _TILES

    b, s, h, hkv, d = shape
    bd = max(16, 1 << (d - 1).bit_length())
    t = _TILES[("16bit", bd)]
    bm = t.block_m
    q_bytes, kv_bytes = _bytes(shape)
    x = 1  # exp: a multiply by log2 e before each ex2
    nqb = math.ceil(s / bm)
    ck_bytes = b * h * nqb * s * 4

    def launch(name, kernel, programs, dots, alu, nbytes, steps, walk_bm, walk_bn):
        tiles = causal_tiles(s, walk_bm, walk_bn)
        el = _elements(tiles, walk_bm, walk_bn)
        return Launch("elo_attention", kernel, (f"BLOCK_D={bd}",), programs, tc_flops=b * h * tiles * dots * 2 * walk_bm * walk_bn * d,
                      alu_slots=b * h * el * alu, bytes=nbytes, serial_steps=steps, note=f"{walk_bm}×{walk_bn}")

    bn = t.of("stats")[0]
    fwd = [launch("stats", "elo_fwd_stats", nqb * b * h, 1, 8 + MUFU + 1 + x, q_bytes + kv_bytes, math.ceil(s / bn), bm, bn)]
    bn = t.of("rating")[0]
    fwd.append(launch("rating", "elo_fwd_rating", math.ceil(s / bn) * b * h, 1, 8 + MUFU + x, q_bytes + kv_bytes + ck_bytes,
                      nqb, bm, bn))
    bn = t.of("out")[0]
    fwd.append(launch("out", "elo_fwd_out", nqb * b * h, 2, 22 + 2 * (MUFU + x) + 12, q_bytes * 2 + 2 * kv_bytes + ck_bytes,
                      math.ceil(s / bn), bm, bn))
    bwd = []
    if delta_kernel:
        bwd.append(Launch("elo_attention", "elo_bwd_delta", (f"BLOCK_D={bd}",), math.ceil(s / 16) * b * h,
                          bytes=2 * q_bytes + b * h * s * 4, note="δ rows"))
    else:  # five torch passes, modelled as memory-bound row kernels of 4 warps
        bwd.append(Launch("elo_attention", "elo_bwd_delta", (f"BLOCK_D={bd}",), math.ceil(s / 16) * b * h,
                          bytes=14 * q_bytes + b * h * s * 4, note="torch: 5 passes"))
    bn = t.of("suffix")[0]
    bwd.append(launch("suffix", "elo_bwd_suffix", math.ceil(s / bn) * b * h, 2, 30 + 2 * (MUFU + x) + 24,
                      3 * q_bytes + 2 * kv_bytes + 2 * ck_bytes, nqb, bm, bn))
    bn = t.of("dq")[0]
    bwd.append(launch("dq", "elo_bwd_dq", nqb * b * h, 3, 30 + 2 * (MUFU + x) + 24, 3 * q_bytes + 2 * kv_bytes + 2 * ck_bytes,
                      math.ceil(s / bn), bm, bn))
    bn = t.of("dkdv")[0]
    bwd.append(launch("dkdv", "elo_bwd_dkdv", math.ceil(s / bn) * b * hkv, 4, 34 + 2 * (MUFU + x) + 24,
                      2 * q_bytes + 4 * kv_bytes + 2 * ck_bytes, (h // hkv) * nqb, bm, bn))
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def affine(shape, *, fused_epilogue: bool = False, two_level: bool = True) -> dict:
    """Affine-scaled attention's forward: the flash core writing O_flash in fp32, the v̄
    scan and the combine kernel. ``fused_epilogue``: the combine folded into the flash
    epilogue (O written once in bf16, no fp32 round trip, one launch fewer);
    ``two_level``: the v̄ scan over key chunks of 128 (chunk sums, then per chunk the
    prefix over chunks, 16 chunk sums per step, and an in-chunk cumsum), else the
    serial scan of 32-key steps it replaced."""
    b, s, h, hkv, d = shape
    bd = max(16, 1 << (d - 1).bit_length())
    q_bytes, kv_bytes = _bytes(shape)
    bm, bn = (128, 64) if bd <= 128 else (32, 16)
    tiles = causal_tiles(s, bm, bn)
    cfg = (f"BLOCK_D={bd}", "HAS_MASK=False", "HAS_WINDOW=False", f"BLOCK_M={bm}", f"BLOCK_N={bn}")
    o_bytes = q_bytes if fused_epilogue else 2 * q_bytes   # bf16 out, or fp32 O_flash
    flash = Launch("affine_scaled_attention", "flash_fwd", cfg + (("out=fp32",) if not fused_epilogue else ()),
                   math.ceil(s / bm) * b * h, tc_flops=b * h * tiles * 4 * bm * bn * d,
                   alu_slots=b * h * _elements(tiles, bm, bn) * (6 + MUFU),
                   bytes=q_bytes + 2 * kv_bytes + o_bytes + (kv_bytes if fused_epilogue else 0),
                   serial_steps=math.ceil(s / bn), note=f"{bm}×{bn}")
    dblocks = math.ceil(d / 32)
    if two_level:
        chunks = math.ceil(s / 128)
        programs = b * hkv * dblocks * chunks
        sums_bytes = b * hkv * chunks * d * 4
        prefix_bytes = b * hkv * d * 4 * chunks * (chunks - 1) // 2
        scan = [Launch("affine_scaled_attention", "vbar_chunk_sums", (), programs, bytes=kv_bytes + b * s + sums_bytes,
                       serial_steps=1, step_s=STEP_S, note=f"{chunks} chunks"),
                Launch("affine_scaled_attention", "vbar_expand", (), programs,
                       bytes=kv_bytes + b * s + prefix_bytes + 2 * kv_bytes + b * s * 4,
                       serial_steps=1 + math.ceil(chunks / 16), step_s=STEP_S, note=f"{chunks} chunks")]
    else:
        scan = [Launch("affine_scaled_attention", "vbar_scan", (), b * hkv * dblocks,
                       bytes=3 * kv_bytes + b * s * 5, serial_steps=math.ceil(s / 32), step_s=STEP_S, note="serial")]
    fwd = [flash, *scan]
    if not fused_epilogue:
        fwd.append(Launch("affine_scaled_attention", "affine_combine", (f"BLOCK_D={bd}",), math.ceil(b * s * h / 16),
                          bytes=2 * q_bytes + kv_bytes + q_bytes + b * s * h * 4, note="combine"))
    return {"fwd": fwd}
