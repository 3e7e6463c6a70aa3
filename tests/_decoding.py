"""The one decoding loop of the tests: a prefill, then one-token steps, each call given
the cache the previous one returned (docs/protocol.md, "Decoding")."""
from __future__ import annotations

from typing import Any, Sequence

import torch


def prefill_then_decode(block, *inputs: torch.Tensor, cache: Any, prefill: int | None = None,
                        chunks: Sequence[int] | None = None, attention_mask: torch.Tensor | None = None,
                        sliced: dict[str, torch.Tensor] | None = None,
                        field: int | str | tuple[int | str, ...] = 0, **kwargs: Any) -> tuple[Any, Any]:
    """Run ``block`` over ``inputs`` (``[B, S, ...]`` each) as a prefill of the first
    ``prefill`` positions followed by one-token steps, or in the sizes ``chunks``:
    ``block(*inputs[:, part], attention_mask=attention_mask[:, part], cache=cache,
    **sliced[:, part], **kwargs)`` for each part, starting from ``cache`` (the mask is
    passed only when given). Returns ``field`` (an index or a name; a tuple of them gives a
    tuple) of every call's result concatenated along the sequence, and the last cache."""
    S = inputs[0].shape[1]
    if chunks is None:
        chunks = [prefill] + [1] * (S - prefill)
    assert sum(chunks) == S, f"chunks {list(chunks)} do not cover the {S} positions"
    fields = field if isinstance(field, tuple) else (field,)
    parts, start = [], 0
    for size in chunks:
        part = slice(start, start + size)
        mask = {} if attention_mask is None else {"attention_mask": attention_mask[:, part]}
        side = {name: t[:, part] for name, t in (sliced or {}).items()}
        result = block(*(t[:, part] for t in inputs), **mask, cache=cache, **side, **kwargs)
        parts.append([getattr(result, f) if isinstance(f, str) else result[f] for f in fields])
        cache, start = result.cache, start + size
    joined = tuple(torch.cat(column, dim=1) for column in zip(*parts))
    return (joined if isinstance(field, tuple) else joined[0]), cache
