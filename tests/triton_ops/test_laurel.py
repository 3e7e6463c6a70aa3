import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from laminae.primitives import BackendUnavailableError, DTypeError
from laminae.primitives.laurel import LAuReL, laurel_lr_init, laurel_reference
from laminae.triton_ops.laurel import laurel, laurel_combine

from .._helpers import DEVICE, assert_parity, scales, seeds


def _inputs(rows, d, rank, rw, lr, scale, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    inp = {
        "sublayer_output": (torch.randn(rows, d, generator=gen) * scale).to(DEVICE, dtype),
        "x": (torch.randn(rows, d, generator=gen) * scale).to(DEVICE, dtype),
    }
    if rw:
        inp["alpha_logit"] = (torch.randn((), generator=gen) * 2).to(DEVICE)
        inp["beta_logit"] = (torch.randn((), generator=gen) * 2).to(DEVICE)
    if lr:
        inp["lr_A"] = (laurel_lr_init(d, rank) + 0.1 * torch.randn(d, rank, generator=gen)).to(DEVICE)
        inp["lr_B"] = (0.2 * torch.randn(rank, d, generator=gen)).to(DEVICE)
    return inp


variants = st.sampled_from([(True, False), (False, True), (True, True)])


@given(rows=st.integers(1, 70), d=st.integers(1, 150), rank=st.integers(1, 80), variant=variants,
       scale=scales, seed=seeds)
def test_kernel_matches_reference_fp32(rows, d, rank, variant, scale, seed):
    rw, lr = variant
    rank = min(rank, d)
    inp = _inputs(rows, d, rank, rw, lr, scale, seed)
    assert_parity(laurel, laurel_reference, inp, list(inp))


def test_kernel_handles_leading_dims_and_noncontiguous():
    inp = _inputs(2 * 3 * 5, 24, 4, True, True, 1.0, 3)
    base_f = torch.randn(24, 30, device=DEVICE).t()  # non-contiguous [30, 24]
    inp["sublayer_output"] = (base_f.reshape(2, 3, 5, 24) if base_f.is_contiguous()
                              else base_f.contiguous().reshape(2, 3, 5, 24))
    inp["x"] = inp["x"].reshape(2, 3, 5, 24)
    assert_parity(laurel, laurel_reference, inp, list(inp))


def test_module_backends_agree_including_parameter_grads():
    torch.manual_seed(0)
    m = LAuReL(33, use_rw=True, use_lr=True, lr_rank=5).to(DEVICE)
    with torch.no_grad():
        m.lr_B.normal_()
    f = torch.randn(4, 9, 33, device=DEVICE, requires_grad=True)
    x = torch.randn(4, 9, 33, device=DEVICE, requires_grad=True)
    g = torch.randn(4, 9, 33, device=DEVICE)
    res = []
    for backend in ("reference", "triton"):
        m.backend = backend
        y = m(x, sublayer_output=f)
        res.append((y, torch.autograd.grad(y, [f, x, *m.parameters()], g)))
    torch.testing.assert_close(res[0][0], res[1][0])
    for a, b in zip(res[0][1], res[1][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_triton_rejects_float64():
    with pytest.raises(DTypeError):
        laurel(torch.randn(2, 4, dtype=torch.float64, device=DEVICE),
               sublayer_output=torch.randn(2, 4, dtype=torch.float64, device=DEVICE))


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("CPU-only behaviour")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = LAuReL(8, backend="triton")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        m(torch.randn(2, 8), sublayer_output=torch.randn(2, 8))


def test_opcheck_schema_and_autograd_registration():
    f = torch.randn(5, 12, device=DEVICE, requires_grad=True)
    x = torch.randn(5, 12, device=DEVICE, requires_grad=True)
    t = torch.randn(5, 3, device=DEVICE, requires_grad=True)
    B = torch.randn(3, 12, device=DEVICE, requires_grad=True)
    w = torch.tensor([0.3, 0.7], device=DEVICE, requires_grad=True)
    # The fake-tensor and AOT checks would execute the interpreter on meta tensors;
    # they run in the GPU-marked test below.
    torch.library.opcheck(laurel_combine, (f, x, t, B, w), test_utils=("test_schema", "test_autograd_registration"))


@pytest.mark.gpu
def test_opcheck_full_gpu():
    f, x = torch.randn(64, 96, device="cuda"), torch.randn(64, 96, device="cuda")
    t, B = torch.randn(64, 16, device="cuda"), torch.randn(16, 96, device="cuda")
    w = torch.tensor([0.3, 0.7], device="cuda")
    torch.library.opcheck(laurel_combine, (f, x, t, B, w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_reference_low_precision(dtype):
    inp = _inputs(257, 1000, 32, True, True, 1.0, 0, dtype=dtype)
    inp["sublayer_output"], inp["x"] = inp["sublayer_output"].to(dtype), inp["x"].to(dtype)
    assert_parity(laurel, laurel_reference, inp, list(inp), dtype=dtype)


@pytest.mark.gpu
def test_compile_fullgraph_smoke():
    m = LAuReL(256, use_rw=True, use_lr=True, lr_rank=32).cuda()
    f = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
    x = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
    compiled = torch.compile(m, fullgraph=True)
    y = compiled(x, sublayer_output=f)
    y.sum().backward()
    torch.testing.assert_close(y, m(x, sublayer_output=f))
