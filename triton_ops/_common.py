"""Pieces every kernel file uses: allocation, dtype plumbing, launch settings and
the declaration of each kernel's launchable configurations (read by the static
sm_90 check and by ``bench/report.py``)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import triton

# Whether the kernels below are interpreter functions: triton.jit reads TRITON_INTERPRET
# when a kernel is defined, so setting it later has no effect (resolve_backend says so).
INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRET_AT_IMPORT:
    from ._interpreter import patch_interpreter_bf16, patch_interpreter_nested_calls

    patch_interpreter_bf16()
    patch_interpreter_nested_calls()

# Tests flip this so every fresh output starts as NaN: an element a kernel forgets
# to write then fails the comparison instead of passing on leftover memory.
_FILL_NAN = os.environ.get("LAMINAE_FILL_NAN", "0") == "1"


def set_fill_nan(enabled: bool) -> None:
    global _FILL_NAN
    _FILL_NAN = bool(enabled)


def empty(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if _FILL_NAN and out.is_floating_point():
        out.fill_(float("nan"))
    return out


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return empty(t.shape, dtype=dtype or t.dtype, device=t.device)


def contiguous(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else t.contiguous() for t in tensors)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact ("ieee") products so fp32 results match the reference;
    bf16/fp16 use the tensor cores natively and ignore this setting."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def num_programs_for_rows(n_rows: int, device: torch.device) -> int:
    """Persistent-grid size for row-wise kernels that accumulate per-column sums:
    one program per SM (a few per SM on GPU), so the partial-sum buffer stays small."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_rows, 2 * sms))
    return max(1, min(n_rows, 4))


def block_for(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(n))


# ----------------------------------------------------------------------------
# Launch configurations as data
# ----------------------------------------------------------------------------

_TORCH_TO_TRITON = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def triton_dtype(dtype: torch.dtype) -> str:
    return _TORCH_TO_TRITON[dtype]


@dataclass(frozen=True)
class StaticCase:
    """One kernel at one configuration it can be launched with.

    ``signature`` maps every runtime argument to a Triton type string ("*fp32",
    "i32", "fp32"); constexpr arguments are listed in ``constexprs``.
    ``num_warps``/``num_stages`` must be what the launch passes; their defaults are
    Triton's own for CUDA (4 warps, 3 stages), which a launch that passes neither gets.
    ``expect`` names the tensor-core instruction kind the SASS must contain ("HGMMA"
    for a 16-bit matmul-shaped kernel built for Hopper's wgmma; "" checks nothing):
    the static check fails a configuration that silently fell back to mma.sync.
    ``divisible`` names arguments compiled as multiples of 16 (bytes for pointers),
    as Triton's launcher specializes them at run time: pointers to 16-byte-aligned
    tensors (every fresh torch allocation) and integers such as a head dim of 64 or
    128. List only what every launch of the configuration guarantees.
    """

    name: str
    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    tags: dict[str, Any] = field(default_factory=dict)
    expect: str = ""
    divisible: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        parts = [f"{k}={v}" for k, v in self.constexprs.items() if k.isupper()]
        parts += [f"warps={self.num_warps}", f"stages={self.num_stages}"]
        return ",".join(parts)


StaticCaseSource = Callable[[], Iterator[StaticCase]]
