"""PyTorch SDPA (causal softmax attention) on the attention benchmarks' shapes: the
yardstick every attention mechanism is compared against."""
import pytest

from ._attention import SHAPES, attention_flops, qkv, sdpa, shape_id
from ._harness import MODES, run_benchmark


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("mode", MODES)
def test_sdpa_baseline(benchmark, mode, shape):
    inputs = qkv(shape, mask=False)
    run_benchmark(benchmark, name="sdpa (baseline)", provider="eager", mode=mode, op=sdpa, reference=sdpa,
                  inputs=inputs, grad_names=["q", "k", "v"], shape=shape_id(shape), flops=attention_flops(shape))
