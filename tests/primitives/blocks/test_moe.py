import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from laminae.primitives import ConfigError, ShapeError
from laminae.primitives.blocks.moe import SparseMoE


def loop_reference(moe, x, position_ids=None):
    """Token by token, slot by slot: what the sort-based dispatch must equal."""
    B, S, H = x.shape
    flat = x.reshape(-1, H)
    E, K, T = moe.num_experts, moe.top_k, flat.shape[0]
    if moe.hash_routing:
        base = position_ids.expand(B, S).reshape(-1) if position_ids is not None else torch.arange(T)
        idx = torch.stack([(base + j) % E for j in range(K)], 1)
        w = torch.full((T, K), 1.0 / K)
    else:
        z = flat @ moe.router.weight.T
        s = torch.sqrt(F.softplus(z) + 1e-8) if moe.scoring == "sqrtsoftplus" else torch.softmax(z, -1)
        w, idx = s.topk(K, -1)
        if moe.normalize_top_k:
            w = w / (w.sum(-1, keepdim=True) + 1e-8)
        w = w * moe.routed_scaling_factor
    ex = moe.experts
    rows = []
    for t in range(T):
        acc = torch.zeros(H)
        for j in range(K):
            e = idx[t, j]
            acc = acc + w[t, j] * (F.silu(flat[t] @ ex.gate_proj[e].T) * (flat[t] @ ex.up_proj[e].T)) @ ex.down_proj[e].T
        rows.append(acc)
    y = torch.stack(rows)
    if moe.shared_expert is not None:
        y = y + moe.shared_expert(flat)
    return y.view(B, S, H)


@given(b=st.integers(1, 2), s=st.integers(1, 6), e=st.integers(1, 5), k=st.integers(1, 3),
       shared=st.integers(0, 2), scoring=st.sampled_from(["softmax", "sqrtsoftplus"]), hashed=st.booleans(),
       normalize=st.booleans())
def test_sorted_dispatch_equals_the_loop_forward_and_backward(b, s, e, k, shared, scoring, hashed, normalize):
    k = min(k, e)
    moe = SparseMoE(6, 5, e, k, num_shared_experts=shared, scoring=scoring, hash_routing=hashed,
                    normalize_top_k=normalize, routed_scaling_factor=1.5, initializer_range=0.3)
    x = torch.randn(b, s, 6, requires_grad=True)
    pos = torch.arange(3, 3 + s)[None]
    y, _ = moe(x, position_ids=pos)
    want = loop_reference(moe, x, pos)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, moe.experts.gate_proj, moe.experts.down_proj], g)
    ref = torch.autograd.grad(want, [x, moe.experts.gate_proj, moe.experts.down_proj], g)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_aux_loss_formula_and_hash_layers_have_none():
    moe = SparseMoE(6, 5, 4, 2, aux_loss_coef=0.01)
    x = torch.randn(2, 7, 6)
    _, aux = moe(x)
    z = x.reshape(-1, 6) @ moe.router.weight.T
    chosen = torch.zeros_like(z).scatter(1, torch.softmax(z, -1).topk(2, -1).indices, 1.0)
    torch.testing.assert_close(aux, 4 * (chosen.mean(0) * torch.softmax(z, -1).mean(0)).sum() * 0.01)
    hashed = SparseMoE(6, 5, 4, 2, hash_routing=True)
    assert hashed(x)[1] is None and not hashed.router.weight.requires_grad


def test_named_errors():
    with pytest.raises(ConfigError, match="top_k"):
        SparseMoE(6, 5, 2, 3)
    with pytest.raises(ConfigError, match="scoring"):
        SparseMoE(6, 5, 2, 1, scoring="sigmoid")
    with pytest.raises(ValueError, match="x"):
        SparseMoE(6, 5, 2, 1)(torch.randn(2, 3, 5))
    moe = SparseMoE(6, 5, 2, 1, hash_routing=True)
    with pytest.raises(ShapeError, match="position_ids"):
        moe(torch.randn(2, 3, 6), position_ids=torch.arange(4)[None])
    with pytest.raises(TypeError):                       # position_ids is keyword-only
        moe(torch.randn(2, 3, 6), torch.arange(3)[None])
