"""Corrections to Triton's CPU interpreter, applied only when kernels are interpreted.

Triton 3.6's interpreter stores bfloat16 tensors as their raw uint16 bits and hands
those integers to ``np.matmul`` in ``tl.dot``: a bf16 product comes out as a product of
bit patterns (errors of 1e10 on a 16×16 tile), while fp16 and fp32 dots are exact.
Compiled kernels are unaffected. The fix widens bf16 operands to the fp32 values they
encode (exact: bf16 is the top half of an fp32), which is what the tensor cores
multiply with fp32 accumulation, so bf16 kernels can be checked on CPU like the others.
"""
from __future__ import annotations

import numpy as np

_PATCHED = False


def _bf16_bits_as_fp32(data: np.ndarray) -> np.ndarray:
    return (data.astype(np.uint32) << 16).view(np.float32)


def patch_interpreter_bf16_dot() -> None:
    """Make the interpreter's ``tl.dot`` read bf16 operands as numbers (idempotent)."""
    global _PATCHED
    if _PATCHED:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a = _widen(a, tl)
            b = _widen(b, tl)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    _PATCHED = True


def _widen(handle, tl):
    from triton.runtime.interpreter import TensorHandle

    if handle.dtype.scalar != tl.bfloat16:
        return handle
    return TensorHandle(_bf16_bits_as_fp32(handle.data), tl.float32)


_NESTED_PATCHED = False


def patch_interpreter_nested_calls() -> None:
    """Patch ``triton.language`` once per launch, not once per nested ``@triton.jit`` call.

    Triton 3.6's interpreter re-patches the language modules (``inspect.getmembers`` over
    them) on every call of a jit helper inside a kernel, and ``tl.sum``/``tl.max``/``tl.min``
    are such helpers: in kernels with reductions or helpers in their loops that was 30–40 %
    of interpreter time, with the same result each time. While a launch has the language
    patched, a nested call now only patches the modules its function sees that are not
    patched yet (added to the launch's scope, so the launch restores them too)."""
    global _NESTED_PATCHED
    if _NESTED_PATCHED:
        return
    import inspect
    import types

    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    active: dict = {}                     # while a launch runs: its scope and the modules patched

    def patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if not active:
            scope = original(fn)
            active.update(scope=scope, done={id(v) for v in langs})
            restore = scope.restore

            def restore_and_end():
                active.clear()
                restore()

            scope.restore = restore_and_end
            return scope
        missing = [v for v in langs if id(v) not in active["done"]]
        if missing:
            extra = original(types.SimpleNamespace(__globals__={f"lang{i}": v for i, v in enumerate(missing)}))
            active["scope"]._changes.extend(extra._changes)
            active["done"].update(id(v) for v in missing)
        return interpreter._LangPatchScope()

    interpreter._patch_lang = patch_lang
    _NESTED_PATCHED = True
