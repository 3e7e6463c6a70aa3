"""The interpreter correction in ``triton_ops/_interpreter.py``: a bf16 ``tl.dot``
multiplies the numbers the bits encode (compiled kernels: the tensor cores do)."""
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
