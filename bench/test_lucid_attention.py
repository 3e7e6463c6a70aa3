import pytest

from laminae.primitives.lucid_attention import lucid_attention_reference
from laminae.triton_ops.lucid_attention import lucid_attention

from ._attention import SHAPES, attention_flops, qkv, shape_id
from ._harness import MODES, PROVIDERS, run_benchmark


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_lucid_attention(benchmark, provider, mode, shape):
    inputs = qkv(shape)
    # attention plus, per kv head, the causal Gram matrix K̂K̂ᵀ and the triangular solve
    # (one S×S×D product each, in units of the query heads' products: hkv/h); the
    # backward recomputes the Gram matrix, solves the transposed system and forms the
    # Gram and key gradients (four more)
    b, s, h, hkv, d = shape
    r = hkv / h
    flops = attention_flops(shape, forward_matmuls=2 + 2 * r, backward_matmuls=5 + 4 * r)
    run_benchmark(benchmark, name="lucid_attention", provider=provider, mode=mode, op=lucid_attention,
                  reference=lucid_attention_reference, inputs=inputs, grad_names=["q", "k", "v"],
                  shape=shape_id(shape), flops=flops)
