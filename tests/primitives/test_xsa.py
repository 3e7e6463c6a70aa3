import pytest
import torch

from laminae.primitives import ConfigError, DeviceError, DTypeError, ShapeError
from laminae.primitives.xsa import ExclusiveSelfAttention, xsa_reference

MODES = ("normalized", "squared_norm")


def _pair(batch=2, seq=5, heads=4, kv_heads=2, dim=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(batch, seq, heads, dim, generator=gen, dtype=dtype)
    v = torch.randn(batch, seq, kv_heads, dim, generator=gen, dtype=dtype)
    return y, v


def _expand(v, heads):
    """kv head of each query head: h // (H / Hkv)."""
    return v.repeat_interleave(heads // v.shape[2], dim=2)


def _seed_normalized(y_bhsd, v_bhsd, eps=1e-8):
    # the attention module's XSA step, in its (batch, heads, seq, head_dim) layout
    vn = v_bhsd / (v_bhsd.norm(dim=-1, keepdim=True) + eps)
    projection = (y_bhsd * vn).sum(dim=-1, keepdim=True) * vn
    return y_bhsd - projection


def _seed_squared_norm(y_bhsd, v_bhsd, eps=1e-6):
    # the configuration's documented form: denominator ‖v_ref‖² + xsa_eps
    coef = (y_bhsd * v_bhsd).sum(-1, keepdim=True) / (v_bhsd.pow(2).sum(-1, keepdim=True) + eps)
    return y_bhsd - coef * v_bhsd


@pytest.mark.parametrize("heads, kv_heads", [(3, 3), (4, 2), (4, 1)])
@pytest.mark.parametrize("mode, seed_fn", [("normalized", _seed_normalized), ("squared_norm", _seed_squared_norm)])
def test_matches_seed_formula(mode, seed_fn, heads, kv_heads):
    y, v = _pair(heads=heads, kv_heads=kv_heads, dtype=torch.float32)
    expected = seed_fn(y.transpose(1, 2), _expand(v, heads).transpose(1, 2)).transpose(1, 2)
    out = xsa_reference(y, v, mode=mode)
    if heads == kv_heads and mode == "normalized":
        assert torch.equal(out, expected)  # same operations in the same order
    else:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2), (3, 1)])
def test_gradcheck_reference_float64(mode, heads, kv_heads):
    y, v = _pair(batch=2, seq=3, heads=heads, kv_heads=kv_heads, dim=5, seed=1)
    v[0, 1, 0] *= 1e-3  # a near-zero value vector (‖v‖² ~ ε for "squared_norm")
    y.requires_grad_(True)
    v.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: xsa_reference(a, b, mode=mode, upcast=False), (y, v))


@pytest.mark.parametrize("mode", MODES)
def test_output_is_orthogonal_to_value(mode):
    y, v = _pair(heads=6, kv_heads=3, dim=16)
    out = xsa_reference(y, v, mode=mode)
    dots = (out * _expand(v, 6)).sum(-1)
    scale = y.norm(dim=-1) * _expand(v, 6).norm(dim=-1)
    assert float((dots.abs() / scale).max()) < 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_projection_is_idempotent(mode):
    y, v = _pair(heads=4, kv_heads=2, dim=16)
    once = xsa_reference(y, v, mode=mode)
    torch.testing.assert_close(xsa_reference(once, v, mode=mode), once, atol=1e-6, rtol=0)


def test_modes_agree_far_from_zero():
    y, v = _pair(heads=4, kv_heads=2, dim=16)
    torch.testing.assert_close(xsa_reference(y, v, mode="normalized"), xsa_reference(y, v, mode="squared_norm"),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_zero_value_leaves_output_and_has_zero_value_gradient(mode):
    y, v = _pair(heads=2, kv_heads=1, dim=4)
    v[1, 2] = 0.0
    y.requires_grad_(True)
    v.requires_grad_(True)
    out = xsa_reference(y, v, mode=mode)
    g = torch.randn_like(out)
    dy, dv = torch.autograd.grad(out, [y, v], g)
    assert torch.equal(out[1, 2], y[1, 2].detach())
    assert torch.equal(dy[1, 2], g[1, 2])
    assert torch.equal(dv[1, 2], torch.zeros_like(dv[1, 2]))


def test_each_position_depends_only_on_itself():
    # what makes a KV-cache step correct: pass the values of the new positions only
    y, v = _pair(seq=7)
    full = xsa_reference(y, v)
    torch.testing.assert_close(xsa_reference(y[:, 4:], v[:, 4:]), full[:, 4:], atol=0, rtol=0)


def test_upcast_false_keeps_dtype_and_upcast_is_closer():
    y, v = _pair(dtype=torch.float32)
    truth = xsa_reference(y.double(), v.double())
    yb, vb = y.bfloat16(), v.bfloat16()
    up, low = xsa_reference(yb, vb), xsa_reference(yb, vb, upcast=False)
    assert up.dtype == low.dtype == torch.bfloat16
    truth_b = xsa_reference(yb.double(), vb.double())
    assert (up.double() - truth_b).abs().max() <= (low.double() - truth_b).abs().max()
    assert truth.dtype == torch.float64


def test_custom_eps_is_used():
    y, v = _pair(heads=1, kv_heads=1, dim=3)
    v[0, 0, 0] = torch.tensor([1e-3, 0.0, 0.0], dtype=torch.float64)
    y[0, 0, 0] = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    out = xsa_reference(y, v, mode="squared_norm", eps=1e-6)
    # c = 1e-3 / (1e-6 + 1e-6) = 500; y0 - c·v0 = 1 - 0.5
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64))


def test_module_has_no_parameters_and_matches_reference():
    m = ExclusiveSelfAttention(4, 2, 8, mode="squared_norm", backend="reference")
    assert list(m.parameters()) == [] and m.state_dict() == {}
    assert m.eps == 1e-6 and "squared_norm" in repr(m)
    y, v = _pair(heads=4, kv_heads=2, dim=8, dtype=torch.float32)
    torch.testing.assert_close(m(y, v=v), xsa_reference(y, v, mode="squared_norm"))
    assert ExclusiveSelfAttention(4, 2, 8).eps == 1e-8


@pytest.mark.parametrize(
    "kwargs, err",
    [
        (dict(num_heads=4, num_kv_heads=3, head_dim=8), ConfigError),
        (dict(num_heads=0, num_kv_heads=1, head_dim=8), ConfigError),
        (dict(num_heads=4, num_kv_heads=2, head_dim=8, mode="cosine"), ConfigError),
        (dict(num_heads=4, num_kv_heads=2, head_dim=8, eps=0.0), ConfigError),
        (dict(num_heads=4, num_kv_heads=2, head_dim=8, eps=-1e-6), ConfigError),
        (dict(num_heads=4, num_kv_heads=2, head_dim=8, eps=float("inf")), ConfigError),
        (dict(num_heads=4, num_kv_heads=2, head_dim=8, backend="cuda"), ConfigError),
    ],
)
def test_bad_config_raises(kwargs, err):
    with pytest.raises(err):
        ExclusiveSelfAttention(**kwargs)


def test_bad_inputs_raise_named_errors():
    m = ExclusiveSelfAttention(4, 2, 8, backend="reference")
    y, v = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    with pytest.raises(ShapeError, match="4 dimensions"):
        m(y[0], v=v)
    with pytest.raises(ShapeError, match="`v`.*dim 0"):
        m(y, v=v[:1])
    with pytest.raises(ShapeError, match="`v`.*dim 1"):
        m(y, v=v[:, :3])
    with pytest.raises(ShapeError, match="`y`.*dim 3"):
        m(y[..., :6], v=v[..., :6])
    with pytest.raises(ShapeError, match="`y`.*dim 2"):
        m(torch.randn(2, 5, 6, 8), v=v)
    with pytest.raises(ShapeError, match="`v`.*dim 2"):
        m(y, v=torch.randn(2, 5, 1, 8))
    with pytest.raises(DTypeError):
        m(y, v=v.half())
    with pytest.raises(DTypeError):
        m(y.int(), v=v.int())
    with pytest.raises(DeviceError):
        m(y, v=v.to("meta"))
    with pytest.raises(TypeError):
        m(y.tolist(), v=v)
    # the functional form checks the same things
    with pytest.raises(ShapeError, match="multiple of num_kv_heads"):
        xsa_reference(torch.randn(2, 5, 3, 8), torch.randn(2, 5, 2, 8))
    with pytest.raises(ShapeError, match="`v`.*dim 3"):
        xsa_reference(y, torch.randn(2, 5, 2, 7))
    with pytest.raises(ConfigError, match="mode"):
        xsa_reference(y, v, mode="seed")
    with pytest.raises(ConfigError, match="eps"):
        xsa_reference(y, v, eps=0)
