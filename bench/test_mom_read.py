import pytest
import torch

from laminae.primitives.mom_read import mom_read_reference
from laminae.triton_ops.mom_read import mom_read

from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
# (batch, seq, heads, head_dim, blocks, block_size, top_blocks); the last is the
# Naylis reference run's layer (D 1024, 16 heads, 8 blocks of 128 slots, top 2)
SHAPES = [(1, 512, 8, 64, 32, 16, 4), (1, 2048, 8, 64, 32, 16, 4), (4, 2048, 8, 64, 64, 32, 4),
          (1, 2048, 16, 64, 8, 128, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-S{}-H{}-D{}-E{}-bs{}-k{}".format(*s))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_mom_read(benchmark, provider, mode, shape):
    b, s, h, d, e, bs, tk = shape
    if DEVICE.type == "cpu" and b > 1:
        pytest.skip("the dense CPU reference at this size takes minutes")
    top_values, top_idx = torch.randn(b, s, e, device=DEVICE).topk(tk, dim=-1)
    inputs = {
        "q": torch.randn(b, s, h, d, device=DEVICE, dtype=DTYPE),
        "k_bank": torch.randn(e * bs, h * d, device=DEVICE, dtype=DTYPE),
        "v_bank": torch.randn(e * bs, h * d, device=DEVICE, dtype=DTYPE),
        "top_idx": top_idx,
        "top_gates": torch.softmax(top_values, -1),
        "block_size": bs,
    }
    # selected slots only: 2·2·B·S·H·d·(top·bs) forward, 3.5× with the backward
    # (scores recomputed, dV, dP, dQ, dK), as attention counts
    flops = by_mode(4 * b * s * h * d * tk * bs, 14 * b * s * h * d * tk * bs)
    # Triton forward: q in, o out, the bank once, the per-pair partials (o in the input
    # dtype, fp32 log-partition) written by the pair kernel and read by the merge
    elt = torch.tensor([], dtype=DTYPE).element_size()
    bytes_moved = (2 * b * s * h * d * elt + 2 * e * bs * h * d * elt
                   + 2 * b * s * tk * h * (d * elt + 4))
    run_benchmark(benchmark, name="mom_read", provider=provider, mode=mode, op=mom_read,
                  reference=mom_read_reference, inputs=inputs, grad_names=["q", "k_bank", "v_bank", "top_gates"],
                  shape="B={},S={},H={},D={},E={},bs={},k={}".format(*shape), flops=flops,
                  bytes_moved=bytes_moved)
