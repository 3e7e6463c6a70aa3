"""Corrections to Triton's CPU interpreter, applied only when kernels are interpreted.

Triton 3.6's interpreter stores bfloat16 tensors as their raw uint16 bits, and

- hands those integers to ``np.matmul`` in ``tl.dot``: a bf16 product comes out as a
  product of bit patterns (errors of 1e10 on a 16×16 tile), while fp16 and fp32 dots
  are exact. The fix widens bf16 operands to the fp32 values they encode (exact: bf16
  is the top half of an fp32), which is what the tensor cores multiply with fp32
  accumulation;
- casts fp32 to bf16 by dropping the low 16 bits (rounding toward zero), where the
  GPU's ``cvt.rn.bf16.f32`` rounds to nearest even: every bf16 store and every bf16
  dot operand was up to one ulp off instead of half. The fix rounds to nearest even.

Compiled kernels are unaffected. With both, bf16 kernels can be checked on CPU like the
others.
"""
from __future__ import annotations

import numpy as np

_PATCHED = False


def _bf16_bits_as_fp32(data: np.ndarray) -> np.ndarray:
    return (data.astype(np.uint32) << 16).view(np.float32)


def _fp32_as_bf16_bits(data: np.ndarray) -> np.ndarray:
    """bf16 bit patterns of fp32 values, rounded to nearest even (NaN stays a quiet NaN)."""
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    return np.where(np.isnan(data), quiet_nan, rounded).astype(np.uint16)


def patch_interpreter_bf16() -> None:
    """Make the interpreter's ``tl.dot`` read bf16 operands as numbers and its fp32 →
    bf16 casts round to nearest even (idempotent)."""
    global _PATCHED
    if _PATCHED:
        return
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.interpreter import TensorHandle

    builder = interpreter.InterpreterBuilder
    original_dot = builder.create_dot
    original_cast = builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a = _widen(a, tl)
            b = _widen(b, tl)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return TensorHandle(_fp32_as_bf16_bits(src.data), tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
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
