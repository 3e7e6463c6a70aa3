"""Shared test helpers: kernel-vs-reference assertions and hypothesis strategies."""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from hypothesis import strategies as st  # noqa: F401  (test files import it from here too)

import laminae.triton_ops.testing as public

from laminae.triton_ops.testing import parity

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def assert_parity(op: Callable, reference: Callable, inputs: Mapping[str, object],
                  grad_names: Sequence[str], *, dtype: torch.dtype | None = None, seed: int = 0,
                  output_names: Sequence[str] | None = None):
    """Output and every listed gradient of ``op`` match ``reference`` within the
    shared per-dtype, per-direction tolerances."""
    result = parity(op, reference, inputs, grad_names, dtype=dtype, seed=seed, output_names=output_names)
    assert result.ok, "kernel differs from reference:\n" + result.report()
    return result


def randn(*shape, dtype=torch.float32, scale: float = 1.0, generator=None) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * scale).to(dtype=dtype, device=DEVICE)


# Value scales, not only shapes: tiny, unit and large magnitudes (the public strategies).
scales = public.scales()
seeds = public.seeds()


def keep_mask(batch: int, length: int, gen: torch.Generator, p_drop: float = 0.3) -> torch.Tensor:
    """Ragged padding: random left or right padding per row, plus random holes."""
    m = (torch.rand(batch, length, generator=gen) > p_drop)
    return m.to(DEVICE)
