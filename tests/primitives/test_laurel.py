import math

import pytest
import torch

from laminae.primitives import ConfigError, DTypeError, ShapeError
from laminae.primitives.laurel import LAuReL, LAuReLBlock, laurel_lr_init, laurel_reference

C = 1 / math.sqrt(8)


def _spec_setup():
    A = laurel_lr_init(4, 2)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    f = torch.tensor([0.5, -1.0, 0.0, 2.0])
    return A, x, f


def test_init_matches_spec_worked_example():
    A, x, _ = _spec_setup()
    torch.testing.assert_close(A, torch.tensor([[C, 0], [0, C], [C, 0], [0, C]]))
    torch.testing.assert_close(x @ A, torch.tensor([1.414214, 2.121320]), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("lr_init", [1.5, 1.0, 3.0, 6.0]),
        ("rw_init", [0.75, 0.5, 1.5, 3.0]),
        ("lr_b01", [1.853553, 1.353553, 3.353553, 6.353553]),
        ("rwlr_b01", [0.729556, -0.098091, 0.901909, 2.632968]),
    ],
)
def test_spec_worked_examples(case, expected):
    A, x, f = _spec_setup()
    zero, one = torch.tensor(0.0), torch.tensor(1.0)
    B0, B1 = torch.zeros(2, 4), torch.full((2, 4), 0.1)
    args = {
        "lr_init": dict(lr_A=A, lr_B=B0),
        "rw_init": dict(alpha_logit=zero, beta_logit=zero),
        "lr_b01": dict(lr_A=A, lr_B=B1),
        "rwlr_b01": dict(alpha_logit=one, beta_logit=zero, lr_A=A, lr_B=B1),
    }[case]
    y = laurel_reference(x, sublayer_output=f, **args)
    torch.testing.assert_close(y, torch.tensor(expected), atol=1e-6, rtol=0)


def test_a_is_column_orthogonal_for_uneven_division():
    A = laurel_lr_init(10, 3)
    gram = A.t() @ A
    torch.testing.assert_close(gram, torch.diag(torch.diagonal(gram)))
    assert (A != 0).sum(0).tolist() == [4, 3, 3]


def test_parameter_counts_match_seed():
    assert sum(p.numel() for p in LAuReL(64, use_rw=True).parameters()) == 2
    assert sum(p.numel() for p in LAuReL(64, use_rw=False, use_lr=True, lr_rank=8).parameters()) == 2 * 8 * 64
    assert sum(p.numel() for p in LAuReL(64, use_rw=True, use_lr=True, lr_rank=8).parameters()) == 2 + 2 * 8 * 64


def test_lr_at_init_is_identity_residual():
    m = LAuReL(16, use_rw=False, use_lr=True, lr_rank=4, backend="reference")
    f, x = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    torch.testing.assert_close(m(x, sublayer_output=f), f + x)


def test_large_logit_gap_selects_branch():
    m = LAuReL(8, use_rw=True, rw_init=(40.0, 0.0), backend="reference")
    f, x = torch.randn(5, 8), torch.randn(5, 8)
    torch.testing.assert_close(m(x, sublayer_output=f), f)


def test_weights_sum_to_one_and_are_positive():
    m = LAuReL(8, rw_init=(0.7, -1.3))
    w = torch.softmax(torch.stack([m.alpha_logit, m.beta_logit]), 0).detach()
    assert torch.all(w > 0) and abs(float(w.sum()) - 1) < 1e-7


@pytest.mark.parametrize("rw, lr", [(True, False), (False, True), (True, True)])
def test_gradcheck_reference_float64(rw, lr):
    torch.manual_seed(1)
    D, r = 6, 2
    f = torch.randn(3, D, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, D, dtype=torch.float64, requires_grad=True)
    params = []
    if rw:
        params += [torch.tensor(0.3, dtype=torch.float64, requires_grad=True),
                   torch.tensor(-0.2, dtype=torch.float64, requires_grad=True)]
    else:
        params += [None, None]
    if lr:
        params += [torch.randn(D, r, dtype=torch.float64, requires_grad=True),
                   torch.randn(r, D, dtype=torch.float64, requires_grad=True)]
    else:
        params += [None, None]

    def fn(f, x, *p):
        it = iter(p)
        full = [next(it) if q is not None else None for q in params]
        return laurel_reference(x, *full, sublayer_output=f, upcast=False)

    assert torch.autograd.gradcheck(fn, (f, x, *[p for p in params if p is not None]))


def test_block_augment_input_modes():
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(8)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    res = LAuReLBlock(lin, norm, 8, augment_input="residual", use_rw=True, backend="reference")
    nrm = LAuReLBlock(lin, norm, 8, augment_input="normed", use_rw=True, backend="reference")
    h = norm(x)
    torch.testing.assert_close(res(x), 0.5 * lin(h) + 0.5 * x)
    torch.testing.assert_close(nrm(x), 0.5 * lin(h) + 0.5 * h)


@pytest.mark.parametrize(
    "kwargs, err",
    [
        (dict(use_rw=False, use_lr=False), ConfigError),
        (dict(use_lr=True, lr_rank=0), ConfigError),
        (dict(use_lr=True, lr_rank=17), ConfigError),
        (dict(rw_init=(float("nan"), 0.0)), ConfigError),
        (dict(backend="cuda"), ConfigError),
    ],
)
def test_bad_config_raises(kwargs, err):
    with pytest.raises(err):
        LAuReL(16, **kwargs)


def test_sublayer_output_is_a_keyword_and_x_the_residual():
    m = LAuReL(8, use_rw=True, rw_init=(40.0, 0.0), backend="reference")   # y ≈ sublayer_output
    x, f = torch.randn(2, 8), torch.randn(2, 8)
    torch.testing.assert_close(m(x, sublayer_output=f), f)
    with pytest.raises(TypeError):
        m(f, x)
    with pytest.raises(TypeError):
        laurel_reference(f, x, m.alpha_logit, m.beta_logit)


def test_bad_inputs_raise():
    m = LAuReL(16, use_rw=True, use_lr=True, lr_rank=4)
    with pytest.raises(ShapeError, match="sublayer_output"):
        m(torch.randn(3, 16), sublayer_output=torch.randn(2, 16))
    with pytest.raises(ShapeError, match="hidden_size=16"):
        m(torch.randn(2, 8), sublayer_output=torch.randn(2, 8))
    with pytest.raises(DTypeError):
        m(torch.randn(2, 16, dtype=torch.float16), sublayer_output=torch.randn(2, 16))
    with pytest.raises(DTypeError):
        m(torch.ones(2, 16, dtype=torch.int32), sublayer_output=torch.ones(2, 16, dtype=torch.int32))
    with pytest.raises(TypeError):
        m(torch.randn(16), sublayer_output=[1.0] * 16)
    with torch.no_grad():
        m.alpha_logit.fill_(float("inf"))
    with pytest.raises(ConfigError, match="must be finite, got \\[inf, 0.0\\]"):
        m(torch.randn(2, 16), sublayer_output=torch.randn(2, 16))
