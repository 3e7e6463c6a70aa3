import pytest
import torch

from laminae.primitives.leviathan import LeviathanGenerator, leviathan_reference
from laminae.triton_ops.leviathan import leviathan

from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

# NeoLLM's defaults: V = 64402, D = 512, d = 128, h = 8, κ = 16, r = 64, k = 3. Tokens per
# step: a 4×2048 and an 8×2048 batch on GPU; the CPU reference materialises B and φ
# (0.3 MB per token in fp32), so CPU runs stop at 2048 tokens.
TOKENS = [8 * 2048, 4 * 2048, 512] if DEVICE.type == "cuda" else [2048, 512]
# The reference does not depend on the id distribution, so CPU runs (reference only) use one.
DISTRIBUTIONS = ["uniform", "zipf"] if DEVICE.type == "cuda" else ["uniform"]
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
NAMES = ["codebooks", "head_proj_weight", "head_norm_weight", "head_norm_bias", "head_spline_delta", "head_out_weight"]


def _ids(tokens: int, distribution: str, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if distribution == "uniform":     # every id distinct in practice: the worst case for unique-id evaluation
        return torch.randint(0, vocab, (tokens,), generator=gen)
    # Zipf(1.1) over a shuffled vocabulary, the shape of natural-language token counts
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    return torch.randperm(vocab, generator=gen)[torch.multinomial(probs, tokens, replacement=True, generator=gen)]


def _inputs(tokens: int, distribution: str) -> dict:
    torch.manual_seed(0)
    gen = LeviathanGenerator().to(DEVICE, DTYPE)
    params = {k: p.detach() for k, p in zip(NAMES, gen._params())}
    return {"input_ids": _ids(tokens, distribution, gen.vocab_size).to(DEVICE), **params, "knot_grid": gen.knot_grid}


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.parametrize("tokens", TOKENS, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_leviathan(benchmark, provider, mode, tokens, distribution):
    inputs = _inputs(tokens, distribution)
    h, d, knots, rank = inputs["head_spline_delta"].shape
    hidden = inputs["head_out_weight"].shape[-1]
    # per token, forward: projection, dense basis·coefficient products, output projection
    # (the backward forms two products per forward one). These are the mechanism's FLOPs;
    # the kernels spend 3 (forward) and 12 (backward) bf16 tensor-core products per fp32
    # basis·coefficient product to keep fp32 accuracy (docs/benchmarks.md).
    fwd = tokens * (2 * h * d * d + 2 * h * d * knots * rank + 2 * h * rank * hidden)
    flops = by_mode(fwd, 3 * fwd)
    run_benchmark(benchmark, name="leviathan", provider=provider, mode=mode, op=leviathan,
                  reference=leviathan_reference, inputs=inputs, grad_names=NAMES,
                  shape=f"N={tokens},{distribution},V=64402,D=512,d=128,h=8,κ=16,r=64", flops=flops)
