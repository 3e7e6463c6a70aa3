import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from laminae.primitives import BackendUnavailableError, DTypeError, ShapeError
from laminae.primitives.xsa import ExclusiveSelfAttention, xsa_reference
from laminae.triton_ops.xsa import xsa, xsa_op

from .._helpers import DEVICE, assert_parity, scales, seeds

MODES = ("normalized", "squared_norm")


def _inputs(batch, seq, heads, kv_heads, dim, mode, scale=1.0, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return {
        "y": (torch.randn(batch, seq, heads, dim, generator=gen) * scale).to(DEVICE, dtype),
        "v": (torch.randn(batch, seq, kv_heads, dim, generator=gen) * scale).to(DEVICE, dtype),
        "mode": mode,
    }


@given(batch=st.integers(1, 2), seq=st.integers(1, 20),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), dim=st.sampled_from([1, 5, 16, 24, 64]),
       mode=st.sampled_from(MODES), scale=scales, seed=seeds)
def test_kernel_matches_reference_fp32(batch, seq, heads, dim, mode, scale, seed):
    inp = _inputs(batch, seq, *heads, dim, mode, scale, seed)
    assert_parity(xsa, xsa_reference, inp, ["y", "v"])


@pytest.mark.parametrize("mode", MODES)
def test_large_group_and_widest_head(mode):
    # 16 query heads per kv head: the program loops over the group in chunks
    assert_parity(xsa, xsa_reference, _inputs(1, 3, 16, 1, 40, mode, seed=1), ["y", "v"])
    assert_parity(xsa, xsa_reference, _inputs(1, 2, 2, 2, 256, mode, seed=2), ["y", "v"])


@pytest.mark.parametrize("mode", MODES)
def test_zero_and_tiny_value_vectors(mode):
    inp = _inputs(2, 4, 4, 2, 8, mode, seed=3)
    inp["v"][0, 1, 0] = 0.0
    inp["v"][1, 3, 1] *= 1e-4
    assert_parity(xsa, xsa_reference, inp, ["y", "v"])
    out = xsa(inp["y"], inp["v"], mode=mode)
    assert torch.equal(out[0, 1, :2], inp["y"][0, 1, :2])


@pytest.mark.parametrize("mode", MODES)
def test_custom_eps(mode):
    inp = _inputs(1, 6, 2, 1, 8, mode, scale=1e-2, seed=4)
    inp["eps"] = 1e-3
    assert_parity(xsa, xsa_reference, inp, ["y", "v"])


def test_noncontiguous_inputs_in_heads_first_layout():
    gen = torch.Generator().manual_seed(5)
    y = torch.randn(2, 4, 7, 8, generator=gen).to(DEVICE).transpose(1, 2)  # (B, H, S, D) -> (B, S, H, D)
    v = torch.randn(2, 2, 7, 8, generator=gen).to(DEVICE).transpose(1, 2)
    assert not y.is_contiguous()
    assert_parity(xsa, xsa_reference, {"y": y, "v": v}, ["y", "v"])


def test_empty_sequence():
    y, v = torch.randn(2, 0, 4, 8, device=DEVICE), torch.randn(2, 0, 2, 8, device=DEVICE)
    assert xsa(y, v).shape == (2, 0, 4, 8)


def test_module_backends_agree():
    torch.manual_seed(0)
    m = ExclusiveSelfAttention(6, 2, 12, mode="squared_norm").to(DEVICE)
    y = torch.randn(2, 9, 6, 12, device=DEVICE, requires_grad=True)
    v = torch.randn(2, 9, 2, 12, device=DEVICE, requires_grad=True)
    g = torch.randn(2, 9, 6, 12, device=DEVICE)
    res = []
    for backend in ("reference", "triton"):
        m.backend = backend
        out = m(y, v=v)
        res.append((out, torch.autograd.grad(out, [y, v], g)))
    torch.testing.assert_close(res[0][0], res[1][0])
    for a, b in zip(res[0][1], res[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_triton_rejects_float64_and_wide_heads():
    y = torch.randn(1, 2, 2, 4, dtype=torch.float64, device=DEVICE)
    v = torch.randn(1, 2, 1, 4, dtype=torch.float64, device=DEVICE)
    with pytest.raises(DTypeError):
        xsa(y, v)
    with pytest.raises(ShapeError, match="head_dim <= 256"):
        xsa(torch.randn(1, 1, 1, 300, device=DEVICE), torch.randn(1, 1, 1, 300, device=DEVICE))


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("CPU-only behaviour")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = ExclusiveSelfAttention(2, 1, 8, backend="triton")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        m(torch.randn(1, 2, 2, 8), v=torch.randn(1, 2, 1, 8))


def test_opcheck_schema_and_autograd_registration():
    y = torch.randn(2, 3, 4, 8, device=DEVICE, requires_grad=True)
    v = torch.randn(2, 3, 2, 8, device=DEVICE, requires_grad=True)
    # The fake-tensor and AOT checks would execute the interpreter on meta tensors;
    # they run in the GPU-marked test below.
    torch.library.opcheck(xsa_op, (y, v, True, 1e-8), test_utils=("test_schema", "test_autograd_registration"))


@pytest.mark.gpu
@pytest.mark.parametrize("normalized", [True, False])
def test_opcheck_full_gpu(normalized):
    y = torch.randn(4, 33, 8, 64, device="cuda", requires_grad=True)
    v = torch.randn(4, 33, 2, 64, device="cuda", requires_grad=True)
    torch.library.opcheck(xsa_op, (y, v, normalized, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 128), (4, 4, 64), (12, 1, 96)])
def test_kernel_matches_reference_low_precision(dtype, mode, heads, kv_heads, dim):
    inp = _inputs(3, 257, heads, kv_heads, dim, mode, seed=0, dtype=dtype)
    assert_parity(xsa, xsa_reference, inp, ["y", "v"], dtype=dtype)


@pytest.mark.gpu
def test_compile_fullgraph_smoke():
    m = ExclusiveSelfAttention(8, 2, 64).cuda()
    y = torch.randn(2, 128, 8, 64, device="cuda", requires_grad=True)
    v = torch.randn(2, 128, 2, 64, device="cuda", requires_grad=True)
    compiled = torch.compile(m, fullgraph=True)
    out = compiled(y, v=v)
    out.sum().backward()
    torch.testing.assert_close(out, m(y, v=v))
