"""Inputs and the SDPA baseline shared by the attention benchmarks."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._harness import DEVICE

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
# (batch, seq, heads, kv_heads, head_dim). On GPU: the goal shapes (B 8 · S 2048 = 16k
# tokens, hidden 1024, causal), head dim 64 × 16 heads and 128 × 8 heads, each without
# and with GQA 4:1. The CPU reference runs small shapes so the materialised [S, S]
# matrices stay small.
if DEVICE.type == "cuda":
    SHAPES = [(8, 2048, 16, 16, 64), (8, 2048, 16, 4, 64), (8, 2048, 8, 8, 128), (8, 2048, 8, 2, 128)]
else:
    SHAPES = [(1, 512, 8, 8, 64), (1, 1024, 8, 2, 64), (1, 1024, 4, 4, 128)]


def shape_id(s) -> str:
    return "B{}-S{}-H{}-KV{}-D{}".format(*s)


def qkv(shape, *, mask: bool = False) -> dict:
    """q, k, v of ``shape``; with ``mask``, a key keep mask (one left-padded row) that
    :func:`sdpa` honours too, so an op and the baseline always see the same mask."""
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
    """Causal softmax attention through PyTorch SDPA (flash/cuDNN on GPU), batch-first.

    A ``(B, N)`` key keep mask is applied with the causal mask as one boolean
    ``[B, 1, S, N]`` mask (SDPA then leaves the flash kernel for the memory-efficient
    one): the baseline sees exactly the mask the op under test sees. A query row with
    no visible key is 0, as in the laminae cores."""
    h, hkv = q.shape[2], k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if attention_mask is None:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=h != hkv).transpose(1, 2)
    s, n = q.shape[1], k.shape[1]
    causal = torch.ones(s, n, dtype=torch.bool, device=q.device).tril(n - s)
    visible = causal[None, None] & attention_mask.bool()[:, None, None, :]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=visible, enable_gqa=h != hkv)
    return torch.where(visible.any(-1, keepdim=True), out, 0.0).transpose(1, 2)
