import pytest
import torch

from laminae.primitives.siamese_norm import siamese_boundary_reference
from laminae.triton_ops.siamese_norm import siamese_boundary

from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

SHAPES = [(4 * 512, 1024), (4 * 2048, 2048), (8 * 2048, 4096)]
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def _inputs(rows, d):
    def w():
        return 1 + 0.1 * torch.randn(d, device=DEVICE)

    return {
        "x": torch.randn(rows, d, device=DEVICE, dtype=DTYPE),
        "y": torch.randn(rows, d, device=DEVICE, dtype=DTYPE),
        "update": torch.randn(rows, d, device=DEVICE, dtype=DTYPE),
        "c_inv": 0.5,
        "x_scale": w(), "x_norm_weight": w(), "y_norm_weight": w(), "in_norm_weight": w(),
    }


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-D{s[1]}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_siamese_norm(benchmark, provider, mode, shape):
    rows, d = shape
    inputs = _inputs(rows, d)
    grads = [k for k, v in inputs.items() if isinstance(v, torch.Tensor)]
    # MLP boundary: reads x, y, update, writes X', Y', h; the backward reads the three
    # upstream gradients and x, y, update again and writes dx, dy, dupdate
    nd = rows * d * inputs["x"].element_size()
    bytes_moved = by_mode(6 * nd, 15 * nd)
    run_benchmark(benchmark, name="siamese_norm", provider=provider, mode=mode, op=siamese_boundary,
                  reference=siamese_boundary_reference, inputs=inputs, grad_names=grads,
                  shape=f"N={rows},D={d}", bytes_moved=bytes_moved)
