"""A hybrid attention sub-layer: a local path plus a routed sparse path on one input.

    H(x) = local_attention(x) + sparse_attention(x)        (SHRAM: h_l + h_s)

Both paths read the same normalised ``x`` and the same positions
``J = (cumulative live count) − 1`` (continuing the cache's count), so left padding
gives the kept tokens the positions they would have without it. The sparse path's
load-balance loss goes to the decoder's aux losses, its MaxVio to the metrics
(``max_vio``, the max over layers).

``forward(x [B, N, d], attention_mask=None, cache=None, *, position_ids=None) ->
HybridAttentionOutput(output, cache, load_balance_loss, max_vio)``; the cache is a
:class:`HybridAttentionCache` (one per layer, immutable) holding the two paths' caches.
As for MoSRAH, ``cache=None`` is an uncached call and returns ``cache=None``; decoding
starts from :meth:`HybridAttention.empty_cache`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from laminae.primitives._cache import DecodingCache
from laminae.primitives._validation import check_has_tokens, check_keep_mask, zero_padding
from laminae.primitives.blocks.sliding_window import SlidingWindowAttention, SlidingWindowCache
from laminae.primitives.mosrah import MoSRAH, MoSRAHCache

from .decoder import BRANCH_CALLS

__all__ = ["HybridAttention", "HybridAttentionCache", "HybridAttentionOutput"]


class HybridAttentionCache(DecodingCache):
    """The local path's frame and the sparse path's per-head rows, one per layer;
    start from :meth:`HybridAttention.empty_cache`."""

    def __init__(self, local: SlidingWindowCache, sparse: MoSRAHCache) -> None:
        self.local, self.sparse = local, sparse

    @property
    def length(self) -> int:
        return self.local.length

    @property
    def keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the local frame's keys, the sparse path's per-head keys)."""
        return self.local.keys, self.sparse.keys

    @property
    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.local.values, self.sparse.values

    @property
    def batch(self) -> int:
        return self.local.batch

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def config(self) -> dict:
        return {**self.local.config, **self.sparse.config}

    def reset(self) -> None:
        self.local.reset()
        self.sparse.reset()

    def clone(self) -> "HybridAttentionCache":
        return HybridAttentionCache(self.local.clone(), self.sparse.clone())


class HybridAttentionOutput(NamedTuple):
    """What :class:`HybridAttention` returns: ``output, cache`` first, as every decoding block."""

    output: torch.Tensor                     # [B, N, d] h_l + h_s
    cache: HybridAttentionCache | None       # the advanced cache when one was passed, else None
    load_balance_loss: torch.Tensor          # 0-dim, the sparse path's LB
    max_vio: torch.Tensor                    # 0-dim, detached


class HybridAttention(nn.Module):
    """``local_attention`` (:class:`SlidingWindowAttention`) + ``sparse_attention``
    (:class:`~laminae.primitives.mosrah.MoSRAH`), summed."""

    def __init__(self, local_attention: SlidingWindowAttention, sparse_attention: MoSRAH) -> None:
        super().__init__()
        self.local_attention, self.sparse_attention = local_attention, sparse_attention

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> HybridAttentionCache:
        """Both paths' empty caches (defaults: each path's parameter dtype and device)."""
        return HybridAttentionCache(self.local_attention.empty_cache(batch, dtype=dtype, device=device),
                                    self.sparse_attention.empty_cache(batch, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: HybridAttentionCache | None = None, *,
                position_ids: torch.Tensor | None = None) -> HybridAttentionOutput:
        check_has_tokens("x", x)
        B, N, _ = x.shape
        if cache is not None and not isinstance(cache, HybridAttentionCache):
            raise TypeError(f"`cache` must be a HybridAttentionCache (from HybridAttention.empty_cache) or None, "
                            f"got {type(cache).__name__}")
        mask = check_keep_mask("attention_mask", attention_mask, B, N)
        # padding contents never reach live rows (also not through the sparse path's routing)
        (x,) = zero_padding(mask, x)
        local, sparse = (None, None) if cache is None else (cache.local, cache.sparse)
        # both paths default to the same positions: live count − 1, continuing their caches
        local_out, local_cache = self.local_attention(x, mask, local, position_ids=position_ids)
        out = self.sparse_attention(x, mask, sparse, position_ids=position_ids)
        new_cache = HybridAttentionCache(local_cache, out.cache) if cache is not None else None
        return HybridAttentionOutput(local_out + out.output, new_cache, out.load_balance_loss, out.max_vio)


def _call_hybrid(module, h, ctx, state):
    if ctx.decoding and state is None:
        state = module.empty_cache(h.shape[0], device=h.device)
    out, state, lb, vio = module(h, ctx.attention_mask, cache=state if ctx.decoding else None)
    ctx.aux_losses.append(lb)
    prev = ctx.metrics.get("max_vio")
    ctx.metrics["max_vio"] = vio if prev is None else torch.maximum(prev, vio)
    return out, state


BRANCH_CALLS[HybridAttention] = _call_hybrid
