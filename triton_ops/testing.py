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
random upstream gradient through every floating output, and compares outputs and
every named gradient. fp32/fp64: the reference on the same inputs, within
:data:`TOLERANCES`. bf16/fp16: the truth is the reference in fp32, and the op may be
at most twice as far from it as the same-dtype reference, plus the dtype's atol.
``parity_float64`` bounds an fp32 op's relative RMSE against the reference run in
float64 (2e-5): a uniform ×1.001 error in any gradient fails it, which element-wise
fp32 tolerances let through.
``hypothesis`` is only needed for the strategies (the ``test`` extra).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from ._parity import (FLOAT64_ABS_RMS, FLOAT64_REL_RMSE, TOLERANCES, Comparison, ParityResult, compare, parity,
                      parity_float64, tolerance)

__all__ = ["TOLERANCES", "FLOAT64_REL_RMSE", "FLOAT64_ABS_RMS", "Comparison", "ParityResult", "compare", "parity",
           "parity_float64", "tolerance", "assert_parity",
           "keep_mask", "scales", "seeds", "attention_shapes", "lengths"]


def assert_parity(op: Callable, reference: Callable, inputs: Mapping[str, object], grad_names: Sequence[str], *,
                  dtype: torch.dtype | None = None, seed: int = 0,
                  output_names: Sequence[str] | None = None) -> ParityResult:
    """:func:`parity`, raising ``AssertionError`` with the per-tensor report on a mismatch."""
    result = parity(op, reference, inputs, grad_names, dtype=dtype, seed=seed, output_names=output_names)
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


def attention_shapes(max_len: int = 40, head_dims: Sequence[int] = (8, 16, 24, 32)):
    """``dict(batch, seq, cached, heads, kv_heads, head_dim)``: query length ``seq``,
    ``cached`` earlier key positions (decoding), grouped-query head pairs."""
    st = _st()
    return st.fixed_dictionaries({
        "batch": st.integers(1, 2),
        "seq": lengths(max_len),
        "cached": st.sampled_from([0, 0, 3, 16]),
        "heads": st.just(None),
        "kv_heads": st.just(None),
        "head_dim": st.sampled_from(list(head_dims)),
    }).flatmap(lambda d: st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]).map(
        lambda hk: {**d, "heads": hk[0], "kv_heads": hk[1]}))
