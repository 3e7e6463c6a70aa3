import math

import pytest
import torch
from torch import nn

from laminae.primitives import ConfigError, DeviceError, DTypeError, ShapeError
from laminae.primitives.siamese_norm import (
    SiameseNormFinal,
    SiameseNormLayer,
    SiameseStreams,
    siamese_boundary_reference,
    siamese_depth_constant,
    siamese_start,
)

SQRT2 = math.sqrt(2.0)


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.pow(2).mean(-1).sqrt()


def _norm(t: torch.Tensor, w: float | torch.Tensor = 1.0) -> torch.Tensor:
    return t / _rms(t).unsqueeze(-1) * w


class Const(nn.Module):
    """A sublayer that ignores its input and returns a fixed vector (broadcast to h)."""

    def __init__(self, value):
        super().__init__()
        self.register_buffer("value", torch.as_tensor(value, dtype=torch.float32))

    def forward(self, h):
        return self.value.to(h.dtype).expand_as(h).clone()


class Recorder(Const):
    """Records the sublayer input h and returns a fixed vector (zeros by default)."""

    def __init__(self, value=0.0):
        super().__init__(value)

    def forward(self, h):
        self.h = h
        return super().forward(h)


def _linear(d, gen, dtype=torch.float64, scale=0.3):
    lin = nn.Linear(d, d, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(d, d, generator=gen, dtype=dtype) * scale)
        lin.bias.copy_(torch.randn(d, generator=gen, dtype=dtype) * 0.1)
    return lin


# ---------------------------------------------------------------------------
# The spec's worked example (d = 2, eps = 0, layer 0, e = (3, 4), a = (1, 0), m = (0, 1))
# ---------------------------------------------------------------------------


def test_worked_example_step_by_step():
    one = torch.ones(2)
    e = torch.tensor([3.0, 4.0])
    a, m, c_inv = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), 1 / SQRT2
    close = dict(atol=1e-5, rtol=0)

    x, y, h = siamese_boundary_reference(e, e, x_scale=one, y_norm_weight=one, in_norm_weight=one, eps=0.0)
    torch.testing.assert_close(h, torch.tensor([0.848528, 1.131371]), **close)
    assert torch.equal(x, e) and torch.equal(y, e)  # no update, no post-norm: streams unchanged

    # the update alone (the MLP boundary before its post-norm)
    xa, ya, _ = siamese_boundary_reference(x, y, a, c_inv, eps=0.0, return_h=False)
    torch.testing.assert_close(xa, torch.tensor([3.707107, 4.0]), **close)
    torch.testing.assert_close(ya, torch.tensor([4.0, 4.0]), **close)

    # the fused MLP boundary: update, X post-norm, fused input norm
    x, y, h = siamese_boundary_reference(x, y, a, c_inv, x_norm_weight=one, y_norm_weight=one,
                                         in_norm_weight=one, eps=0.0)
    torch.testing.assert_close(x, torch.tensor([0.961303, 1.037254]), **close)
    torch.testing.assert_close(y, torch.tensor([4.0, 4.0]), **close)
    torch.testing.assert_close(h, torch.tensor([0.980828, 1.018811]), **close)

    x, y, _ = siamese_boundary_reference(x, y, m, c_inv, eps=0.0, return_h=False)
    torch.testing.assert_close(x, torch.tensor([0.961303, 1.744361]), **close)
    torch.testing.assert_close(y, torch.tensor([4.0, 5.0]), **close)

    _, _, z = siamese_boundary_reference(x, y, x_norm_weight=one, y_norm_weight=one, in_norm_weight=one,
                                         eps=0.0, return_streams=False)
    torch.testing.assert_close(z, torch.tensor([0.785886, 1.175748]), **close)


def test_worked_example_through_the_modules():
    attn = Recorder([1.0, 0.0])
    layer = SiameseNormLayer(2, 0, attn, Const([0.0, 1.0]), eps=1e-12, backend="reference")
    final = SiameseNormFinal(2, eps=1e-12, backend="reference")
    x, y = siamese_start(torch.tensor([[3.0, 4.0]]))
    x, y = layer(x, y)
    torch.testing.assert_close(attn.h, torch.tensor([[0.848528, 1.131371]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(x, torch.tensor([[0.961303, 1.744361]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(y, torch.tensor([[4.0, 5.0]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(final(x, y), torch.tensor([[0.785886, 1.175748]]), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["scale", "postnorm"])
def test_zero_branches_keep_y_equal_to_the_embedding(mode):
    e = torch.randn(2, 5, 16) * 3
    x, y = siamese_start(e)
    for layer_idx in range(3):
        layer = SiameseNormLayer(16, layer_idx, Const(0.0), Const(0.0), attn_x_mode=mode, backend="reference")
        x, y = layer(x, y)
    assert torch.equal(y, e)


def test_gradient_identity_for_the_branch_output():
    torch.manual_seed(0)
    c_inv = 1 / math.sqrt(6.0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    a = torch.randn(4, 8, requires_grad=True)
    x_after, y_after, _ = siamese_boundary_reference(x, y, a, c_inv, return_h=False)
    x_after.retain_grad()
    y_after.retain_grad()
    w = torch.randn(8)
    loss = (torch.tanh(x_after) * w).sum() + (y_after.pow(2) * w.flip(0)).sum()
    loss.backward()
    torch.testing.assert_close(a.grad, x_after.grad * c_inv + y_after.grad)


def test_fused_update_equals_update_then_norms():
    torch.manual_seed(1)
    x, y, a = torch.randn(3, 10), torch.randn(3, 10), torch.randn(3, 10)
    wx, wy, win = torch.rand(10) + 0.5, torch.rand(10) + 0.5, torch.rand(10) + 0.5
    fused = siamese_boundary_reference(x, y, a, 0.25, x_norm_weight=wx, y_norm_weight=wy, in_norm_weight=win)
    x1, y1, _ = siamese_boundary_reference(x, y, a, 0.25, return_h=False)
    split = siamese_boundary_reference(x1, y1, x_norm_weight=wx, y_norm_weight=wy, in_norm_weight=win)
    for f, s in zip(fused, split):
        torch.testing.assert_close(f, s)


@pytest.mark.parametrize("depth_scaling, layer_idx", [(False, 0), (False, 5), (True, 0), (True, 3)])
def test_depth_scaling_of_the_bounded_update(depth_scaling, layer_idx):
    m = torch.randn(16)
    layer = SiameseNormLayer(16, layer_idx, Const(0.0), Const(m), depth_scaling=depth_scaling, backend="reference")
    x, y = torch.randn(3, 16) * 2, torch.randn(3, 16)
    x_out, y_out = layer(x, y)
    c = math.sqrt(2 * (layer_idx + 1)) if depth_scaling else 1.0
    assert layer.depth_scale == pytest.approx(c)
    torch.testing.assert_close(y_out - y, m.expand_as(y))
    torch.testing.assert_close(x_out - _norm(x), (m / c).expand_as(x), atol=1e-5, rtol=1e-5)
    if not depth_scaling:  # both streams receive the identical update
        torch.testing.assert_close(x_out - _norm(x), y_out - y, atol=1e-5, rtol=1e-5)


def test_bounded_stream_rms_is_the_post_norm_weight():
    layer = SiameseNormLayer(32, 2, Const(torch.randn(32) * 50), Const(0.0), backend="reference")
    with torch.no_grad():
        layer.mlp_x_norm.weight.fill_(2.0)
    x = torch.randn(4, 7, 32) * 1e3
    y = torch.randn(4, 7, 32) * 1e3
    x_out, y_out = layer(x, y)
    torch.testing.assert_close(_rms(x_out), torch.full((4, 7), 2.0), atol=1e-4, rtol=1e-4)
    assert float(_rms(y_out).min()) > 100  # the unbounded stream keeps its magnitude


def test_dropout_mask_is_shared_by_both_updates():
    torch.manual_seed(0)
    layer = SiameseNormLayer(64, 1, Const(0.0), Const(1.0), dropout=0.5, backend="reference").train()
    x, y = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    x_out, y_out = layer(x, y)
    dy = y_out - y
    kept = (dy - 2.0).abs() < 1e-5  # inverted dropout of ones: 0 or 2
    assert bool((kept | (dy.abs() < 1e-5)).all()) and 0.2 < kept.float().mean() < 0.8
    torch.testing.assert_close(x_out - _norm(x), dy / layer.depth_scale, atol=1e-5, rtol=1e-5)
    layer.eval()
    x_out, y_out = layer(x, y)
    torch.testing.assert_close(y_out - y, torch.ones_like(y))


def test_attention_input_in_both_x_modes_and_without_y_norm():
    x, y = torch.randn(3, 12) * 4, torch.randn(3, 12) * 2
    rec = Recorder()
    scale = SiameseNormLayer(12, 0, rec, Const(0.0), attn_x_scale_init=0.5, backend="reference")
    scale(x, y)
    torch.testing.assert_close(rec.h, _norm(0.5 * x + _norm(y)))
    post = SiameseNormLayer(12, 0, rec, Const(0.0), attn_x_mode="postnorm", backend="reference")
    x_out, _ = post(x, y)
    torch.testing.assert_close(rec.h, _norm(_norm(x) + _norm(y)))
    torch.testing.assert_close(x_out, _norm(x))
    no_y = SiameseNormLayer(12, 0, rec, Const(0.0), use_attn_y_norm=False, backend="reference")
    no_y(x, y)
    torch.testing.assert_close(rec.h, _norm(x + y))
    raw = SiameseNormLayer(12, 0, rec, Const(0.0), normalized_input=False, backend="reference")
    raw(x, y)
    torch.testing.assert_close(rec.h, x + _norm(y))


def test_stream_start_and_depth_constant():
    e = torch.randn(2, 3, 4)
    x, y = siamese_start(e)
    assert x is e and y is e
    assert siamese_depth_constant(0) == pytest.approx(SQRT2)
    assert siamese_depth_constant(7) == pytest.approx(4.0)
    assert siamese_depth_constant(7, depth_scaling=False) == 1.0


def test_same_dtype_baseline_rounds_each_step():
    x, y, a = torch.randn(5, 32), torch.randn(5, 32), torch.randn(5, 32)
    w = torch.rand(32) + 0.5
    kwargs = dict(update=a, c_inv=0.5, x_scale=w, x_norm_weight=w, y_norm_weight=w, in_norm_weight=w)
    exact = siamese_boundary_reference(x, y, **kwargs)
    same = siamese_boundary_reference(x, y, **kwargs, upcast=False)
    for e, s in zip(exact, same):
        torch.testing.assert_close(e, s)
    low = siamese_boundary_reference(x.bfloat16(), y.bfloat16(), **{**kwargs, "update": a.bfloat16()}, upcast=False)
    for e, s in zip(exact, low):
        assert s.dtype == torch.bfloat16
        torch.testing.assert_close(s.float(), e, atol=5e-2, rtol=5e-2)


# ---------------------------------------------------------------------------
# Gradients in float64
# ---------------------------------------------------------------------------

_FLAG_SETS = {
    "attention_scale": dict(scale=True, y_norm=True, in_norm=True),
    "attention_postnorm": dict(x_norm=True, y_norm=True, in_norm=True),
    "mlp": dict(update=True, x_norm=True, y_norm=True, in_norm=True),
    "everything": dict(update=True, scale=True, x_norm=True, y_norm=True, in_norm=True),
    "update_only": dict(update=True),
    "raw_sum": dict(update=True, scale=True),
}


@pytest.mark.parametrize("flags", list(_FLAG_SETS), ids=list(_FLAG_SETS))
def test_gradcheck_reference_float64(flags):
    f = _FLAG_SETS[flags]
    gen = torch.Generator().manual_seed(3)
    d = 5

    def t(*shape, shift=0.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) + shift).requires_grad_(True)

    x, y = t(3, d), t(3, d)
    opt = {
        "update": t(3, d) if f.get("update") else None,
        "x_scale": t(d, shift=1.0) if f.get("scale") else None,
        "x_norm_weight": t(d, shift=1.0) if f.get("x_norm") else None,
        "y_norm_weight": t(d, shift=1.0) if f.get("y_norm") else None,
        "in_norm_weight": t(d, shift=1.0) if f.get("in_norm") else None,
    }
    names = [k for k, v in opt.items() if v is not None]

    def fn(x, y, *given):
        kw = dict(zip(names, given))
        return siamese_boundary_reference(x, y, c_inv=0.6, eps=1e-6, **kw)

    assert torch.autograd.gradcheck(fn, (x, y, *[opt[k] for k in names]))


class Stack(nn.Module):
    """Embedding output → SiameseNorm layers → final fusion."""

    def __init__(self, layers, final):
        super().__init__()
        self.layers, self.final = nn.ModuleList(layers), final

    def forward(self, e):
        x, y = siamese_start(e)
        for layer in self.layers:
            x, y = layer(x, y)
        return self.final(x, y)


def two_layer_stack(d, gen, mode="scale", dtype=torch.float64, backend="reference"):
    """Two layers with small linear branches; layer 0 without attn_y_norm; weights off 1."""
    layers = [SiameseNormLayer(d, i, _linear(d, gen, dtype), _linear(d, gen, dtype), attn_x_mode=mode,
                               attn_x_scale_init=0.8, use_attn_y_norm=i > 0, backend=backend)
              for i in range(2)]
    stack = Stack(layers, SiameseNormFinal(d, backend=backend)).to(dtype)
    with torch.no_grad():
        for name, p in stack.named_parameters():
            if "norm" in name or "scale" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return stack


@pytest.mark.parametrize("mode", ["scale", "postnorm"])
def test_gradcheck_two_layer_stack_float64(mode):
    gen = torch.Generator().manual_seed(4)
    stack = two_layer_stack(4, gen, mode)
    names = [n for n, _ in stack.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in stack.parameters()]
    e = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(e, *ps):
        return torch.func.functional_call(stack, dict(zip(names, ps)), (e,))

    assert torch.autograd.gradcheck(fn, (e, *params))


# ---------------------------------------------------------------------------
# Parameters and state-dict keys
# ---------------------------------------------------------------------------


def test_state_dict_keys_scale_mode():
    layer = SiameseNormLayer(8, 0, nn.Linear(8, 8), nn.Linear(8, 8), attn_x_scale_init=0.25)
    own = {k for k in layer.state_dict() if not k.startswith(("attention.", "mlp."))}
    assert own == {"attn_x_scale", "attn_y_norm.weight", "attn_in_norm.weight",
                   "mlp_x_norm.weight", "mlp_y_norm.weight", "mlp_in_norm.weight"}
    assert {"attention.weight", "attention.bias", "mlp.weight", "mlp.bias"} <= set(layer.state_dict())
    torch.testing.assert_close(layer.attn_x_scale.detach(), torch.full((8,), 0.25))
    for key, value in layer.state_dict().items():
        if key.endswith("norm.weight"):
            assert torch.equal(value, torch.ones(8))


def test_state_dict_keys_other_variants():
    post = SiameseNormLayer(8, 0, Const(0.0), Const(0.0), attn_x_mode="postnorm", normalized_input=False,
                            use_attn_y_norm=False)
    assert set(post.state_dict()) == {"attn_x_norm.weight", "mlp_x_norm.weight", "mlp_y_norm.weight",
                                      "attention.value", "mlp.value"}
    final = SiameseNormFinal(8)
    assert set(final.state_dict()) == {"final_x_norm.weight", "final_y_norm.weight", "final_norm.weight"}
    # a checkpoint saved by one instance loads strictly into another
    other = SiameseNormLayer(8, 3, Const(0.0), Const(0.0), attn_x_mode="postnorm", normalized_input=False,
                             use_attn_y_norm=False)
    other.load_state_dict(post.state_dict(), strict=True)


def test_accepts_plain_callables_and_passes_kwargs():
    seen = {}

    def attention(h, attention_mask=None):
        seen["attn"] = attention_mask
        return torch.zeros_like(h)

    def mlp(h, scale=1.0):
        seen["mlp"] = scale
        return torch.ones_like(h) * scale

    layer = SiameseNormLayer(6, 0, attention, mlp, backend="reference")
    mask = torch.ones(2, 3)
    x, y = torch.randn(2, 3, 6), torch.randn(2, 3, 6)
    out = layer(x, y, attn_kwargs={"attention_mask": mask}, mlp_kwargs={"scale": 2.0})
    assert seen["attn"] is mask and seen["mlp"] == 2.0
    assert isinstance(out, SiameseStreams) and out._fields == ("x", "y")
    torch.testing.assert_close(out.y - y, torch.full_like(y, 2.0))
    assert isinstance(siamese_start(x), SiameseStreams)
    with pytest.raises(TypeError):          # the sublayers' kwargs are keyword-only
        layer(x, y, {"attention_mask": mask})


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(layer_idx=-1), ConfigError, "layer_idx"),
        (dict(eps=0.0), ConfigError, "eps"),
        (dict(eps=-1e-6), ConfigError, "eps"),
        (dict(attn_x_mode="post"), ConfigError, "attn_x_mode"),
        (dict(norm_type="layernorm"), ConfigError, "RMSNorm only"),
        (dict(dropout=1.0), ConfigError, "dropout"),
        (dict(backend="cuda"), ConfigError, "backend"),
        (dict(hidden_size=0), ConfigError, "hidden_size"),
        (dict(attention=3), TypeError, "attention"),
        (dict(attn_x_scale_init=float("inf")), ConfigError, "attn_x_scale_init"),
    ],
)
def test_bad_layer_config_raises(kwargs, err, match):
    args = dict(hidden_size=8, layer_idx=0, attention=Const(0.0), mlp=Const(0.0))
    args.update(kwargs)
    with pytest.raises(err, match=match):
        SiameseNormLayer(**args)


def test_bad_final_config_raises():
    with pytest.raises(ConfigError, match="eps"):
        SiameseNormFinal(8, eps=0.0)
    with pytest.raises(ConfigError, match="RMSNorm only"):
        SiameseNormFinal(8, norm_type="layernorm")


def test_bad_layer_inputs_raise():
    layer = SiameseNormLayer(8, 0, Const(0.0), Const(0.0), backend="reference")
    with pytest.raises(ShapeError, match="same shape"):
        layer(torch.randn(2, 8), torch.randn(3, 8))
    with pytest.raises(ShapeError, match="hidden_size=8"):
        layer(torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(DTypeError, match="x: float32, y: float16"):
        layer(torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float16))
    with pytest.raises(DTypeError):
        layer(torch.ones(2, 8, dtype=torch.int32), torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(DeviceError, match="meta"):
        layer(torch.randn(2, 8), torch.randn(2, 8, device="meta"))
    with pytest.raises(TypeError, match="`x`"):
        layer([0.0] * 8, torch.randn(8))
    final = SiameseNormFinal(8, backend="reference")
    with pytest.raises(ShapeError, match="same shape"):
        final(torch.randn(2, 8), torch.randn(2, 1, 8))


def test_bad_sublayer_outputs_raise():
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    wrong_shape = SiameseNormLayer(8, 0, lambda h: h[..., :4], Const(0.0), backend="reference")
    with pytest.raises(ShapeError, match="attention sublayer must return its input's shape"):
        wrong_shape(x, y)
    wrong_dtype = SiameseNormLayer(8, 0, Const(0.0), lambda h: h.double(), backend="reference")
    with pytest.raises(DTypeError, match="mlp sublayer"):
        wrong_dtype(x, y)
    not_tensor = SiameseNormLayer(8, 0, lambda h: (h,), Const(0.0), backend="reference")
    with pytest.raises(TypeError, match="attention sublayer must return a torch.Tensor"):
        not_tensor(x, y)


def test_bad_boundary_arguments_raise():
    x, y = torch.randn(3, 6), torch.randn(3, 6)
    with pytest.raises(ShapeError, match="`update`"):
        siamese_boundary_reference(x, y, torch.randn(3, 5))
    with pytest.raises(ShapeError, match="`x_norm_weight`"):
        siamese_boundary_reference(x, y, x_norm_weight=torch.ones(5))
    with pytest.raises(ShapeError, match="same shape"):
        siamese_boundary_reference(x, y[:2])
    with pytest.raises(ConfigError, match="eps"):
        siamese_boundary_reference(x, y, eps=-1.0)
    with pytest.raises(ConfigError, match="c_inv"):
        siamese_boundary_reference(x, y, c_inv=float("nan"))
    with pytest.raises(DTypeError):
        siamese_boundary_reference(x, y, torch.randn(3, 6, dtype=torch.float64))
