import pytest
import torch

from laminae.primitives.elo_attention import elo_attention_reference
from laminae.triton_ops.elo_attention import elo_attention

from ._attention import SHAPES, causal_flops, qkv, shape_id
from ._harness import DEVICE, MODES, PROVIDERS, run_benchmark


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_elo_attention(benchmark, provider, mode, shape):
    inputs = qkv(shape)
    h = shape[2]
    inputs["elo_log_k"] = torch.full((h,), 0.5, device=DEVICE)
    inputs["elo_gain"] = torch.full((h,), 0.2, device=DEVICE)
    grads = ["q", "k", "v", "elo_log_k", "elo_gain"]
    # three passes over the score matrix forward
    run_benchmark(benchmark, name="elo_attention", provider=provider, mode=mode, op=elo_attention,
                  reference=elo_attention_reference, inputs=inputs, grad_names=grads,
                  shape=shape_id(shape), flops=3 * causal_flops(shape))

