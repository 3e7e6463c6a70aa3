"""laminae.triton_ops: Triton forward/backward kernels, one file per mechanism.

Each public function has the signature of its ``*_reference`` twin in
``laminae.primitives`` and is differentiable (registered with
``torch.library.triton_op`` + ``register_autograd``).

Exports load lazily: importing this package does not import triton, so
``TRITON_INTERPRET`` can still be set (the tour and the tests do) before the
first kernel is defined.

Where a function shares its name with its file (``xsa``, ``laurel``, ...),
``laminae.triton_ops.xsa`` is the function, also after the file was imported (Python
would otherwise bind the submodule to that name). The kernel file itself is
``importlib.import_module("laminae.triton_ops.xsa")`` or ``from laminae.triton_ops.xsa
import ...``.

An exported function first checks where its tensors are, as the modules'
``backend="triton"`` does (``primitives/_backend.py::resolve_backend``): CPU tensors
without the interpreter, meta tensors or a CPU ``torch.compile`` raise
``BackendUnavailableError`` with the sentence that says what to do, instead of
Triton's "0 active drivers".
"""
import functools
import sys
import types
from importlib import import_module

_EXPORTS = {
    "affine_scaled_attention": "affine_scaled_attention",
    "derf_attention": "derf",
    "derf_context_gate": "derf",
    "elo_attention": "elo_attention",
    "engram_fusion": "engram",
    "engram_fusion_gate": "engram",
    "engram_lookup": "engram",
    "flash_attention": "_flash",
    "hrm_refinement": "hrm_refinement",
    "laurel": "laurel",
    "leviathan": "leviathan",
    "leviathan_spline": "leviathan",
    "lucid_attention": "lucid_attention",
    "memory_caching": "memory_caching",
    "mom_read": "mom_read",
    "shared_matrix": "shared_matrix",
    "mosrah": "mosrah",
    "mosrah_attention": "mosrah",
    "siamese_boundary": "siamese_norm",
    "spelling_bee": "spelling_bee",
    "stack_memory": "stack_memory",
    "stack_scan": "stack_memory",
    "stack_step": "stack_memory",
    "xsa": "xsa",
}

__all__ = sorted(_EXPORTS)


def _tensors(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _tensors(a)
        elif hasattr(a, "device") and hasattr(a, "dtype"):
            yield a


def _checked(fn):
    """``fn`` behind the modules' device check (one sentence for every way to call a kernel)."""
    from laminae.primitives._backend import resolve_backend

    @functools.wraps(fn)
    def op(*args, **kwargs):
        resolve_backend("triton", *_tensors(args), *_tensors(kwargs.values()))
        return fn(*args, **kwargs)

    return op


_checked_ops: dict = {}


def _export(name):
    if name not in _checked_ops:
        _checked_ops[name] = _checked(getattr(import_module(f".{_EXPORTS[name]}", __name__), name))
    return _checked_ops[name]


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # the import system binds a loaded submodule to the package attribute of its
        # name; where that name is the exported function, bind the function instead
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name and hasattr(value, name):
            value = _export(name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name):
    if name in _EXPORTS:
        return _export(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
