"""A hybrid attention sub-layer: a local path plus a routed sparse path on one input.

    H(x) = local_attention(x) + sparse_attention(x)        (SHRAM: h_l + h_s)

Both paths read the same normalised ``x`` and the same positions
``J = (cumulative live count) − 1`` (continuing the cache's count), so left padding
gives the kept tokens the positions they would have without it. The sparse path's
load-balance loss goes to the decoder's aux losses, its MaxVio to the metrics
(``max_vio``, the max over layers).

``forward(x [B, N, d], attention_mask=None, cache=None) -> HybridAttentionOutput(output,
cache, load_balance_loss, max_vio)``; the cache is a :class:`HybridAttentionCache` (one per
layer, immutable). As for MoSRAH, ``cache=None`` is an uncached call and returns
``cache=None``; decoding starts from ``HybridAttentionCache(SlidingWindowCache())``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from laminae.primitives._cache import DecodingCache
from laminae.primitives._validation import check_has_tokens, check_keep_mask
from laminae.primitives.blocks.sliding_window import SlidingWindowAttention, SlidingWindowCache
from laminae.primitives.mosrah import MoSRAH, MoSRAHCache

from .decoder import BRANCH_CALLS

__all__ = ["HybridAttention", "HybridAttentionCache", "HybridAttentionOutput"]


@dataclass(eq=False)
class HybridAttentionCache(DecodingCache):
    local: SlidingWindowCache
    sparse: MoSRAHCache | None = None

    @property
    def length(self) -> int:
        return self.local.length

    @property
    def config(self) -> dict:
        return {**self.local.config, **({} if self.sparse is None else self.sparse.config)}

    def reset(self) -> None:
        self.local.reset()
        self.sparse = None


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

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: HybridAttentionCache | None = None):
        check_has_tokens("x", x)
        B, N, _ = x.shape
        if cache is not None and not isinstance(cache, HybridAttentionCache):
            raise TypeError(f"`cache` must be a HybridAttentionCache or None, got {type(cache).__name__}")
        mask = check_keep_mask("attention_mask", attention_mask, B, N)
        live = torch.ones(B, N, dtype=torch.bool, device=x.device) if mask is None else mask.bool()
        # padding contents never reach live rows, even as 0·NaN inside a masked product
        x = torch.where(live[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))
        sparse = None
        if cache is not None:
            sparse = cache.sparse or self.sparse_attention.empty_cache(B, dtype=x.dtype)
        past = sparse.live_tokens[:, None] if sparse is not None else 0
        positions = (torch.cumsum(live.long(), 1) + past - 1).clamp_min(0)
        local, local_cache = self.local_attention(x, positions, live, cache.local if cache is not None else None,
                                                  all_live=attention_mask is None)
        out = self.sparse_attention(x, positions, attention_mask, cache=sparse)
        new_cache = HybridAttentionCache(local_cache, out.cache) if cache is not None else None
        return HybridAttentionOutput(local + out.output, new_cache, out.load_balance_loss, out.max_vio)


def _call_hybrid(module, h, ctx, state):
    state = (state or HybridAttentionCache(SlidingWindowCache())) if ctx.decoding else None
    out, state, lb, vio = module(h, ctx.attention_mask, cache=state)
    ctx.aux_losses.append(lb)
    prev = ctx.metrics.get("max_vio")
    ctx.metrics["max_vio"] = vio if prev is None else torch.maximum(prev, vio)
    return out, state


BRANCH_CALLS[HybridAttention] = _call_hybrid
