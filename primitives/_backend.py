"""Backend dispatch shared by every module.

``backend="auto"``      Triton for CUDA tensors, the reference otherwise.
``backend="triton"``    always the kernel; on CPU only under ``TRITON_INTERPRET=1``
                        (the Triton interpreter, a correctness tool), else an error.
``backend="reference"`` always the plain-PyTorch reference.

There is no silent fallback from "triton" to "reference": asking for the kernel
and getting the reference would make every test and benchmark a lie.
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Literal

import torch

from ._errors import BackendUnavailableError, ConfigError

Backend = Literal["auto", "triton", "reference"]
BACKENDS = ("auto", "triton", "reference")
_warned: set[str] = set()


def check_backend(backend: object) -> None:
    if backend not in BACKENDS:
        raise ConfigError(f"`backend` must be one of {list(BACKENDS)}, got {backend!r}")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, *tensors: torch.Tensor | None) -> str:
    """Return "triton" or "reference" for these inputs, or raise."""
    check_backend(backend)
    if backend == "reference":
        return "reference"
    devices = {t.device.type for t in tensors if t is not None}
    on_cuda = devices == {"cuda"}
    if backend == "auto":
        if not on_cuda:
            return "reference"
        if not triton_available():
            if "no-triton" not in _warned:
                _warned.add("no-triton")
                warnings.warn("laminae: triton is not installed; CUDA inputs run the PyTorch reference", stacklevel=3)
            return "reference"
        return "triton"
    # backend == "triton"
    if not triton_available():
        raise BackendUnavailableError("backend='triton' requested but the `triton` package is not installed")
    if on_cuda:
        return "triton"
    if triton_interpreting():
        return "triton"
    raise BackendUnavailableError(
        f"backend='triton' needs CUDA tensors (got device {sorted(devices)}); on CPU set "
        "TRITON_INTERPRET=1 before importing triton to run the kernels in the interpreter, "
        "or use backend='reference'"
    )


def backend_label(tensors_device: torch.device) -> str:
    """Human-readable name of what backend='triton' executes on this device."""
    if tensors_device.type == "cuda":
        return "triton (compiled)"
    return "triton (interpreter)"
