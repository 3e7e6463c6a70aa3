"""Property-based equivalence testing as a public API.

The routine, tolerance table and hypothesis strategies the laminae suite uses to
check every kernel against its reference, for users who write the same kind of test
for their own ops (or rerun ours on their hardware)::

    from hypothesis import given
    from laminae.triton_ops.testing import assert_parity, attention_shapes, scales, seeds

    @given(shape=attention_shapes(), scale=scales(), seed=seeds())
    def test_my_kernel(shape, scale, seed):
        inputs = make_inputs(**shape, scale=scale, seed=seed)
        assert_parity(my_kernel, my_reference, inputs, grad_names=["q", "k", "v"])

``parity`` runs ``op`` and ``reference`` on identical inputs, backpropagates one
random upstream gradient (drawn in the op's output dtype) through every floating
output, and compares outputs and every named gradient. fp32/fp64: the reference on
the same inputs, within :data:`TOLERANCES`. bf16/fp16: the truth is the reference in
fp32, and the op may be at most twice as far from it as the same-dtype reference,
plus the dtype's atol. ``parity_float64`` bounds an op's relative RMSE against the
reference run in float64 (fp32: 2e-5, bf16/fp16: two ulps of the dtype; plus
:data:`FLOAT64_ABS_RMS` per element of the largest compared tensor): a uniform
×1.001 error in any fp32 gradient fails it, which element-wise tolerances let through. All three take ``where={name: bool mask}``
to compare only chosen elements of an output (``"out0"``, or its ``output_names``
entry) or gradient (``"dq"`` for input ``q``).
``hypothesis`` is only needed for the strategies (the ``test`` extra); what they
draw are plain dicts and numbers, so a falsifying example prints as one.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from ._parity import (FLOAT64_ABS_RMS, FLOAT64_REL_RMSE, FLOAT64_REL_RMSE_ULPS, TOLERANCES, Comparison, ParityResult,
                      compare, parity, parity_float64, tolerance)

__all__ = ["TOLERANCES", "FLOAT64_REL_RMSE", "FLOAT64_REL_RMSE_ULPS", "FLOAT64_ABS_RMS", "Comparison", "ParityResult",
           "compare", "parity",
           "parity_float64", "tolerance", "assert_parity",
           "keep_mask", "scales", "seeds", "attention_shapes", "lengths", "HEAD_PAIRS"]


def assert_parity(op: Callable, reference: Callable, inputs: Mapping[str, object], grad_names: Sequence[str], *,
                  dtype: torch.dtype | None = None, seed: int = 0,
                  output_names: Sequence[str] | None = None,
                  where: Mapping[str, torch.Tensor] | None = None) -> ParityResult:
    """:func:`parity`, raising ``AssertionError`` with the per-tensor report on a mismatch."""
    result = parity(op, reference, inputs, grad_names, dtype=dtype, seed=seed, output_names=output_names,
                    where=where)
    if not result.ok:
        raise AssertionError("op differs from reference:\n" + result.report())
    return result


def keep_mask(batch: int, length: int, generator: torch.Generator, p_drop: float = 0.3,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """A ``(batch, length)`` bool keep mask with random holes (ragged padding)."""
    return (torch.rand(batch, length, generator=generator) > p_drop).to(device)


def _st():
    from hypothesis import strategies as st

    return st


def scales():
    """Value scales, not only shapes: tiny, unit and large magnitudes."""
    return _st().sampled_from([1e-2, 1.0, 4.0])


def seeds():
    return _st().integers(min_value=0, max_value=2**16)


def lengths(max_len: int = 40):
    """Sequence lengths including 1, non-powers of two and one block plus one."""
    st = _st()
    return st.one_of(st.sampled_from([1, 2, 17, 33]), st.integers(1, max_len))


HEAD_PAIRS = ((1, 1), (2, 1), (4, 2), (3, 3))


def attention_shapes(max_len: int = 40, head_dims: Sequence[int] = (8, 16, 24, 32)):
    """``dict(batch, seq, cached, heads, kv_heads, head_dim)``: query length ``seq``,
    ``cached`` earlier key positions (decoding), grouped-query head pairs
    (:data:`HEAD_PAIRS`). One fixed dictionary per head pair rather than a mapped
    draw, so a falsifying example prints as the dict itself."""
    st = _st()
    return st.one_of([st.fixed_dictionaries({
        "batch": st.integers(1, 2),
        "seq": lengths(max_len),
        "cached": st.sampled_from([0, 0, 3, 16]),
        "heads": st.just(heads),
        "kv_heads": st.just(kv_heads),
        "head_dim": st.sampled_from(list(head_dims)),
    }) for heads, kv_heads in HEAD_PAIRS])
