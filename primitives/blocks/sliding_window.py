"""Sliding-window causal multi-head attention over live tokens (SHRAM's local path h_l).

    q, k, v = x W_qᵀ, x W_kᵀ, x W_vᵀ             [B, N, H, u]
    q, k = RoPE(q, J), RoPE(k, J)                 plain θ_i = base^(−2i/u), fp32 angles
    ρ = (cumulative count of live tokens) − 1     over the frame the query sees
    key m visible to query n ⇔ live_n ∧ live_m ∧ 0 ≤ ρ(n) − ρ(m) < window
    out = o_proj(concat_h softmax(q·kᵀ/√u) v)     dead queries give 0

Visibility is by live rank, not by position (the public SHRAM implementation;
mosrah errata E3), so holes in the mask shrink nothing: every live query sees itself
and the ``window − 1`` previous live tokens. The positions ``J`` default to the live
rank too (continuing the cache's live count), so left padding gives the kept tokens
the positions they would have without it.

Backends: ``"triton"`` runs the flash core with a window (``triton_ops/_flash.py``)
on uncached calls without a mask, where live rank and position coincide, and the
split-K decoding kernel on cached one-token steps (the query sees exactly the
frame's last ``window`` live entries: a keep mask, no window test); other masked
or cached calls use the PyTorch path on either backend.

Decoding: :class:`SlidingWindowCache` retains at least the last ``window`` *live*
post-RoPE keys and values of every row in a ring of ``2·window`` slots, so cached
decoding equals the full forward with padding and holes too. A step writes its rows
after the retained ones and attends over a view of the ring; when the ring is full
the last ``window`` live rows move to the front of fresh storage (amortised O(1)
rows copied per step; the attention reads O(window) whatever the length).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._backend import Backend, check_backend, resolve_backend
from .._cache import DecodingCache, _Storage, check_cache
from .._errors import DTypeError, ShapeError
from .._outputs import BlockOutput
from .._validation import (FLOAT_DTYPES, check_has_tokens, check_keep_mask, check_param_dtype, check_positive_int,
                           check_same_device, check_tensor, dense_keep_mask, match_activation_dtypes,
                           without_autocast, zero_padding)
from .rotary import RotaryEmbedding

__all__ = ["SlidingWindowCache", "SlidingWindowAttention", "sliding_window_reference"]


def sliding_window_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             attention_mask: torch.Tensor | None = None, *, window: int) -> torch.Tensor:
    """``q [B, S, H, u]`` are the last S entries of the frame ``k, v [B, M, H, u]``;
    ``attention_mask [B, M]`` keeps the frame's live entries (the queries' own is its
    tail; None: all live). Returns ``[B, S, H, u]``; queries that see no key give 0."""
    S, M = q.shape[1], k.shape[1]
    key_live = dense_keep_mask(attention_mask, k.shape[0], M, k.device)
    query_live = key_live[:, M - S:]
    rank = torch.cumsum(key_live.long(), 1) - 1                              # [B, M]
    diff = rank[:, M - S:, None] - rank[:, None, :]                          # [B, S, M]
    allowed = query_live[:, :, None] & key_live[:, None, :] & (diff >= 0) & (diff < window)
    seen = allowed.any(-1, keepdim=True)
    mask = (allowed | ~seen)[:, None]                                        # [B, 1, S, M]
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return torch.where(seen[:, None], y, torch.zeros_like(y)).transpose(1, 2)


class SlidingWindowCache(DecodingCache):
    """The retained frame in a ring of ``2·window`` slots per row: ``keys``/``values``
    ``[B, n, H, u]`` post-RoPE and ``keep`` ``[B, n]`` are views of its first ``n``
    slots, which hold at least the last ``window`` live tokens of every row, oldest
    first (dead slots among them; ``window ≤ n ≤ 2·window`` once the window has
    filled); ``length`` positions seen, ``live_tokens`` ``[B]`` the live ones (default
    positions continue from it). Immutable: a step returns a new one.

    A step writes its tokens after the ``n`` slots, in place, when this cache holds
    the storage's newest write and they fit; otherwise (the ring is full, or another
    step from the same cache wrote first: a branch) it compacts: the last ``window``
    live entries of the frame go to the front of fresh storage. So a one-token step
    copies one row of keys and values, plus a compaction of ``window`` rows once in
    ``window + 1`` steps. Start from :meth:`SlidingWindowAttention.empty_cache`."""

    def __init__(self, storage: _Storage, end: int, version: int | None, live_tokens: torch.Tensor,
                 length: int, config: dict) -> None:
        self._storage, self._end, self._version = storage, end, version
        self.live_tokens, self._length, self.config = live_tokens, length, config

    @property
    def keys(self) -> torch.Tensor:
        return self._storage.tensors["key"][:, :self._end]

    @property
    def values(self) -> torch.Tensor:
        return self._storage.tensors["value"][:, :self._end]

    @property
    def keep(self) -> torch.Tensor:
        return self._storage.tensors["keep"][:, :self._end]

    @property
    def length(self) -> int:
        return self._length

    @property
    def batch(self) -> int:
        return self.keys.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def reset(self) -> None:
        """Forget every token (explicit, in place; caches sharing the storage keep theirs)."""
        self._storage, self._end, self._version = _ring(self.keys, 2 * self.config["window"]), 0, 0
        self.live_tokens, self._length = torch.zeros_like(self.live_tokens), 0

    def clone(self) -> "SlidingWindowCache":
        st = _ring(self.keys, self._storage.capacity)
        for name, t in self._storage.tensors.items():
            st.tensors[name][:, :self._end].copy_(t[:, :self._end])
        return SlidingWindowCache(st, self._end, 0, self.live_tokens.clone(), self._length, dict(self.config))

    def _appended(self, k: torch.Tensor, v: torch.Tensor, live: torch.Tensor) -> "SlidingWindowCache | None":
        """A cache holding these slots then the chunk ``k, v [B, N, H, u]`` written in
        place, or None when they do not fit or another step wrote here first."""
        st, N = self._storage, k.shape[1]
        if st.version != self._version or self._end + N > st.capacity:
            return None
        end = self._end + N
        for name, t in (("key", k), ("value", v), ("keep", live)):
            st.tensors[name][:, self._end:end].copy_(t)
        st.version += 1
        return SlidingWindowCache(st, end, st.version, self.live_tokens + live.sum(1), self._length + N, self.config)


def _ring(like: torch.Tensor, capacity: int) -> _Storage:
    """Storage of ``capacity`` slots shaped as ``like`` ``[B, ·, H, u]``, keys and values
    uninitialised: every reader (the decoding kernel included) takes only the frame's
    first ``end`` slots, each written before it is read."""
    B, tail = like.shape[0], like.shape[2:]
    rows = (B, capacity, *tail)
    return _Storage({"key": like.new_empty(rows), "value": like.new_empty(rows),
                     "keep": torch.zeros(B, capacity, dtype=torch.bool, device=like.device)})


class SlidingWindowAttention(nn.Module):
    """Local sliding-window MHA (``q_proj``/``k_proj``/``v_proj`` ``[H·u, d]``, ``o_proj``
    ``[d, H·u]``, no bias, init N(0, 0.02²)) with RoPE of base ``rope_theta``.

    ``forward(x [B, N, d], attention_mask=None, cache=None, *, position_ids=None) ->
    BlockOutput(output [B, N, d], cache)``: ``attention_mask`` ``(B, N)`` keep mask,
    ``position_ids`` ``[B, N]`` (default: live-token count − 1, continuing the cache).
    ``cache=None`` is an uncached call and returns ``cache=None``; decoding starts
    from :meth:`empty_cache`. Without a mask the Triton backend runs the windowed flash
    kernel, and on cached one-token steps the split-K decoding kernel. The projections run under autocast; the attention with autocast off.

    Example::

        local = SlidingWindowAttention(512, num_heads=16, head_dim=16, window_size=128)
        out = local(x, attention_mask=keep).output
        out, cache = local(x_prompt, cache=local.empty_cache(batch))
        out, cache = local(x_next, cache=cache)
    """

    def __init__(self, embedding_width: int, num_heads: int, head_dim: int, window_size: int,
                 rope_theta: float = 10000.0, backend: Backend = "auto") -> None:
        super().__init__()
        check_backend(backend)
        self.backend = backend
        for name, value in (("embedding_width", embedding_width), ("num_heads", num_heads),
                            ("head_dim", head_dim), ("window_size", window_size)):
            check_positive_int(name, value)
        self.embedding_width, self.num_heads, self.head_dim, self.window = embedding_width, num_heads, head_dim, \
            window_size
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(embedding_width, inner, bias=False)
        self.k_proj = nn.Linear(embedding_width, inner, bias=False)
        self.v_proj = nn.Linear(embedding_width, inner, bias=False)
        self.o_proj = nn.Linear(inner, embedding_width, bias=False)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(lin.weight, std=0.02)
        self.rotary = RotaryEmbedding(head_dim, rope_theta)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, window={self.window}"

    @property
    def _config(self) -> dict:
        return {"window": self.window, "num_heads": self.num_heads, "head_dim": self.head_dim}

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> SlidingWindowCache:
        """An empty frame of ``window`` slots for ``batch`` rows, in ``dtype`` and on
        ``device`` (defaults: the parameters')."""
        check_positive_int("batch", batch)
        weight = self.q_proj.weight
        dtype = weight.dtype if dtype is None else dtype
        if dtype not in FLOAT_DTYPES:
            raise DTypeError(f"`dtype` of a sliding-window cache must be a float dtype, got {dtype}")
        device = weight.device if device is None else torch.device(device)
        like = torch.empty((batch, 0, self.num_heads, self.head_dim), dtype=dtype, device=device)
        return SlidingWindowCache(_ring(like, 2 * self.window), 0, 0,
                                  torch.zeros(batch, dtype=torch.long, device=device), 0, self._config)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: SlidingWindowCache | None = None, *, position_ids: torch.Tensor | None = None) -> BlockOutput:
        check_tensor("x", x, ndim=3, layout="[batch, seq, embedding_width]")
        B, N, d = x.shape
        if d != self.embedding_width:
            raise ShapeError(f"`x` last dim must be embedding_width={self.embedding_width}, got {d}")
        check_has_tokens("x", x)
        check_same_device(x=x, parameters=self.q_proj.weight, attention_mask=attention_mask,
                          position_ids=position_ids)
        check_param_dtype("x", x, self.q_proj.weight)
        mask = check_keep_mask("attention_mask", attention_mask, B, N)
        if cache is not None:
            if not isinstance(cache, SlidingWindowCache):
                raise TypeError(f"`cache` must be a SlidingWindowCache (from SlidingWindowAttention.empty_cache) "
                                f"or None, got {type(cache).__name__}")
            check_cache(cache, SlidingWindowCache, self._config, batch=B, device=x.device, cache_batch=cache.batch,
                        cache_device=cache.device)
        live = dense_keep_mask(mask, B, N, x.device)
        if position_ids is None:
            past = 0 if cache is None else cache.live_tokens[:, None]
            position_ids = (torch.cumsum(live.long(), 1) + past - 1).clamp_min(0)
        else:
            check_tensor("position_ids", position_ids, shape=(B, N), dtypes=(torch.int64, torch.int32),
                         layout="[batch, seq] integer positions")
        # padding contents never reach live rows, even as 0·NaN inside a masked product
        (x,) = zero_padding(mask, x)
        shape = (B, N, self.num_heads, self.head_dim)
        q = self.rotary(self.q_proj(x).view(shape), position_ids)
        k = self.rotary(self.k_proj(x).view(shape), position_ids)
        v = self.v_proj(x).view(shape)
        with without_autocast(x.device.type):
            if cache is not None:
                q, k, v, _, _ = match_activation_dtypes(q=q, k=k, v=v, cached_keys=cache.keys,
                                                        cached_values=cache.values)
                grown = cache._appended(k.detach(), v.detach(), live)
                if grown is not None:
                    # the frame is a view of the ring: the step copied only its own rows
                    key, value, frame_keep = grown.keys.to(q.dtype), grown.values.to(q.dtype), grown.keep
                    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
                        # the ring holds detached rows: the chunk's own enter the frame with their graph
                        key = torch.cat([key[:, :-N], k], 1)
                        value = torch.cat([value[:, :-N], v], 1)
                    cache, seen = grown, self._window_of(frame_keep)
                else:
                    # compaction (full ring, or a branch): frame = retained ‖ chunk, O(window + N)
                    key = torch.cat([cache.keys.to(q.dtype), k], 1)
                    value = torch.cat([cache.values.to(q.dtype), v], 1)
                    frame_keep = torch.cat([cache.keep, live], 1)
                    cache, seen = self._retain(cache, key.detach(), value.detach(), frame_keep, live)
                if N == 1 and not (torch.is_grad_enabled() and q.requires_grad) \
                        and resolve_backend(self.backend, x, self.q_proj.weight) == "triton":
                    from laminae.triton_ops import _flash

                    # one step: a live query sees exactly the frame's last `window` live entries;
                    # the kernel reads the frame, a view of the ring, in place through its strides
                    y = _flash.flash_decode(q, key, value, _flash.mask_arg(seen))
                    y = torch.where(live[:, :, None, None], y, torch.zeros_like(y))
                else:
                    y = sliding_window_reference(q, key, value, frame_keep, window=self.window)
            elif mask is None and resolve_backend(self.backend, x, self.q_proj.weight) == "triton":
                from laminae.triton_ops._flash import flash_attention

                y = flash_attention(q, k, v, None, window=self.window)
            else:
                y = sliding_window_reference(q, k, v, live, window=self.window)
        return BlockOutput(self.o_proj(y.reshape(B, N, -1)), cache)

    def _window_of(self, keep: torch.Tensor) -> torch.Tensor:
        """Which entries of a frame ``keep [B, M]`` are among its last ``window`` live ones."""
        after = torch.flip(torch.cumsum(torch.flip(keep.long(), [1]), 1), [1])   # live entries at or after j
        return keep & (after <= self.window)

    def _retain(self, cache: SlidingWindowCache, key, value, keep, live) -> tuple[SlidingWindowCache, torch.Tensor]:
        """A cache whose fresh ring starts with the last ``window`` live entries of the
        frame, in order, then dead slots, in the cache's dtype; and which frame entries
        those are ``[B, M]``."""
        M = keep.shape[1]
        kept = self._window_of(keep)
        n = min(M, self.window)
        idx = torch.arange(M, device=keep.device).expand_as(keep)
        order = torch.argsort(torch.where(kept, idx, idx + M), dim=1)[:, :n]
        gather = order[..., None, None].expand(-1, -1, *key.shape[2:])
        st = _ring(cache.keys, 2 * self.window)
        st.tensors["key"][:, :n] = key.gather(1, gather)
        st.tensors["value"][:, :n] = value.gather(1, gather)
        st.tensors["keep"][:, :n] = kept.gather(1, order)
        return SlidingWindowCache(st, n, 0, cache.live_tokens + live.sum(1), cache.length + live.shape[1],
                                  cache.config), kept
