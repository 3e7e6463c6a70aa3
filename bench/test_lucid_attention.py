import pytest

from laminae.primitives.lucid_attention import lucid_attention_reference
from laminae.triton_ops.lucid_attention import lucid_attention

from ._attention import SHAPES, causal_flops, qkv, shape_id
from ._harness import MODES, PROVIDERS, run_benchmark


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_lucid_attention(benchmark, provider, mode, shape):
    inputs = qkv(shape)
    # attention plus the triangular solve (another causal S×S×D product per kv head)
    b, s, h, hkv, d = shape
    flops = causal_flops(shape) * (1 + hkv / h)
    run_benchmark(benchmark, name="lucid_attention", provider=provider, mode=mode, op=lucid_attention,
                  reference=lucid_attention_reference, inputs=inputs, grad_names=["q", "k", "v"],
                  shape=shape_id(shape), flops=flops)
