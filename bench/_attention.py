"""Inputs and the SDPA baseline shared by the attention benchmarks."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._harness import DEVICE

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
# (batch, seq, heads, kv_heads, head_dim). On GPU: the headline B 4, S 2048, 8×64 with
# and without GQA, then head_dim 128 at S 4096 and S 8192 (where the eager references'
# [S, S] matrices take gigabytes: what the fused kernels exist to avoid). The CPU
# reference runs small shapes so the materialised matrices stay small.
if DEVICE.type == "cuda":
    SHAPES = [(4, 2048, 8, 8, 64), (4, 2048, 8, 2, 64), (2, 4096, 16, 16, 128), (1, 8192, 16, 16, 128)]
else:
    SHAPES = [(1, 512, 8, 8, 64), (1, 1024, 8, 2, 64), (1, 1024, 4, 4, 128)]


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
        out["attention_mask"] = keep
    return out


def causal_flops(shape) -> float:
    """Forward FLOPs of causal attention: QKᵀ and PV over half the [S, S] matrix."""
    b, s, h, _, d = shape
    return 2 * 2 * b * h * d * s * s / 2


def attention_flops(shape, forward_matmuls: float = 2, backward_matmuls: float = 5) -> dict:
    """Per-mode FLOPs of a causal attention-shaped mechanism doing ``forward_matmuls``
    S×S×D products forward and ``backward_matmuls`` backward (softmax attention: 2 and
    5 — QKᵀ recomputed, dV, dP, dQ, dK — so fwd+bwd is 3.5× the forward)."""
    one = causal_flops(shape) / 2
    return {"fwd": forward_matmuls * one, "fwd+bwd": (forward_matmuls + backward_matmuls) * one}


def sdpa(q, k, v, attention_mask=None, **_):
    """Causal softmax attention through PyTorch SDPA (flash/cuDNN on GPU), batch-first."""
    h, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=h != hkv).transpose(1, 2)
