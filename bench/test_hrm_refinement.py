import pytest
import torch

from laminae.primitives.hrm_refinement import hrm_refinement_reference
from laminae.triton_ops.hrm_refinement import hrm_refinement

from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

# (rows = batch·seq, hidden D, refine_dim R, steps T)
SHAPES = [(4 * 512, 1024, 256, 2), (4 * 2048, 2048, 512, 2), (8 * 2048, 4096, 512, 3)]
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
GRADS = ["x", "norm_weight", "down_weight", "up_weight", "gate"]


def _inputs(rows, d, refine, steps):
    return {
        "x": torch.randn(rows, d, device=DEVICE, dtype=DTYPE),
        "norm_weight": 1 + 0.1 * torch.randn(d, device=DEVICE),
        "down_weight": torch.randn(refine, 2 * d, device=DEVICE) / (2 * d) ** 0.5,
        "up_weight": torch.randn(d, refine, device=DEVICE) / refine**0.5,
        "gate": torch.ones(steps, device=DEVICE),
    }


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-D{s[1]}-R{s[2]}-T{s[3]}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_hrm_refinement(benchmark, provider, mode, shape):
    rows, d, refine, steps = shape
    # forward matmul FLOPs of the seed formulation: down over the [N, 2D] concat + up, per step
    # (the backward forms two products per forward one: input and weight gradients)
    fwd = steps * (2 * rows * 2 * d * refine + 2 * rows * refine * d)
    flops = by_mode(fwd, 3 * fwd)
    run_benchmark(benchmark, name="hrm_refinement", provider=provider, mode=mode, op=hrm_refinement,
                  reference=hrm_refinement_reference, inputs=_inputs(rows, d, refine, steps), grad_names=GRADS,
                  shape=f"N={rows},D={d},R={refine},T={steps}", flops=flops)
