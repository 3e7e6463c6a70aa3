"""Every kernel's tour case against the reference in float64, by relative RMSE: a
uniform ×1.001 error in any output or gradient (which the element-wise fp32
tolerances admit) fails here."""
import importlib

import pytest
import torch

from laminae.triton_ops.testing import parity_float64
from laminae.triton_ops.tour import MECHANISMS

from .._helpers import DEVICE


def _cases():
    for stem in MECHANISMS:
        cases = importlib.import_module(f"laminae.triton_ops.{stem}").tour_case(DEVICE)
        yield from cases if isinstance(cases, (list, tuple)) else [cases]


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c.name.split(" (")[0])
def test_kernel_within_float64_truth(case):
    # DERF's γ cancels in the normalisation except through the 1e-8: its gradient is
    # fp32 rounding noise in every implementation (docs/mechanisms/derf.md)
    grads = [g for g in case.grad_names if g != "derf_gamma"]
    result = parity_float64(case.op, case.reference, case.inputs, grads)
    assert result.ok, result.report()


def test_uniform_scale_error_is_caught():
    case = next(c for c in _cases() if c.name.startswith("xsa"))

    class Scaled(torch.autograd.Function):   # a kernel whose dv is 1.001 × too large
        @staticmethod
        def forward(ctx, y, v):
            with torch.enable_grad():
                y_, v_ = y.detach().requires_grad_(), v.detach().requires_grad_()
                out = case.op(y=y_, v=v_)
            ctx.save_for_backward(y_, v_, out)
            return out.detach()

        @staticmethod
        def backward(ctx, g):
            y_, v_, out = ctx.saved_tensors
            dy, dv = torch.autograd.grad(out, [y_, v_], g)
            return dy, dv * 1.001

    assert not parity_float64(lambda y, v: Scaled.apply(y, v), case.reference, case.inputs, case.grad_names).ok
