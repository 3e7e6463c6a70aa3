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
