"""Token ids outside ``[0, vocab_size)``: one behaviour for every block that embeds ids.

``validate_ids=True`` reads the ids and raises :class:`TokenIdError` before any kernel
(on a GPU that read is a device sync). ``validate_ids=False`` (the default) never reads
them on the host: the out-of-range rows of the output are NaN, on the reference and on
the kernels alike, so a bad id cannot pass as an ordinary embedding. Under
``torch.compile`` the host check is skipped (it would need the ids' values while
tracing) and the NaN rows remain the signal.
"""
from __future__ import annotations

import torch

from ._errors import TokenIdError


def ids_in_range(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool mask, ``ids.shape``: True where ``0 <= id < vocab_size`` (no sync)."""
    return (ids >= 0) & (ids < vocab_size)


def safe_ids(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``ids`` with every out-of-range id replaced by 0, so gathers stay in bounds."""
    return torch.where(valid, ids, torch.zeros((), dtype=ids.dtype, device=ids.device))


def nan_rows(out: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``out`` [*valid.shape, D] with the rows of out-of-range ids set to NaN (no gradient flows through them)."""
    return torch.where(valid.unsqueeze(-1), out, torch.full((), float("nan"), dtype=out.dtype, device=out.device))


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int, keep: torch.Tensor | None = None) -> None:
    """Raise :class:`TokenIdError` if an id (at a kept position) lies outside ``[0, vocab_size)``."""
    if ids.numel() == 0 or torch.compiler.is_compiling():
        return
    bad = ~ids_in_range(ids, vocab_size)
    if keep is not None:
        bad &= keep.bool()
    if bool(bad.any()):
        values = ids[bad]
        raise TokenIdError(f"`{name}` must lie in [0, vocab_size={vocab_size}), got {int(values[0])} "
                           f"({values.numel()} of {ids.numel()} ids out of range, values in "
                           f"[{int(values.min())}, {int(values.max())}])")
