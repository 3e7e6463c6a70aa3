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
        yield from ((stem, case) for case in (cases if isinstance(cases, (list, tuple)) else [cases]))


def _case_id(stem: str, case, dtype: torch.dtype) -> str:
    # the stem is in every id, so `-k <stem>` selects the mechanism's cases
    head = case.name.split(" (")[0].replace(" ", "_")
    return f"{head if head.startswith(stem) else f'{stem}-{head}'}-{str(dtype)[6:]}"


STEMMED = [(stem, case, (torch.bfloat16, torch.float16)[i % 2]) for i, (stem, case) in enumerate(_cases())]
CASES = [(case, dtype) for _, case, dtype in STEMMED]


@pytest.mark.parametrize("case, dtype", CASES, ids=[_case_id(*c) for c in STEMMED])
def test_public_testing_api_on_every_kernel(case, dtype):
    result = parity_float64(case.op, case.reference, case.inputs, case.grad_names)
    assert result.ok, result.report()
    low = assert_parity(case.op, case.reference, _cast(case.inputs, dtype), case.grad_names, dtype=dtype)
    assert isinstance(low, ParityResult) and [c.name for c in low.grads] == [f"d{n}" for n in case.grad_names]


def test_every_case_id_names_its_mechanism():
    """`pytest -k <stem>` selects the mechanism's float64 check (a name with spaces did not)."""
    from laminae.triton_ops.tour import MECHANISMS

    for stem in MECHANISMS:
        assert [c for s, c, _ in STEMMED if s == stem]
        selected = {s for s, c, d in STEMMED if stem in _case_id(s, c, d)}
        assert stem in selected, stem


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
