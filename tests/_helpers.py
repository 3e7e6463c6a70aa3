"""Shared test helpers: kernel-vs-reference assertions and hypothesis strategies."""
from __future__ import annotations

import torch

import laminae.triton_ops.testing as public
from laminae.triton_ops.testing import assert_parity  # noqa: F401  (the public routine, re-exported here)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def randn(*shape, dtype=torch.float32, scale: float = 1.0, generator=None) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * scale).to(dtype=dtype, device=DEVICE)


# Value scales, not only shapes: tiny, unit and large magnitudes (the public strategies).
scales = public.scales()
seeds = public.seeds()


def keep_mask(batch: int, length: int, gen: torch.Generator, p_drop: float = 0.3) -> torch.Tensor:
    """Ragged padding: random holes (the public strategy, on the test device)."""
    return public.keep_mask(batch, length, gen, p_drop, DEVICE)


def host_reads(fn) -> int:
    """How many times ``fn`` read a tensor value back to the host (``.item()``, ``bool(t)``,
    ``int(t)``): on a GPU each is a device sync."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n
