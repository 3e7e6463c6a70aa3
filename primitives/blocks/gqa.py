"""Grouped-query attention block with a pluggable core and a growing KV cache.

    q = q_proj(x)            or  q_b(RMSNorm(q_a(x)))          (low-rank query, MLA)
    k, v = k_proj(x), v_proj(x)                                [B, S, H_kv, D]
    q, k = q_norm(q), k_norm(k)                                QK-norm (optional, per head)
    q, k = RoPE over the last ``rope_dim`` features            (all of them by default)
    v = depth-mixed v                                          (optional, see below)
    y = core(q, k_all, v_all)                                  SDPA / DERF / Elo / … (causal)
    y = XSA(y, v)                                              (optional)
    out = o_proj(y)          or  o_b(o_a(y))                   (low-rank output)

Cores: ``"sdpa"`` (``F.scaled_dot_product_attention``) or a module from this package:
:class:`~laminae.primitives.derf.DERFAttention`,
:class:`~laminae.primitives.elo_attention.EloAttention`,
:class:`~laminae.primitives.affine_scaled_attention.AffineScaledAttention`,
:class:`~laminae.primitives.lucid_attention.LucidAttention`. The decoding cache is
the library's one implementation (:mod:`laminae.primitives._cache`): a plain
:class:`~laminae.primitives._cache.KVCache` for SDPA, the core's own cache (a
``KVCache`` subclass, or LUCID's ``LucidCache``) otherwise.

Depth attention (Nanbeige): a layer mixes its fresh values with the (k, v) of earlier
layers by a softmax over depth of q·k, gated by ``tanh(depth_gate)`` (zero-init). The
mixed values are what the cache stores. Sources are passed in and the layer's own
entry is returned (:class:`AttentionOutput`), so nothing is stashed on the module.

Decoding: start from ``block.empty_cache(batch)``; ``forward(..., cache=cache) ->
AttentionOutput(output, cache, depth_entry)`` returns a *new* cache holding this call's
keys/values too; the one passed in still describes the old prefix, so two different
continuations of one cache (beam search) are both right. ``cache=None`` means no
decoding (the returned cache is None). Buffers grow by doubling; a continuation that
does not extend the longest branch of a buffer copies it first (``AppendBuffer``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .._attention import visible_keys
from .._backend import Backend, check_backend
from .._cache import DecodingCache, KVCache, cache_placement
from .._errors import ConfigError, ShapeError
from .._validation import (FLOAT_DTYPES, check_has_tokens, check_keep_mask, check_param_dtype, check_positive_int,
                           check_same_device, check_tensor, zero_padding)
from .norms import RMSNorm
from .rotary import RotaryEmbedding

__all__ = ["KVCache", "AttentionOutput", "GroupedQueryAttention", "sdpa_core", "depth_mix_values"]


# ----------------------------------------------------------------------------
# Cores
# ----------------------------------------------------------------------------


def sdpa_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0) -> torch.Tensor:
    """Causal softmax attention; q ``[B, S, H, D]`` are the last S of N keys ``[B, N, H_kv, D]``,
    ``attention_mask`` their ``(B, N)`` keep mask. Queries that see no key (padding) return 0."""
    S, N = q.shape[1], k.shape[1]
    qh = rearrange(q, "b s h d -> b h s d")
    kh, vh = (rearrange(t, "b n h d -> b h n d") for t in (k, v))
    if attention_mask is None and S == N:
        y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, dropout_p=dropout_p, enable_gqa=True)
        return rearrange(y, "b h s d -> b s h d")
    visible = visible_keys(S, N, attention_mask, q.device)               # [B|1, 1, S, N]
    seen = visible.any(-1, keepdim=True)
    y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible | ~seen, dropout_p=dropout_p,
                                       enable_gqa=True)
    y = torch.where(seen, y, torch.zeros_like(y))
    return rearrange(y, "b h s d -> b s h d")


def _core_kind(core: Any) -> str:
    from ..affine_scaled_attention import AffineScaledAttention
    from ..derf import DERFAttention
    from ..elo_attention import EloAttention
    from ..lucid_attention import LucidAttention

    for kind, cls in (("derf", DERFAttention), ("elo", EloAttention), ("affine", AffineScaledAttention),
                      ("lucid", LucidAttention)):
        if isinstance(core, cls):
            return kind
    raise ConfigError(f"`core` must be 'sdpa' or a DERF/Elo/affine-scaled/LUCID attention module, "
                      f"got {type(core).__name__}")


def depth_mix_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     sources: Sequence[tuple[torch.Tensor, torch.Tensor]], gate: torch.Tensor) -> torch.Tensor:
    """Depth attention: q ``[B, S, H, D]`` (mean-pooled to the KV groups), k, v
    ``[B, S, H_kv, D]`` and earlier layers' (k, v). Softmax over the depth axis of
    q·k/√D (fp32) mixes the values; returns ``v + tanh(gate)·(mixed − v)``."""
    if not sources:
        return v
    B, S, H, D = q.shape
    Hkv = k.shape[2]
    qg = q.view(B, S, Hkv, H // Hkv, D).mean(dim=3) if H != Hkv else q
    keys = torch.stack([kk for kk, _ in sources] + [k], dim=0)            # [L+1, B, S, Hkv, D]
    vals = torch.stack([vv for _, vv in sources] + [v], dim=0)
    logits = (qg.unsqueeze(0).float() * keys.float()).sum(-1)
    probs = torch.softmax(logits * D ** -0.5, dim=0).to(vals.dtype)
    mixed = (probs.unsqueeze(-1) * vals).sum(dim=0)
    return (v + torch.tanh(gate) * (mixed - v)).to(v.dtype)


class AttentionOutput(NamedTuple):
    output: torch.Tensor                                     # [B, S, hidden]
    cache: DecodingCache | None                              # holds this call's tokens too; None: no decoding
    depth_entry: tuple[torch.Tensor, torch.Tensor] | None    # this layer's (k, v) for later layers


# ----------------------------------------------------------------------------
# Block
# ----------------------------------------------------------------------------


class GroupedQueryAttention(nn.Module):
    """Causal grouped-query attention: projections, QK-norm, RoPE, a pluggable core, XSA.

    Args:
        hidden_size: model width.
        num_heads, num_kv_heads, head_dim: H, H_kv (divides H), D.
        core: ``"sdpa"`` or an attention-core module (DERF, Elo, affine-scaled, LUCID).
        rope: a :class:`RotaryEmbedding` (its ``dim`` = rotated width, the last
            features of each head) or None for no positions.
        q_lora_rank / o_lora_rank: low-rank query (``q_a_proj``, ``q_a_norm``,
            ``q_b_proj``) / output (``o_a_proj``, ``o_b_proj``) instead of ``q_proj``/``o_proj``.
        qk_norm: RMSNorm over head_dim shared by heads (``q_norm``, ``k_norm``) before RoPE.
        norm_eps, norm_upcast: of the q_a / QK norms (SpikeWhale: input-dtype norms).
        xsa: subtract each output's projection on its own normalised value (eps 1e-8).
        depth_gate: this layer mixes values over earlier layers (``depth_gate`` param).
        depth_source: this layer's (k, v) is offered to later layers.
        dropout: attention-probability dropout in training (SDPA core).
        bias: biases on q/k/v/o projections (Llama ``attention_bias``).
        initializer_range: N(0, σ²) init of the projections (None: nn.Linear default).
        backend: forwarded to XSA (cores carry their own ``backend``).

    ``forward(x [B, S, hidden], attention_mask=None, cache=None, *, position_ids [B|1, S],
    depth_sources=()) -> AttentionOutput(output, cache, depth_entry)``: ``attention_mask``
    is the ``(B, S)`` keep mask of this call's tokens; ``cache`` None (no decoding; the
    returned cache is None) or the cache from :meth:`empty_cache`, then from the previous
    call.

    Example::

        attn = GroupedQueryAttention(512, 8, 2, 64, rope=RotaryEmbedding(64))
        out = attn(x, position_ids=pos).output                                  # training
        cache = attn.empty_cache(batch)
        out, cache, _ = attn(x_prompt, cache=cache, position_ids=pos)           # prefill
        out, cache, _ = attn(x_next, cache=cache, position_ids=pos_next)        # one token
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 core: str | nn.Module = "sdpa", rope: RotaryEmbedding | None = None,
                 q_lora_rank: int | None = None, o_lora_rank: int | None = None, qk_norm: bool = False,
                 norm_eps: float = 1e-6, norm_upcast: bool = True, xsa: bool = False,
                 depth_gate: bool = False, depth_source: bool = False, dropout: float = 0.0,
                 bias: bool = False, initializer_range: float | None = None, backend: Backend = "auto") -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_positive_int(name, value)
        check_backend(backend)
        if num_heads % num_kv_heads:
            raise ConfigError(f"`num_kv_heads` ({num_kv_heads}) must divide `num_heads` ({num_heads})")
        if rope is not None and rope.dim > head_dim:
            raise ConfigError(f"rotary width {rope.dim} exceeds head_dim {head_dim}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"`dropout` must be in [0, 1), got {dropout!r}")
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = hidden_size, num_heads, num_kv_heads, head_dim
        self.core_kind = "sdpa" if isinstance(core, str) and core == "sdpa" else _core_kind(core)
        self.dropout, self.backend, self.use_xsa = float(dropout), backend, bool(xsa)
        self.depth_source = bool(depth_source)
        inner = num_heads * head_dim
        if q_lora_rank:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(q_lora_rank, norm_eps, upcast=norm_upcast)
            self.q_b_proj = nn.Linear(q_lora_rank, inner, bias=False)
        else:
            self.q_proj = nn.Linear(hidden_size, inner, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        if o_lora_rank:
            self.o_a_proj = nn.Linear(inner, o_lora_rank, bias=False)
            self.o_b_proj = nn.Linear(o_lora_rank, hidden_size, bias=False)
        else:
            self.o_proj = nn.Linear(inner, hidden_size, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, norm_eps, upcast=norm_upcast)
            self.k_norm = RMSNorm(head_dim, norm_eps, upcast=norm_upcast)
        self.rope = rope
        if not isinstance(core, str):
            self.core = core
        self.xsa = None
        if xsa:
            from ..xsa import ExclusiveSelfAttention

            self.xsa = ExclusiveSelfAttention(num_heads, num_kv_heads, head_dim, backend=backend)
        self.depth_gate = nn.Parameter(torch.zeros(1)) if depth_gate else None
        if initializer_range is not None:
            for lin in self.children():
                if isinstance(lin, nn.Linear):
                    nn.init.normal_(lin.weight, std=initializer_range)

    @property
    def cache_config(self) -> dict:
        """What a plain-SDPA cache records of this block (a core checks its own cache)."""
        return {"num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "core": self.core_kind}

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, core={self.core_kind!r}, xsa={self.use_xsa}")

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> DecodingCache:
        """An empty decoding cache for ``batch`` sequences: a :class:`KVCache` for SDPA,
        the core's own cache otherwise. ``dtype`` defaults to the dtype the projections
        give the keys: the parameters', or autocast's when made under ``torch.autocast``
        (make it where the decoding calls run); ``device`` to the parameters'."""
        dtype, device = cache_placement(self, dtype, device)
        if self.core_kind != "sdpa":
            return self.core.empty_cache(batch, dtype=dtype, device=device)
        return KVCache._empty(batch, self.cache_config, dtype=dtype, device=device)

    def _project(self, x: torch.Tensor, position_ids: torch.Tensor):
        B, S, _ = x.shape
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q = q.view(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            start = self.head_dim - self.rope.dim
            q, k = self.rope(q, position_ids, start), self.rope(k, position_ids, start)
        # under autocast the projections come out in the autocast dtype but the norms
        # promote to their fp32 gains: the core gets one dtype, the projections'
        return q.to(v.dtype), k.to(v.dtype), v

    def _check(self, x, attention_mask, position_ids, cache) -> torch.Tensor | None:
        check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES, layout="(batch, seq, hidden)")
        B, S, H = x.shape
        if H != self.hidden_size:
            raise ShapeError(f"`x` must be (batch, seq, {self.hidden_size}), got {tuple(x.shape)}")
        check_has_tokens("x", x)
        check_tensor("position_ids", position_ids, dtypes=None, shape=(None, S), layout="(batch or 1, seq)")
        weight = self.k_proj.weight
        check_same_device(x=x, parameters=weight)
        check_param_dtype("x", x, weight)
        if cache is not None and self.core_kind == "sdpa" and type(cache) is not KVCache:
            raise TypeError(f"`cache` must be a KVCache (from an SDPA attention block) or None, "
                            f"got {type(cache).__name__}")
        return check_keep_mask("attention_mask", attention_mask, B, S)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: DecodingCache | None = None, *, position_ids: torch.Tensor,
                depth_sources: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> AttentionOutput:
        keep = self._check(x, attention_mask, position_ids, cache)
        B, S, _ = x.shape
        q, k, v = self._project(x, position_ids)
        if self.depth_gate is not None:
            v = depth_mix_values(q, k, v, depth_sources, self.depth_gate)
        depth_entry = (k, v) if self.depth_source else None
        # padded positions never reach kept ones, even as 0·NaN inside a matmul
        k, v = zero_padding(keep, k, v)
        y, new_cache = self._attend(x, q, k, v, keep, cache)
        if self.xsa is not None:
            y = self.xsa(y, v=v)
        y = y.reshape(B, S, self.num_heads * self.head_dim)
        out = self.o_b_proj(self.o_a_proj(y)) if hasattr(self, "o_a_proj") else self.o_proj(y)
        return AttentionOutput(out, new_cache, depth_entry)

    def _attend(self, x, q, k, v, keep, cache):
        kind = self.core_kind
        if kind == "affine":
            return self.core(q, k, v, keep, cache, x=x)
        if kind != "sdpa":
            return self.core(q, k, v, keep, cache)
        keys, values, attend_mask, new_cache = k, v, keep, None
        if cache is not None:
            cache.check("GroupedQueryAttention", self.cache_config, k)
            new_cache = cache.append(k, v, keep)
            if cache.length:
                # with gradients on, the fresh keys keep their graph; the cache holds detached copies
                keys = torch.cat([cache.keys, k], dim=1) if torch.is_grad_enabled() else new_cache.keys
                values = torch.cat([cache.values, v], dim=1) if torch.is_grad_enabled() else new_cache.values
                attend_mask = new_cache.keep
        y = sdpa_core(q, keys, values, attend_mask, self.dropout if self.training else 0.0)
        return y, new_cache
