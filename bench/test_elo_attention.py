import pytest
import torch

from laminae.primitives.elo_attention import elo_attention_reference
from laminae.triton_ops.elo_attention import MATMUL_PASSES, elo_attention

from ._attention import SHAPES, qkv, shape_id
from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark


def matmul_passes(mode: str) -> int:
    return MATMUL_PASSES["fwd"] + (MATMUL_PASSES["bwd"] if mode == "fwd+bwd" else 0)


def elo_flops(shape, mode: str) -> float:
    """2 FLOPs per multiply-add of every matmul the kernels run: each pass is a
    [S, D]·[D, S] or [S, S]·[S, D] product over the causal half (the convention of
    ``causal_flops``, so rates compare with SDPA's), per query head."""
    b, s, h, _, d = shape
    return matmul_passes(mode) * 2 * b * h * d * s * s / 2


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_elo_attention(benchmark, provider, mode, shape):
    inputs = qkv(shape)
    h = shape[2]
    inputs["elo_log_k"] = torch.full((h,), 0.5, device=DEVICE)
    inputs["elo_gain"] = torch.full((h,), 0.2, device=DEVICE)
    grads = ["q", "k", "v", "elo_log_k", "elo_gain"]
    run_benchmark(benchmark, name="elo_attention", provider=provider, mode=mode, op=elo_attention,
                  reference=elo_attention_reference, inputs=inputs, grad_names=grads,
                  shape=shape_id(shape), flops=by_mode(elo_flops(shape, "fwd"), elo_flops(shape, "fwd+bwd")))
    benchmark.extra_info["matmul_passes"] = matmul_passes(mode)
