"""The comparison routine used by every kernel test can fail."""
import torch

from laminae.triton_ops._parity import compare, parity


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
