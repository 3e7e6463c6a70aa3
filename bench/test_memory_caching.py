import pytest
import torch

from laminae.primitives.memory_caching import memory_caching_reference
from laminae.triton_ops.memory_caching import memory_caching

from ._harness import DEVICE, MODES, PROVIDERS, run_benchmark

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
# (batch, seq, heads, head_dim, gate_dim, segment_len)
SHAPES = [(1, 512, 4, 32, 64, 64), (1, 2048, 4, 32, 64, 64), (4, 2048, 4, 64, 64, 128)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-S{}-H{}-D{}-G{}-L{}".format(*s))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_memory_caching(benchmark, provider, mode, shape):
    b, s, h, d, g, seg = shape
    if DEVICE.type == "cpu" and b > 1:
        pytest.skip("the CPU reference at this size takes minutes")
    inputs = {n: 0.5 * torch.randn(*sh, device=DEVICE, dtype=DTYPE)
              for n, sh in (("q", (b, s, h, d)), ("k", (b, s, h, d)), ("v", (b, s, h, d)),
                            ("u", (b, s, g)), ("p", (b, s, g)))}
    inputs["segment_len"] = seg
    run_benchmark(benchmark, name="memory_caching", provider=provider, mode=mode, op=memory_caching,
                  reference=memory_caching_reference, inputs=inputs, grad_names=["q", "k", "v", "u", "p"],
                  shape="B={},S={},H={},D={},G={},L={}".format(*shape))
