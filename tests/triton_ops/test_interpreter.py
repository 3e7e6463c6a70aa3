"""The interpreter corrections in ``triton_ops/_interpreter.py``: a bf16 ``tl.dot``
multiplies the numbers the bits encode, and fp32 → bf16 rounds to nearest even
(compiled kernels: the tensor cores and ``cvt.rn.bf16.f32`` do)."""
import pytest
import torch
import triton
import triton.language as tl

import laminae.triton_ops._common  # noqa: F401  (applies the correction when interpreting)

from .._helpers import DEVICE


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_16bit_dot_multiplies_values_with_fp32_accumulation(dtype):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=gen).to(dtype=dtype, device=DEVICE)
    b = torch.randn(32, 16, generator=gen).to(dtype=dtype, device=DEVICE)
    c = torch.empty(16, 16, device=DEVICE)
    _dot_kernel[(1,)](a, b, c, 16, 32, 16)
    # operands are exact in fp32, so the only difference is the order of fp32 sums
    # (and tf32 on a GPU for fp32 inputs)
    tol = 1e-2 if dtype == torch.float32 and DEVICE.type == "cuda" else 1e-5
    torch.testing.assert_close(c, a.double().matmul(b.double()).float(), atol=tol, rtol=tol)


@triton.jit
def _cast_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))


def test_fp32_to_bf16_rounds_to_nearest_even():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(245, generator=gen)                                          # 256 values in all
    ulp = torch.tensor([1.0, 1.0, 3.0, -3.0]).to(torch.bfloat16).float() * 2.0**-8   # bf16 ulp at 1, 1, 3, −3
    ties = torch.tensor([1.0, 1.0078125, 3.0, -3.0]) + ulp / 2                   # halfway: to the even neighbour
    special = torch.tensor([float("inf"), float("-inf"), 3.3895e38, 0.0, -0.0, 1e-40])
    x = torch.cat([x, 0.999999 * torch.ones(1), ties, special]).to(DEVICE)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _cast_kernel[(1,)](x, y, x.numel())
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    nan = torch.full((1,), float("nan"), device=DEVICE)
    y = torch.empty(1, dtype=torch.bfloat16, device=DEVICE)
    _cast_kernel[(1,)](nan, y, 1)
    assert torch.isnan(y).all()


@triton.jit
def _halve(x):
    return x * 0.5


@triton.jit
def _nested_kernel(x_ptr, out_ptr, steps, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    acc = 0.0
    for _ in range(steps):
        acc += tl.sum(_halve(x), axis=0)          # a helper and a library jit function per step
    tl.store(out_ptr, acc)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="interpreter behaviour")
def test_nested_jit_calls_do_not_repatch_the_language(monkeypatch):
    """A launch patches triton.language once; nested @triton.jit calls (helpers, tl.sum)
    reuse it instead of re-patching it per call, and the language is restored after."""
    from triton.runtime import interpreter

    calls = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: calls.append(1) or original(*a))
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty(1)
    counts = []
    for steps in (1, 6):
        calls.clear()
        _nested_kernel[(1,)](x, out, steps, 8)
        counts.append(len(calls))
        assert out.item() == steps * 14.0
    assert counts[0] == counts[1]
    assert tl.sum is interpreter.tl.standard.sum and not hasattr(tl.core.tensor, "__index__")
