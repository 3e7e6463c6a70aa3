"""Every kernel's tour case through the public ``laminae.triton_ops.testing``, as a user
would run it: ``parity_float64`` (the fp32 op against the reference in float64, by
relative RMSE: a uniform ×1.001 error in any output or gradient, which the
element-wise fp32 tolerances admit, fails) and ``assert_parity`` (``parity``) in 16
bits on the interpreter, bf16 and fp16 taking turns over the cases."""
import importlib

import pytest
import torch

from laminae.triton_ops.testing import ParityResult, assert_parity, parity_float64
from laminae.triton_ops.tour import MECHANISMS, _cast

from .._helpers import DEVICE


def _cases():
    for stem in MECHANISMS:
        cases = importlib.import_module(f"laminae.triton_ops.{stem}").tour_case(DEVICE)
        yield from cases if isinstance(cases, (list, tuple)) else [cases]


CASES = [(case, (torch.bfloat16, torch.float16)[i % 2]) for i, case in enumerate(_cases())]


@pytest.mark.parametrize("case, dtype", CASES,
                         ids=[f"{c.name.split(' (')[0]}-{str(d)[6:]}" for c, d in CASES])
def test_public_testing_api_on_every_kernel(case, dtype):
    result = parity_float64(case.op, case.reference, case.inputs, case.grad_names)
    assert result.ok, result.report()
    low = assert_parity(case.op, case.reference, _cast(case.inputs, dtype), case.grad_names, dtype=dtype)
    assert isinstance(low, ParityResult) and [c.name for c in low.grads] == [f"d{n}" for n in case.grad_names]


def test_uniform_scale_error_is_caught():
    case = next(c for c, _ in CASES if c.name.startswith("xsa"))

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
