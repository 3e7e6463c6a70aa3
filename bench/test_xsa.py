import pytest
import torch

from laminae.primitives.xsa import xsa_reference
from laminae.triton_ops.xsa import xsa

from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

# (batch, seq, heads, kv_heads, head_dim)
SHAPES = [(4, 512, 8, 8, 64), (4, 2048, 8, 2, 64), (4, 2048, 16, 4, 128)]
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-S{}-H{}-KV{}-D{}".format(*s))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_xsa(benchmark, provider, mode, shape):
    b, s, h, hkv, d = shape
    inputs = {"y": torch.randn(b, s, h, d, device=DEVICE, dtype=DTYPE),
              "v": torch.randn(b, s, hkv, d, device=DEVICE, dtype=DTYPE)}
    # forward reads y, v and writes out; the backward reads dout, y, v, writes dy, dv
    e = inputs["y"].element_size()
    per_q, per_kv = b * s * h * d * e, b * s * hkv * d * e
    bytes_moved = by_mode(2 * per_q + per_kv, 5 * per_q + 3 * per_kv)
    run_benchmark(benchmark, name="xsa", provider=provider, mode=mode, op=xsa, reference=xsa_reference,
                  inputs=inputs, grad_names=["y", "v"], shape="B={},S={},H={},KV={},D={}".format(*shape),
                  bytes_moved=bytes_moved)
