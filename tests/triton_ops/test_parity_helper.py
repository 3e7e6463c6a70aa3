"""The comparison routines used by every kernel test, as the public
``laminae.triton_ops.testing`` offers them: they can fail, and they pass what is right."""
import pytest
import torch
from hypothesis import Phase, given, settings

from laminae.primitives import ConfigError, DTypeError, ShapeError
from laminae.triton_ops.testing import assert_parity, attention_shapes, compare, parity, parity_float64

from .._helpers import DEVICE


def _ref(a, w):
    return (a * w).sum(-1)


def test_parity_detects_wrong_output_and_wrong_gradient():
    a, w = torch.randn(4, 8), torch.randn(8)
    assert parity(_ref, _ref, {"a": a, "w": w}, ["a", "w"]).ok
    wrong_out = parity(lambda a, w: _ref(a, w) + 1e-3, _ref, {"a": a, "w": w}, ["a", "w"])
    assert not wrong_out.ok and [c.name for c in wrong_out.failures()] == ["out0"]

    class WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            ctx.save_for_backward(a, w)
            return _ref(a, w)

        @staticmethod
        def backward(ctx, g):
            a, w = ctx.saved_tensors
            return g[:, None] * w, (g[:, None] * a).sum(0) * 1.01

    bad = parity(WrongGrad.apply, _ref, {"a": a, "w": w}, ["a", "w"])
    assert [c.name for c in bad.failures()] == ["dw"]


def test_unwritten_nan_and_missing_gradient_fail():
    a = torch.randn(3)
    assert not compare("x", torch.full((3,), float("nan")), a, 1e-3, 1e-3).ok
    assert not compare("x", None, a, 1e-3, 1e-3).ok
    assert compare("x", None, None, 1e-3, 1e-3).ok
    assert not compare("x", a[:2], a, 1e-3, 1e-3).ok


def test_where_compares_only_the_chosen_elements():
    a, w = torch.randn(4, 8), torch.randn(8)
    rows = torch.tensor([True, True, False, True])

    def off_in_row_2(a, w):
        return _ref(a, w) + torch.tensor([0.0, 0.0, 1.0, 0.0])

    assert [c.name for c in parity(off_in_row_2, _ref, {"a": a, "w": w}, ["a", "w"]).failures()] == ["out0"]
    assert parity(off_in_row_2, _ref, {"a": a, "w": w}, ["a", "w"], where={"out0": rows}).ok
    assert_parity(off_in_row_2, _ref, {"a": a, "w": w}, ["a", "w"], where={"out0": rows})
    # per gradient: da's row 2 is wrong, a [4, 1] mask broadcasts over its columns
    bad_row = parity(_GradRow2.apply, _ref, {"a": a, "w": w}, ["a", "w"])
    assert [c.name for c in bad_row.failures()] == ["da"]
    assert parity(_GradRow2.apply, _ref, {"a": a, "w": w}, ["a", "w"], where={"da": rows[:, None]}).ok
    assert parity_float64(_GradRow2.apply, _ref, {"a": a, "w": w}, ["a", "w"], where={"da": rows[:, None]}).ok


class _GradRow2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, w):
        ctx.save_for_backward(a, w)
        return _ref(a, w)

    @staticmethod
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        da = g[:, None] * w
        da[2] += 1.0
        return da, (g[:, None] * a).sum(0)


def test_where_refuses_what_it_cannot_apply():
    a, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ConfigError, match="'dx'"):
        parity(_ref, _ref, {"a": a, "w": w}, ["a", "w"], where={"dx": torch.ones(4, 8, dtype=torch.bool)})
    with pytest.raises(DTypeError, match="bool"):
        parity(_ref, _ref, {"a": a, "w": w}, ["a", "w"], where={"da": torch.ones(4, 8)})
    with pytest.raises(ShapeError, match="da"):
        parity(_ref, _ref, {"a": a, "w": w}, ["a", "w"], where={"da": torch.ones(3, 8, dtype=torch.bool)})


def test_16bit_truth_backpropagates_the_ops_own_upstream():
    # the upstream gradient is drawn in the op's dtype, so the fp32 truth sees the same
    # values: an exact op is exact, not half a bf16 ulp off
    x = torch.randn(64).to(torch.bfloat16)
    result = parity(lambda x: x * 1, lambda x: x * 1, {"x": x}, ["x"], dtype=torch.bfloat16)
    assert result.ok and result.max_grad_err == 0.0


def test_parity_float64_holds_16bit_ops_to_two_ulps():
    x = torch.randn(256).to(torch.bfloat16)
    eps = torch.finfo(torch.bfloat16).eps

    def off_by(factor):
        class Scaled(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, g):
                return (g.float() * 2 * factor).to(g.dtype)
        return Scaled.apply

    # rounding its output to bf16 is all a bf16 op can do: 2e-5 would fail it
    assert parity_float64(lambda x: x * 1.1, lambda x: x * 1.1, {"x": x}, ["x"]).ok
    assert parity_float64(off_by(1.0), lambda x: x * 2, {"x": x}, ["x"]).ok
    assert not parity_float64(off_by(1 + 4 * eps), lambda x: x * 2, {"x": x}, ["x"]).ok


@pytest.mark.parametrize("seed", [1, 4, 7])
def test_parity_float64_accepts_a_gradient_that_is_rounding_of_zero(seed):
    # DERF at one query and one key: out = v, so every gradient but dv is ~1e-8 in the
    # truth and fp32 rounding (~1e-6) in any implementation; 1e-7 per element of the
    # one-element parameter gradients failed these draws
    from laminae.primitives.derf import derf_attention_reference
    from laminae.triton_ops.derf import derf_attention

    g = torch.Generator().manual_seed(seed)
    inputs = {"q": torch.randn(1, 1, 1, 8, generator=g), "k": torch.randn(1, 1, 1, 8, generator=g),
              "v": torch.randn(1, 1, 1, 8, generator=g), "derf_alpha": torch.randn(1, generator=g),
              "derf_bias": torch.randn(1, generator=g), "derf_gamma": torch.rand(1, generator=g) + 0.5}
    inputs = {k: v.to(DEVICE) for k, v in inputs.items()}
    result = parity_float64(derf_attention, derf_attention_reference, inputs, list(inputs))
    assert result.ok, result.report()


def test_attention_shapes_falsifying_example_prints_as_a_dict():
    @settings(max_examples=3, derandomize=True, database=None, phases=[Phase.generate, Phase.shrink])
    @given(shape=attention_shapes())
    def never(shape):
        assert shape["seq"] < 0

    with pytest.raises(AssertionError) as failure:
        never()
    example = "\n".join(getattr(failure.value, "__notes__", []))
    assert "shape={'batch':" in example and "lambda" not in example, example
