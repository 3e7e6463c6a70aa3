import pytest
import torch

from laminae.primitives.blocks.rotary import yarn_rope
from laminae.primitives.mosrah import mosrah_reference
from laminae.triton_ops.mosrah import mosrah

from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
# (batch, seq, width, heads L, selected K, head_dim): seed default, paper L = 64 sweep, a long sequence,
# and the goal shapes (B 8 × S 2048, hidden 1024; u 64 × L 16 and u 128 × L 8, every head selected as in
# the seed default, so each head's segment is the whole sequence: the work of dense causal attention)
SHAPES = [(2, 1024, 512, 16, 16, 16), (2, 1024, 512, 64, 16, 16), (1, 4096, 512, 32, 8, 64),
          (8, 2048, 1024, 16, 16, 64), (8, 2048, 1024, 8, 8, 128)]
GRADS = ["x", "routing_weight", "expert_bias", "q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-N{}-d{}-L{}-K{}-u{}".format(*s))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_mosrah(benchmark, provider, mode, shape):
    b, n, d, L, K, u = shape
    if DEVICE.type == "cpu" and n > 1024:
        pytest.skip("the padded CPU reference at this size takes minutes")
    rope = yarn_rope(u, 10000.0, n, n)
    inputs = {
        "x": torch.randn(b, n, d, device=DEVICE, dtype=DTYPE),
        "routing_weight": torch.randn(L, d, device=DEVICE, dtype=DTYPE) * 0.02,
        "expert_bias": torch.zeros(L, device=DEVICE, dtype=DTYPE),
        "q_proj": torch.randn(L, d, u, device=DEVICE, dtype=DTYPE) / d**0.5,
        "k_proj": torch.randn(L, d, u, device=DEVICE, dtype=DTYPE) / d**0.5,
        "v_proj": torch.randn(L, d, u, device=DEVICE, dtype=DTYPE) / d**0.5,
        "o_proj": torch.randn(L, u, d, device=DEVICE, dtype=DTYPE) / u**0.5,
        "position_ids": torch.arange(n, device=DEVICE).expand(b, n),
        "attention_mask": None,
        "top_k": K, "inv_freq": rope.inv_freq.to(DEVICE), "attention_scale": rope.attention_scale,
    }
    # selected work: projections 4·2·B·N·K·d·u (3× with their gradients), causal
    # attention ≈ 2·2·B·L·(NK/L)²/2·u (3.5× with its backward, as FlashAttention counts)
    proj, attn = 8 * b * n * K * d * u, 2 * b * L * (n * K / L) ** 2 * u
    flops = by_mode(proj + attn, 3 * proj + 3.5 * attn)
    # compulsory traffic of the Triton path (elements): x and h_s; dense q, k, v, Z and the weighted Z
    # over every (token, head) pair; the pack's gather and write of q̃, k̃, v per copy and the attention's
    # read of them. The backward moves about twice the forward (dZ, δ, the fp32 rotated dq̃/dk̃ and dx, dW).
    pairs, copies = b * n * L * u, b * n * K * u
    fwd_elems = 2 * b * n * d + 5 * pairs + 9 * copies
    size = torch.tensor([], dtype=DTYPE).element_size()
    bytes_moved = by_mode(fwd_elems * size, 3 * fwd_elems * size)
    run_benchmark(benchmark, name="mosrah", provider=provider, mode=mode, op=mosrah,
                  reference=mosrah_reference, inputs=inputs, grad_names=GRADS,
                  shape="B={},N={},d={},L={},K={},u={}".format(*shape), flops=flops, bytes_moved=bytes_moved)
