"""Sliding-window causal multi-head attention over live tokens (SHRAM's local path h_l).

    q, k, v = x W_qᵀ, x W_kᵀ, x W_vᵀ             [B, N, H, u]
    q, k = RoPE(q, J), RoPE(k, J)                 plain θ_i = base^(−2i/u), fp32 angles
    ρ = (cumulative count of live tokens) − 1     over the frame the query sees
    key m visible to query n ⇔ live_n ∧ live_m ∧ 0 ≤ ρ(n) − ρ(m) < window
    out = o_proj(concat_h softmax(q·kᵀ/√u) v)     dead queries give 0

Visibility is by live rank, not by position (the public SHRAM implementation;
mosrah errata E3), so holes in the mask shrink nothing: every live query sees itself
and the ``window − 1`` previous live tokens.

Backends: ``"triton"`` runs the flash core with a window (``triton_ops/_flash.py``)
on uncached calls without a mask, where live rank and position coincide; masked or
cached calls use the PyTorch path on either backend.

Decoding: :class:`SlidingWindowCache` retains the last ``window`` *live* post-RoPE
keys and values (a fixed ``[B, window, H, u]`` frame, dead slots after them), so
cached decoding equals the full forward with padding and holes too; each step costs
O(window) whatever the length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._backend import Backend, check_backend, resolve_backend
from .._cache import DecodingCache, check_cache
from .._validation import check_has_tokens, check_positive_int
from ..mosrah import rope_rotate

__all__ = ["SlidingWindowCache", "SlidingWindowAttention", "sliding_window_reference"]


def sliding_window_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_live: torch.Tensor,
                             query_live: torch.Tensor, window: int) -> torch.Tensor:
    """``q [B, S, H, u]`` are the last S entries of the frame ``k, v [B, M, H, u]``
    (liveness ``key_live [B, M]``; ``query_live [B, S]`` is its tail). Returns
    ``[B, S, H, u]``; queries that see no key give 0."""
    S, M = q.shape[1], k.shape[1]
    rank = torch.cumsum(key_live.long(), 1) - 1                              # [B, M]
    diff = rank[:, M - S:, None] - rank[:, None, :]                          # [B, S, M]
    allowed = query_live[:, :, None] & key_live[:, None, :] & (diff >= 0) & (diff < window)
    seen = allowed.any(-1, keepdim=True)
    mask = (allowed | ~seen)[:, None]                                        # [B, 1, S, M]
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return torch.where(seen[:, None], y, torch.zeros_like(y)).transpose(1, 2)


@dataclass(eq=False)
class SlidingWindowCache(DecodingCache):
    """The retained frame: post-RoPE ``keys``/``values`` ``[B, window, H, u]`` and ``live
    [B, window]`` (live entries first, oldest first); ``tokens`` positions seen.
    Immutable: a step returns a new one. The frame is bounded by the window, so a step
    costs O(window + chunk) whatever the length of the past."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    live: torch.Tensor | None = None
    tokens: int = 0

    @property
    def length(self) -> int:
        return self.tokens

    @property
    def config(self) -> dict:
        if self.keys is None:
            return {}
        return {"window": self.keys.shape[1], "num_heads": self.keys.shape[2], "head_dim": self.keys.shape[3]}

    def reset(self) -> None:
        self.keys = self.values = self.live = None
        self.tokens = 0


class SlidingWindowAttention(nn.Module):
    """Local sliding-window MHA (``q_proj``/``k_proj``/``v_proj`` ``[H·u, d]``, ``o_proj``
    ``[d, H·u]``, no bias, init N(0, 0.02²)).

    ``forward(x [B, N, d], position_ids [B, N], live [B, N] bool, cache=None,
    all_live=False) -> (out [B, N, d], cache)``; ``all_live`` (no mask was given) lets
    the Triton backend run the windowed flash kernel."""

    def __init__(self, embedding_width: int, num_heads: int, head_dim: int, window_size: int,
                 rope_theta: float = 10000.0, backend: Backend = "auto") -> None:
        super().__init__()
        check_backend(backend)
        self.backend = backend
        for name, value in (("embedding_width", embedding_width), ("num_heads", num_heads),
                            ("head_dim", head_dim), ("window_size", window_size)):
            check_positive_int(name, value)
        self.num_heads, self.head_dim, self.window = num_heads, head_dim, window_size
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(embedding_width, inner, bias=False)
        self.k_proj = nn.Linear(embedding_width, inner, bias=False)
        self.v_proj = nn.Linear(embedding_width, inner, bias=False)
        self.o_proj = nn.Linear(inner, embedding_width, bias=False)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(lin.weight, std=0.02)
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.register_buffer("inv_freq", 1.0 / (rope_theta ** exponent), persistent=False)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, window={self.window}"

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, live: torch.Tensor,
                cache: SlidingWindowCache | None = None,
                all_live: bool = False) -> tuple[torch.Tensor, SlidingWindowCache | None]:
        check_has_tokens("x", x)
        B, N, _ = x.shape
        shape = (B, N, self.num_heads, self.head_dim)
        pos = position_ids[..., None].expand(shape[:-1])
        q = rope_rotate(self.q_proj(x).view(shape), pos, self.inv_freq)
        k = rope_rotate(self.k_proj(x).view(shape), pos, self.inv_freq)
        v = self.v_proj(x).view(shape)
        key, value, key_live = k, v, live
        if cache is not None:
            check_cache(cache, SlidingWindowCache, {"window": self.window, "num_heads": self.num_heads,
                                                    "head_dim": self.head_dim}, batch=B, device=x.device,
                        cache_batch=None if cache.keys is None else cache.keys.shape[0],
                        cache_device=None if cache.keys is None else cache.keys.device)
            tokens = cache.tokens + N
            if cache.keys is None:
                W = self.window
                cache = SlidingWindowCache(k.new_zeros(B, W, *shape[2:]), v.new_zeros(B, W, *shape[2:]),
                                           torch.zeros(B, W, dtype=torch.bool, device=x.device))
            # frame = retained ‖ chunk: O(window + N) per call
            key = torch.cat([cache.keys.to(k.dtype), k], 1)
            value = torch.cat([cache.values.to(v.dtype), v], 1)
            key_live = torch.cat([cache.live, live], 1)
            cache = self._retain(key.detach(), value.detach(), key_live)
            cache.tokens = tokens
        if cache is None and all_live and resolve_backend(self.backend, x, self.q_proj.weight) == "triton":
            from laminae.triton_ops._flash import flash_attention

            y = flash_attention(q, k, v, None, window=self.window)
        else:
            y = sliding_window_reference(q, key, value, key_live, live, self.window)
        return self.o_proj(y.reshape(B, N, -1)), cache

    def _retain(self, key, value, live) -> SlidingWindowCache:
        """The last ``window`` live entries of the frame, in order, then dead slots."""
        M = live.shape[1]
        after = torch.flip(torch.cumsum(torch.flip(live.long(), [1]), 1), [1])   # live entries at or after j
        keep = live & (after <= self.window)
        idx = torch.arange(M, device=live.device).expand_as(live)
        order = torch.argsort(torch.where(keep, idx, idx + M), dim=1)[:, :self.window]
        gather = order[..., None, None].expand(-1, -1, *key.shape[2:])
        return SlidingWindowCache(key.gather(1, gather), value.gather(1, gather), keep.gather(1, order))
