"""Inputs and the SDPA baseline shared by the attention benchmarks."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._harness import DEVICE

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
# (batch, seq, heads, kv_heads, head_dim). On GPU B=4, S=2048, 8×64 is the headline
# shape; the CPU reference runs batch 1 so the materialised [S, S] matrices stay small.
_B = 4 if DEVICE.type == "cuda" else 1
SHAPES = [(_B, 512, 8, 8, 64), (_B, 2048, 8, 8, 64), (_B, 2048, 8, 2, 64)]


def shape_id(s) -> str:
    return "B{}-S{}-H{}-KV{}-D{}".format(*s)


def qkv(shape, *, mask: bool = True) -> dict:
    b, s, h, hkv, d = shape
    out = {
        "q": torch.randn(b, s, h, d, device=DEVICE, dtype=DTYPE),
        "k": torch.randn(b, s, hkv, d, device=DEVICE, dtype=DTYPE),
        "v": torch.randn(b, s, hkv, d, device=DEVICE, dtype=DTYPE),
    }
    if mask:
        keep = torch.ones(b, s, dtype=torch.bool, device=DEVICE)
        keep[0, : s // 8] = False  # one left-padded row
        out["key_mask"] = keep
    return out


def causal_flops(shape) -> float:
    b, s, h, _, d = shape
    return 2 * 2 * b * h * d * s * s / 2  # QKᵀ and PV, half the matrix


def sdpa(q, k, v, key_mask=None, **_):
    """Causal softmax attention through PyTorch SDPA (flash/cuDNN on GPU), batch-first."""
    h, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=h != hkv).transpose(1, 2)
