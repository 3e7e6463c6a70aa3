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
import sys
import warnings
from contextlib import contextmanager
from typing import Iterator, Literal

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


def _kernels_compiled_before_interpret() -> bool:
    """True when laminae's kernel files were imported while TRITON_INTERPRET was off:
    their ``@triton.jit`` functions are then compiled kernels, which cannot run on CPU."""
    common = sys.modules.get("laminae.triton_ops._common")
    return common is not None and not getattr(common, "INTERPRET_AT_IMPORT", True)


def resolve_backend(backend: str, *tensors: torch.Tensor | None) -> str:
    """Return "triton" or "reference" for these inputs, or raise."""
    check_backend(backend)
    if backend == "reference":
        return "reference"
    devices = {t.device.type for t in tensors if t is not None}
    on_cuda = devices == {"cuda"}
    if backend == "triton" and "meta" in devices:
        raise BackendUnavailableError(
            "backend='triton' cannot run on meta tensors (they hold no data); use backend='reference' "
            "(or 'auto') for shape inference on the meta device")
    if backend == "triton" and not on_cuda and torch.compiler.is_compiling():
        raise BackendUnavailableError(
            "backend='triton' under torch.compile needs CUDA tensors (the Triton interpreter cannot be "
            "traced); on CPU compile the module with backend='reference' or 'auto'")
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
        if _kernels_compiled_before_interpret():
            raise BackendUnavailableError(
                "TRITON_INTERPRET=1 was set after laminae's Triton kernels were imported, so they were "
                "built for a GPU; set it before the first import of triton or laminae.triton_ops "
                "(e.g. in the shell or at the top of the script)")
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


def _is_laminae_block(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith("laminae.") and isinstance(getattr(module, "backend", None), str)


def set_backend(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    """Set ``backend`` on every laminae block inside ``model`` (``model`` included, any
    depth: children of a block too), and return ``model``.

    Example::

        set_backend(model, "triton")     # every laminae block of the model runs its kernels
    """
    check_backend(backend)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
    for module in model.modules():
        if _is_laminae_block(module):
            module.backend = backend
    return model


@contextmanager
def use_backend(model: torch.nn.Module, backend: str) -> Iterator[torch.nn.Module]:
    """``with use_backend(model, "reference"): ...`` runs every laminae block of
    ``model`` on ``backend`` and restores each block's own setting afterwards."""
    check_backend(backend)
    saved = [(m, m.backend) for m in model.modules() if _is_laminae_block(m)]
    set_backend(model, backend)
    try:
        yield model
    finally:
        for module, previous in saved:
            module.backend = previous


def interpret_without_cuda() -> bool:
    """Before triton is first imported: on a machine without CUDA, set
    ``TRITON_INTERPRET=1`` (unless the caller set it) so ``backend="triton"`` runs the
    kernels in the interpreter, as the tests and the tour do. Returns whether the
    interpreter is on. Called by the command-line entry points, never on import."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return triton_interpreting()
