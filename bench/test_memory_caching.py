import pytest
import torch

from laminae.primitives.memory_caching import memory_caching_reference
from laminae.triton_ops.memory_caching import memory_caching

from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
# (batch, seq, heads, head_dim, gate_dim, segment_len)
SHAPES = [(1, 512, 4, 32, 64, 64), (1, 2048, 4, 32, 64, 64), (4, 2048, 4, 64, 64, 128)]


def work(shape, mode: str, elem_bytes: int) -> tuple[float, float]:
    """(FLOPs, minimal bytes) of the kernels' useful work, per batch·head:
    own-segment pairs m ≤ t (P = N·L(L+1)/2) at 2·D per dot; memory reads (R = L·N(N−1)/2,
    token t of segment s reads s memories) at 2·D² each; building the memories 2·S·D².
    Forward: 2 pair dots, 1 read product, the build. Backward: 7 pair dots (dq 3,
    dk/dv 4), 2 read products (dq, dM), the rebuild and the memory share of dk, dv
    (2 · 2·S·D²). Bytes: q, k, v read and y written (fwd; gates and memories are
    O(S·N) and O(N·D²), L2-resident)."""
    b, s, h, d, _, seg = shape
    n = -(-s // seg)
    pairs = n * seg * (seg + 1) / 2
    reads = seg * n * (n - 1) / 2
    fwd = 2 * 2 * d * pairs + 2 * d * d * reads + 2 * s * d * d
    bwd = 7 * 2 * d * pairs + 2 * 2 * d * d * reads + 3 * 2 * s * d * d
    flops = b * h * (fwd if mode == "fwd" else fwd + bwd)
    return flops, (4.0 * b * s * h * d * elem_bytes if mode == "fwd" else None)


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
    (fwd_flops, bytes_moved), (all_flops, _) = (work(shape, m, DTYPE.itemsize) for m in MODES)
    flops = by_mode(fwd_flops, all_flops)
    run_benchmark(benchmark, name="memory_caching", provider=provider, mode=mode, op=memory_caching,
                  reference=memory_caching_reference, inputs=inputs, grad_names=["q", "k", "v", "u", "p"],
                  shape="B={},S={},H={},D={},G={},L={}".format(*shape), flops=flops, bytes_moved=bytes_moved)
