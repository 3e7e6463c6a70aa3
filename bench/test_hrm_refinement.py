import pytest
import torch

from laminae.primitives.hrm_refinement import hrm_refinement_reference
from laminae.triton_ops.hrm_refinement import hrm_refinement

from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

# (rows = batch·seq, hidden D, refine_dim R, steps T)
SHAPES = [(4 * 512, 1024, 256, 2), (8 * 2048, 1024, 256, 3), (4 * 2048, 2048, 512, 2), (8 * 2048, 4096, 512, 3)]
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
    # activation traffic of the kernel path, in elements: forward, the anchor projection
    # and per step the row kernel (h, u in; h_t, n_t out), addmm (n_t, a in; z_t out), SiLU
    # and the up GEMM; backward per step about twice that plus the fp32 δ read and written
    # by the row kernel (weights are small next to [N, D] rows and left out)
    size = DTYPE.itemsize
    fwd_bytes = size * (rows * (d + refine) + steps * rows * (6 * d + 5 * refine))
    bwd_bytes = 2 * fwd_bytes + steps * rows * d * 8
    run_benchmark(benchmark, name="hrm_refinement", provider=provider, mode=mode, op=hrm_refinement,
                  reference=hrm_refinement_reference, inputs=_inputs(rows, d, refine, steps), grad_names=GRADS,
                  shape=f"N={rows},D={d},R={refine},T={steps}", flops=flops,
                  bytes_moved=by_mode(fwd_bytes, fwd_bytes + bwd_bytes))
