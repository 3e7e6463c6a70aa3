import pytest
import torch

from laminae.primitives.affine_scaled_attention import affine_scaled_attention_reference
from laminae.triton_ops.affine_scaled_attention import affine_scaled_attention

from ._attention import SHAPES, attention_flops, qkv, shape_id
from ._harness import DEVICE, MODES, PROVIDERS, run_benchmark


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_affine_scaled_attention(benchmark, provider, mode, shape):
    b, s, h, _, _ = shape
    inputs = qkv(shape)
    inputs["alpha"] = torch.rand(b, s, h, device=DEVICE)
    inputs["alpha_ma"] = torch.full((h,), 0.4, device=DEVICE)
    run_benchmark(benchmark, name="affine_scaled_attention", provider=provider, mode=mode,
                  op=affine_scaled_attention, reference=affine_scaled_attention_reference, inputs=inputs,
                  grad_names=["q", "k", "v", "alpha"], shape=shape_id(shape), flops=attention_flops(shape))
