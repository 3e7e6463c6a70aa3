import pytest
import torch
from hypothesis import given, strategies as st

from laminae.primitives import ConfigError, ShapeError
from laminae.primitives.blocks.norms import RMSNorm, rms_norm


def llama_rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@given(rows=st.integers(1, 5), dim=st.sampled_from([1, 7, 16, 33]), scale=st.sampled_from([1e-3, 1.0, 50.0]))
def test_upcast_and_input_dtype_match_their_formulas(rows, dim, scale):
    x = torch.randn(rows, dim) * scale
    w = torch.randn(dim)
    torch.testing.assert_close(rms_norm(x, w, 1e-5, upcast=True), llama_rms(x, w, 1e-5))
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rms_norm(x, w, 1e-6, upcast=False), want)


def test_upcast_weight_applies_the_gain_in_fp32_and_rounds_once():
    x = (torch.randn(4, 64) * 300).bfloat16()
    w = torch.randn(64).bfloat16()
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).bfloat16()
    norm = RMSNorm(64, upcast_weight=True).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(w)
    assert torch.equal(norm(x), want)
    # casting back before the gain (Llama) rounds twice: a different answer at bf16
    assert not torch.equal(rms_norm(x, w, 1e-6, upcast=True), want)


@pytest.mark.parametrize("owner", ["hrm", "engram", "siamese"])
def test_the_mechanisms_norms_are_the_one_rmsnorm_under_the_seeds_names(owner):
    from laminae.primitives import EngramLayerFusion, HRMRefinementBlock, SiameseNormFinal

    module = {"hrm": lambda: HRMRefinementBlock(8, 4, 2), "engram": lambda: EngramLayerFusion(8, 4),
              "siamese": lambda: SiameseNormFinal(8)}[owner]()
    norms = [m for name, m in module.named_children() if name.endswith("norm")]
    assert norms and all(type(m) is RMSNorm for m in norms)
    assert all(k.endswith(".weight") for k in module.state_dict() if "norm" in k)
    assert all(m.upcast == (owner == "siamese") for m in norms)


def test_upcast_returns_the_input_dtype_and_normalises_in_fp32():
    x = (torch.randn(4, 64) * 300).bfloat16()
    norm = RMSNorm(64, upcast=True).bfloat16()
    y = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), llama_rms(x, norm.weight.float(), 1e-6).float(), atol=1e-2, rtol=1e-2)


def test_groups_normalise_each_head_separately():
    x = torch.randn(2, 3, 4 * 8)
    norm = RMSNorm(32, group_size=8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    per_head = rms_norm(x.view(2, 3, 4, 8), None, 1e-6).reshape(2, 3, 32) * norm.weight
    torch.testing.assert_close(norm(x), per_head)


def test_prefix_width_uses_the_leading_gains():
    norm = RMSNorm(16, allow_prefix=True)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(16.0))
    x = torch.randn(2, 8)
    torch.testing.assert_close(norm(x), rms_norm(x, torch.arange(8.0), 1e-6))


def test_gradcheck_float64():
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, dtype=torch.float64, requires_grad=True)
    for upcast in (True, False):
        assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6, upcast=upcast, group_size=4), (x, w))


def test_named_errors():
    with pytest.raises(ConfigError, match="group_size"):
        RMSNorm(10, group_size=4)
    with pytest.raises(ConfigError, match="eps"):
        RMSNorm(10, eps=0)
    with pytest.raises(ConfigError, match="eps"):
        RMSNorm(10, eps=float("inf"))
    with pytest.raises(ConfigError, match="upcast_weight"):
        RMSNorm(10, upcast=False, upcast_weight=True)
    with pytest.raises(ShapeError, match="dim=10"):
        RMSNorm(10)(torch.randn(2, 9))
