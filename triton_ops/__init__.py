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

from laminae.primitives._mechanisms import ops as _declared_ops

# every mechanism's ops (primitives/_mechanisms.py), plus the shared flash core
_EXPORTS = {**_declared_ops(), "flash_attention": "_flash"}

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
