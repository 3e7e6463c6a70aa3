import pytest
import torch

from laminae.primitives.lucid_attention import LucidAttention, lucid_attention_reference
from laminae.triton_ops.lucid_attention import lucid_attention

from ._attention import DTYPE, SHAPES, attention_flops, qkv, shape_id
from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

# The goal shapes: bf16, B 8 · S 2048 (16k tokens), causal, head dim 64 × 16 heads and
# 128 × 8 heads, GQA 4:1 (the preconditioner is per kv head).
GOAL = [(8, 2048, 16, 4, 64), (8, 2048, 8, 2, 128)] if DEVICE.type == "cuda" else []


def lucid_flops(shape) -> dict:
    """Attention (QKᵀ, PV; backward 5) plus, per kv head, the products the
    preconditioner needs over the causal triangle, in units of the query heads'
    S×S×D products (hkv/h each): forward the Gram tiles K̂K̂ᵀ and the panels L·V′;
    backward the Gram tiles, the panels Lᵀ·dV, dV·V′ᵀ, and dS·K̂ for both triangles."""
    b, s, h, hkv, d = shape
    r = hkv / h
    return attention_flops(shape, forward_matmuls=2 + 2 * r, backward_matmuls=5 + 5 * r)


def lucid_bytes(shape) -> dict:
    """Compulsory traffic in the benchmark dtype: q, k, v read and O written; the
    backward also reads dO and writes dq, dk, dv."""
    b, s, h, hkv, d = shape
    item = torch.finfo(DTYPE).bits // 8
    fwd = (2 * b * s * h * d + 2 * b * s * hkv * d) * item
    return by_mode(fwd, 2 * fwd + (b * s * h * d) * item)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)   # the goal shapes on GPU
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_lucid_attention(benchmark, provider, mode, shape):
    inputs = qkv(shape)
    run_benchmark(benchmark, name="lucid_attention", provider=provider, mode=mode, op=lucid_attention,
                  reference=lucid_attention_reference, inputs=inputs, grad_names=["q", "k", "v"],
                  shape=shape_id(shape), flops=lucid_flops(shape), bytes_moved=lucid_bytes(shape))


@pytest.mark.parametrize("shape", GOAL, ids=shape_id)
@pytest.mark.parametrize("provider", ["eager", "triton"])
def test_lucid_decode_step(benchmark, provider, shape):
    """One decoding step after a cache of S tokens: the new row of L against the cache
    (reads the cached keys and V′: 4·S·D FLOPs per kv head) and the attention of the
    new query over the cache. eager: the module on backend="reference"."""
    b, s, h, hkv, d = shape
    core = LucidAttention(h, hkv, d, backend="triton" if provider == "triton" else "reference")
    prompt = qkv((b, s, h, hkv, d), mask=False)
    with torch.no_grad():
        _, cache = core(prompt["q"], prompt["k"], prompt["v"])
    step = qkv((b, 1, h, hkv, d), mask=False)

    def decode(q, k, v):
        return core(q, k, v, cache=cache)[0]

    item = torch.finfo(DTYPE).bits // 8
    cache_bytes = b * s * hkv * d * (item + 4)  # raw keys and fp32 V′, read once by the row update
    flops = 4 * b * s * hkv * d + 4 * b * s * h * d
    run_benchmark(benchmark, name="lucid_decode_step", provider=provider, mode="fwd", op=decode, reference=decode, inputs=step, grad_names=[], shape=shape_id(shape),
                  flops=flops, bytes_moved=cache_bytes)
