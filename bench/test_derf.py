import pytest
import torch

from laminae.primitives.derf import derf_attention_reference, derf_context_gate_reference
from laminae.triton_ops.derf import derf_attention, derf_context_gate

from ._attention import DTYPE, SHAPES, attention_flops, qkv, shape_id
from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

GATE_SHAPES = [(4 * 512, 1024), (4 * 2048, 2048)]


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_derf_attention(benchmark, provider, mode, shape):
    h = shape[2]
    inputs = qkv(shape)
    inputs.update(derf_alpha=torch.ones(h, device=DEVICE), derf_bias=torch.zeros(h, device=DEVICE),
                  derf_gamma=torch.ones(h, device=DEVICE))
    run_benchmark(benchmark, name="derf_attention", provider=provider, mode=mode, op=derf_attention,
                  reference=derf_attention_reference, inputs=inputs,
                  grad_names=["q", "k", "v", "derf_alpha", "derf_bias", "derf_gamma"],
                  shape=shape_id(shape), flops=attention_flops(shape))


@pytest.mark.parametrize("shape", GATE_SHAPES, ids=lambda s: f"N{s[0]}-F{s[1]}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_derf_context_gate(benchmark, provider, mode, shape):
    rows, f = shape
    inputs = {"retrieved": torch.randn(rows, f, device=DEVICE, dtype=DTYPE),
              "logits": torch.randn(rows, f, device=DEVICE, dtype=DTYPE),
              "alpha": torch.ones(f, device=DEVICE), "bias": torch.full((f,), -4.0, device=DEVICE),
              "gamma": torch.ones(f, device=DEVICE)}
    # reads retrieved, logits, writes out; the backward reads dout and both inputs, writes two gradients
    nf = rows * f * inputs["retrieved"].element_size()
    run_benchmark(benchmark, name="derf_context_gate", provider=provider, mode=mode, op=derf_context_gate,
                  reference=derf_context_gate_reference, inputs=inputs, grad_names=list(inputs),
                  shape=f"N={rows},F={f}", bytes_moved=by_mode(3 * nf, 8 * nf))
