import pytest
import torch

from laminae.primitives.laurel import laurel_reference
from laminae.triton_ops.laurel import laurel

from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

SHAPES = [(4 * 512, 1024, 32), (4 * 2048, 2048, 32), (8 * 2048, 4096, 64)]
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def _inputs(rows, d, rank):
    return {
        "sublayer_output": torch.randn(rows, d, device=DEVICE, dtype=DTYPE),
        "x": torch.randn(rows, d, device=DEVICE, dtype=DTYPE),
        "alpha_logit": torch.tensor(0.2, device=DEVICE),
        "beta_logit": torch.tensor(0.1, device=DEVICE),
        "lr_A": torch.randn(d, rank, device=DEVICE) / d**0.5,
        "lr_B": torch.randn(rank, d, device=DEVICE) / rank**0.5,
    }


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-D{s[1]}-r{s[2]}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_laurel(benchmark, provider, mode, shape):
    rows, d, rank = shape
    inputs = _inputs(rows, d, rank)
    # memory-bound: forward reads f (the sublayer output), x and writes y; the backward
    # reads dy, f, x (the mixing weights' gradients need f and x) and writes df, dx
    # ([N, D] each; the rank-r factors and their [N, r] products are small)
    nd = rows * d * inputs["x"].element_size()
    bytes_moved = by_mode(3 * nd, 8 * nd)
    run_benchmark(benchmark, name="laurel", provider=provider, mode=mode, op=laurel, reference=laurel_reference,
                  inputs=inputs, grad_names=list(inputs), shape=f"N={rows},D={d},r={rank}", bytes_moved=bytes_moved)
