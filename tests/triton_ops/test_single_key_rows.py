"""A query that sees one key, in 16 bits: every flash-style kernel against the float64 truth.

Such a row (the first query of every causal sequence, the first kept one after left
padding) has out = v_j exactly, whatever the weight; the gradients of everything but
the value reaching it are 0 in the truth, up to the 1e-8-type terms of a normaliser.
A kernel whose numerator and denominator, or whose δ = dO·O and dO·v, round the same
quantity differently leaves a 16-bit ulp of noise there instead, a whole gradient's
worth. The upstream gradient is nonzero only on those rows, so every gradient is
checked where the truth is (almost) 0.
"""
import pytest
import torch

from laminae.triton_ops.tour import _cast

from .._helpers import DEVICE

B, S, H, HKV, D = 2, 12, 2, 1, 16
PAD = 3   # left padding of the second row: its query PAD sees only key PAD


def _keep():
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, :PAD] = False
    return keep


def _rows():
    rows = torch.zeros(B, S, dtype=torch.bool)
    rows[0, 0] = rows[1, PAD] = True
    return rows


def _qkv(gen):
    return {"q": torch.randn(B, S, H, D, generator=gen), "k": torch.randn(B, S, HKV, D, generator=gen),
            "v": torch.randn(B, S, HKV, D, generator=gen)}


def _derf(gen):
    from laminae.primitives.derf import derf_attention_reference
    from laminae.triton_ops.derf import derf_attention

    inputs = {**_qkv(gen), "derf_alpha": 1 + 0.5 * torch.randn(H, generator=gen),
              "derf_bias": torch.randn(H, generator=gen) - 0.5, "derf_gamma": 0.5 + torch.rand(H, generator=gen),
              "attention_mask": _keep()}
    return derf_attention, derf_attention_reference, inputs, _rows()


def _elo(gen):
    from laminae.primitives.elo_attention import elo_attention_reference
    from laminae.triton_ops.elo_attention import elo_attention

    inputs = {**_qkv(gen), "elo_log_k": 0.5 * torch.randn(H, generator=gen),
              "elo_gain": 0.6 * torch.randn(H, generator=gen), "prior_rating": torch.randn(B, H, S, generator=gen),
              "attention_mask": _keep()}
    return elo_attention, elo_attention_reference, inputs, _rows()


def _affine(gen):
    from laminae.primitives.affine_scaled_attention import affine_scaled_attention_reference
    from laminae.triton_ops.affine_scaled_attention import affine_scaled_attention

    inputs = {**_qkv(gen), "alpha": torch.rand(B, S, H, generator=gen), "alpha_ma": torch.rand(H, generator=gen),
              "attention_mask": _keep()}
    return affine_scaled_attention, affine_scaled_attention_reference, inputs, _rows()


def _lucid(gen):
    from laminae.primitives.lucid_attention import lucid_attention_reference
    from laminae.triton_ops.lucid_attention import lucid_attention

    return lucid_attention, lucid_attention_reference, {**_qkv(gen), "attention_mask": _keep()}, _rows()


def _mosrah(gen):
    from laminae.primitives.mosrah import mosrah_reference, yarn_rope
    from laminae.triton_ops.mosrah import mosrah

    d, L, K, u = 32, 4, 2, 16
    rope = yarn_rope(u, 10000.0, 64, 256, 1.0, 8.0)
    keep = _keep()
    inputs = {"x": torch.randn(B, S, d, generator=gen), "routing_weight": 0.3 * torch.randn(L, d, generator=gen),
              "expert_bias": 0.1 * torch.randn(L, generator=gen),
              "q_proj": torch.randn(L, d, u, generator=gen) / d**0.5,
              "k_proj": torch.randn(L, d, u, generator=gen) / d**0.5,
              "v_proj": torch.randn(L, d, u, generator=gen) / d**0.5,
              "o_proj": torch.randn(L, u, d, generator=gen) / u**0.5,
              "position_ids": (keep.long().cumsum(1) - 1).clamp_min(0), "attention_mask": keep,
              "top_k": K, "inv_freq": rope.inv_freq, "attention_scale": rope.attention_scale}
    # a token's copies are the first of their heads' segments: each sees one key
    return mosrah, mosrah_reference, inputs, _rows()


def _mom_read(gen):
    from laminae.primitives.mom_read import mom_read_reference
    from laminae.triton_ops.mom_read import mom_read

    E = 6
    q = torch.randn(B, S, H, D, generator=gen)
    top_idx = torch.randn(B, S, E, generator=gen).topk(1, dim=-1).indices
    # one block of one slot per token: every read sees one key
    inputs = {"q": q, "k_bank": torch.randn(E, H * D, generator=gen), "v_bank": torch.randn(E, H * D, generator=gen),
              "top_idx": top_idx, "top_gates": torch.ones(B, S, 1), "block_size": 1}
    return mom_read, mom_read_reference, inputs, torch.ones(B, S, dtype=torch.bool)


def _memory_caching(gen):
    from laminae.primitives.memory_caching import memory_caching_reference
    from laminae.triton_ops.memory_caching import memory_caching

    G = 4
    inputs = {n: 0.5 * torch.randn(B, S, H, D, generator=gen) for n in ("q", "k", "v")}
    inputs.update(u=0.5 * torch.randn(B, S, G, generator=gen), p=0.5 * torch.randn(B, S, G, generator=gen),
                  segment_len=4, attention_mask=_keep())
    return memory_caching, memory_caching_reference, inputs, _rows()


KERNELS = {"derf": _derf, "elo_attention": _elo, "affine_scaled_attention": _affine, "lucid_attention": _lucid,
           "mosrah": _mosrah, "mom_read": _mom_read, "memory_caching": _memory_caching}
# floating inputs that are not differentiated: MoSRAH's rotary frequencies, and its
# expert bias, which only steers the (discrete) routing
CONSTANT = {"inv_freq", "expert_bias"}


def _output(out):
    return out[0] if isinstance(out, tuple) else out


def _grads(fn, inputs, names, upstream, wide=None):
    """The gradients of ``names`` for the upstream gradient ``upstream(out)``."""
    leaves = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()
            if wide is not None and value.is_floating_point():
                value = value.to(wide)
            value.requires_grad_(name in names)
        leaves[name] = value
    out = _output(fn(**leaves))
    return torch.autograd.grad(out, [leaves[n] for n in names], upstream(out).to(out.device, out.dtype))


# bf16 for every kernel (the training dtype, and the coarser one); fp16 where its
# narrow range takes a path of its own (DERF rescales its weights by the row's max)
CASES = [(stem, torch.bfloat16) for stem in KERNELS] + [("derf", torch.float16)]


@pytest.mark.parametrize("stem, dtype", CASES, ids=[f"{s}-{str(d)[6:]}" for s, d in CASES])
def test_gradients_of_a_row_that_sees_one_key_are_the_truth(stem, dtype):
    gen = torch.Generator().manual_seed(0)
    op, reference, inputs, rows = KERNELS[stem](gen)
    inputs = {n: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for n, v in _cast(inputs, dtype).items()}
    names = [n for n, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
             and n not in CONSTANT]
    drawn = []

    def upstream(out):   # drawn once, in the op's dtype: both sides backpropagate these values
        if not drawn:
            g = torch.randn(out.shape, generator=gen) * rows.view(B, S, *[1] * (out.dim() - 2))
            drawn.append(g.to(dtype))
        return drawn[0]

    got = _grads(op, inputs, names, upstream)
    truth = _grads(reference, inputs, names, upstream, torch.float64)
    eps = torch.finfo(dtype).eps
    scale = max(float(t.abs().max()) for t in truth)   # the value path's, O(|dO|)
    for name, a, t in zip(names, got, truth):
        a = a.double()
        if float(t.abs().max()) <= 1e-3 * scale:
            # what the truth makes 0 is 0 to 1/64 of a 16-bit ulp of the problem's scale
            # (fp32 rounding is ~1e-5 of it; the defect is a whole ulp)
            err = float((a - t).abs().max())
            assert err <= eps * scale / 64, f"d{name}: {err:.3e} where the truth is {float(t.abs().max()):.1e}"
        else:
            # a gradient the truth has: two ulps RMS (16-bit operands, rounded outputs)
            rel = float((a - t).norm() / t.norm())
            assert rel <= 2 * eps, f"d{name}: relative RMSE {rel:.2e} > {2 * eps:.2e}"
