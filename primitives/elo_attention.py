"""Elo tournament attention (SpikeWhaleLM v2, ``use_elo``).

Softmax attention already gives each key a win probability against the field of
visible keys. Elo attention turns those probabilities into a *rating* per key that
accumulates over the queries in causal order and biases the logits of later
queries. Per head, with ``s_ij = q_i·k_j/√D`` under the causal and padding masks:

    K       = softplus(elo_log_k)                 per-head K-factor (> 0)
    g       = tanh(elo_gain)                      per-head rating → logit gain (0 at init)
    a⁰_ij   = softmax_j(s_ij)                     the "match": rating-independent
    n_i     = number of keys visible to query i
    dR_ij   = K·(a⁰_ij − 1/n_i)                   on visible (i, j), 0 elsewhere
    intra_ij = Σ_{t<i} dR_tj                      exclusive prefix sum over queries
    a_ij    = softmax_j(s_ij + g·(prior_j + intra_ij))
    out_i   = Σ_j a_ij·v_j
    rating_out_j = prior_j + Σ_i dR_ij            carried to the next call

``prior`` is the rating accumulated by earlier calls (the decoding cache) for the
keys already cached and 0 for keys new in this call, so a prefill followed by
one-token steps equals the full forward. ``elo_gain = 0`` gives plain softmax
attention exactly (the rating is still computed).

A query with no visible key (a padded position whose earlier keys are all padding)
returns 0 and contributes no rating. The seed, which fills masked logits with the
dtype's minimum instead of −∞, returns a near-uniform average of all values there;
its rating contribution is 0 as here.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._attention import (KVCacheCore, check_attention_inputs, check_functional_core_inputs, masked_softmax,
                         reference_operands, visible_keys)
from ._backend import Backend, check_backend, resolve_backend
from ._cache import KVCache
from ._errors import ConfigError, ShapeError
from ._outputs import BlockOutput
from ._validation import (check_positive_float, check_positive_int, check_tensor, without_autocast,
                          zero_padding)

__all__ = [
    "ELO_K_INIT",
    "EloAttention",
    "EloAttentionCache",
    "check_elo_attention_inputs",
    "elo_attention_reference",
    "elo_log_k_init",
]

# The seed reads ``cfg.elo_k_init`` from a config file that is not part of it, so
# its numeric default is unknown; 1.0 (K-factor one, ``elo_log_k = log(e − 1)``)
# is this toolkit's default. Pass ``elo_k_init`` to match a checkpoint's config.
ELO_K_INIT = 1.0


def elo_log_k_init(k_init: float) -> float:
    """The ``elo_log_k`` value whose softplus is ``k_init``: log(expm1(k_init))."""
    return math.log(math.expm1(k_init))


def check_elo_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    elo_log_k: torch.Tensor,
    elo_gain: torch.Tensor,
    prior_rating: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> None:
    """Shapes, dtypes and devices of a functional Elo attention call (raises ShapeError,
    DTypeError or DeviceError naming the argument)."""
    check_functional_core_inputs(q, k, v, attention_mask, dict(elo_log_k=elo_log_k, elo_gain=elo_gain),
                                 prior_rating=prior_rating)
    B, _, H, _ = q.shape
    N = k.shape[1]
    if prior_rating is not None:
        check_tensor("prior_rating", prior_rating, ndim=3, layout="[batch, num_heads, cached_keys]")
        if prior_rating.shape[0] != B or prior_rating.shape[1] != H or prior_rating.shape[2] > N:
            raise ShapeError(f"`prior_rating` must be [batch={B}, num_heads={H}, P] with P <= keys={N} "
                             f"(ratings of the first P keys), got {tuple(prior_rating.shape)}")


def rating_dtype(dtype: torch.dtype) -> torch.dtype:
    """Ratings are state carried across calls: float32, float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def full_prior(prior_rating: torch.Tensor | None, batch: int, heads: int, keys: int,
               dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[B, H, N]`` prior: the given ratings of the first P keys, zeros after."""
    if prior_rating is None:
        return torch.zeros(batch, heads, keys, dtype=dtype, device=device)
    prior = prior_rating.to(dtype)
    if prior.shape[2] < keys:
        prior = F.pad(prior, (0, keys - prior.shape[2]))
    return prior


def elo_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    elo_log_k: torch.Tensor,
    elo_gain: torch.Tensor,
    prior_rating: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference Elo tournament attention (materialises the [S, N] matrices).

    Args:
        elo_log_k, elo_gain: ``[H]`` raw parameters (K = softplus, gain = tanh).
        prior_rating: optional ``[B, H, P]``, ``P ≤ N``: ratings of the first P keys
            carried from earlier calls; later keys start at 0.
        q, k, v, attention_mask, upcast: the layout and compute dtype of every core's
            reference (:func:`~laminae.primitives._attention.reference_operands`).
    Returns:
        ``(out, rating_out)``: out ``[B, S, H, D]`` in q's dtype; rating_out
        ``[B, H, N]`` float32 (float64 for float64 inputs).
    """
    check_elo_attention_inputs(q, k, v, elo_log_k, elo_gain, prior_rating, attention_mask)
    B, S, H, D = q.shape
    N = k.shape[1]
    compute, qc, kc, vc = reference_operands(q, k, v, upcast)
    scores = torch.einsum("bshd,bnhd->bhsn", qc, kc) / math.sqrt(D)
    visible = visible_keys(S, N, attention_mask, q.device)
    K = F.softplus(elo_log_k.to(compute)).view(1, H, 1, 1)
    gain = torch.tanh(elo_gain.to(compute)).view(1, H, 1, 1)
    prior = full_prior(prior_rating, B, H, N, compute, q.device)

    a_base = masked_softmax(scores, visible)                         # the matches
    n_visible = visible.sum(-1, keepdim=True).clamp(min=1).to(compute)
    d_rating = K * (a_base - 1.0 / n_visible) * visible               # [B, H, S, N]
    intra = torch.cumsum(d_rating, dim=2) - d_rating                  # Σ_{t<i} dR_tj
    a = masked_softmax(scores + gain * (prior[:, :, None, :] + intra), visible)
    out = torch.einsum("bhsn,bnhd->bshd", a, vc)
    rating_out = prior + d_rating.sum(dim=2)
    return out.to(q.dtype), rating_out.to(rating_dtype(q.dtype))


# ----------------------------------------------------------------------------
# Decoding cache and module
# ----------------------------------------------------------------------------


class EloAttentionCache(KVCache):
    """State carried between calls: every key and value so far ``[B, N, H_kv, D]``,
    their keep mask ``(B, N)`` bool (None = all kept), see
    :class:`~laminae.primitives._cache.KVCache`, and the Elo rating of every key
    ``rating`` ``[B, H, N]`` (float32; the prior of the next call; None while empty).
    Made by :meth:`EloAttention.empty_cache`; a call never changes the cache it was
    given."""

    rating: torch.Tensor | None = None

    def reset(self) -> None:
        super().reset()
        self.rating = None


class EloAttention(KVCacheCore, nn.Module):
    """Elo tournament attention core: ``out, cache = module(q, k, v, attention_mask, cache)``.

    Args:
        num_heads: H, query heads (one K-factor, gain and rating per query head).
        num_kv_heads: H_kv, key/value heads; must divide ``num_heads`` (GQA).
        head_dim: D.
        elo_k_init: initial K-factor; ``elo_log_k`` starts at log(expm1(elo_k_init)).
        backend: "auto" | "triton" | "reference".

    Parameters (seed names): ``elo_log_k`` [H] and ``elo_gain`` [H] (zeros, so the
    module starts as plain causal softmax attention).

    Forward:
        q ``[B, S, H, D]``; k, v ``[B, S, H_kv, D]`` for this call's S tokens;
        attention_mask: optional ``(B, S)`` 0/1 keep mask of this call's tokens;
        cache: None (no decoding), or the :class:`EloAttentionCache` from
        :meth:`empty_cache` or from the previous call.
    Returns ``BlockOutput(output [B, S, H, D], cache)``; the new cache holds all keys so
    far and their ratings (None without a cache).

    Example::

        attn = EloAttention(num_heads=8, num_kv_heads=2, head_dim=64)
        out, _ = attn(q, k, v, attention_mask=keep)                   # training
        out, cache = attn(q, k, v, keep, attn.empty_cache(batch))     # prefill
        out1, cache = attn(q1, k1, v1, cache=cache)                   # one decoding step
    """

    cache_type = EloAttentionCache

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, elo_k_init: float = ELO_K_INIT,
                 backend: Backend = "auto") -> None:
        super().__init__()
        check_positive_int("num_heads", num_heads)
        check_positive_int("num_kv_heads", num_kv_heads)
        check_positive_int("head_dim", head_dim)
        check_positive_float("elo_k_init", elo_k_init)
        if num_heads % num_kv_heads:
            raise ConfigError(f"`num_kv_heads` ({num_kv_heads}) must divide `num_heads` ({num_heads})")
        if not math.isfinite(elo_log_k_init(elo_k_init)):
            raise ConfigError(f"`elo_k_init` must give a finite log(expm1(k)), got {elo_k_init!r}")
        check_backend(backend)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.elo_k_init = float(elo_k_init)
        self.backend = backend
        self.elo_log_k = nn.Parameter(torch.full((num_heads,), elo_log_k_init(elo_k_init)))
        self.elo_gain = nn.Parameter(torch.zeros(num_heads))

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"elo_k_init={self.elo_k_init}, backend={self.backend!r}")

    def _cache_config(self) -> dict:
        return {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: EloAttentionCache | None = None,
                ) -> BlockOutput:
        if cache is not None and not isinstance(cache, EloAttentionCache):
            raise TypeError(f"`cache` must be an EloAttentionCache or None, got {type(cache).__name__}")
        q, k, v, mask = check_attention_inputs(
            q, k, v, attention_mask, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, new_keys_only=True, elo_log_k=self.elo_log_k)
        # a padded query zeroed has a uniform match, so it adds no rating (and its
        # contents, even NaN, cannot reach later queries through the rating)
        q, k, v = zero_padding(mask, q, k, v)
        keys, values, prior = k, v, None
        if cache is not None:
            cache.check("EloAttention", self._cache_config(), k)
            prior = cache.rating
            cache = cache.append(k, v, mask)
            keys, values, mask = cache.keys, cache.values, cache.keep
        with without_autocast(q.device.type):
            if resolve_backend(self.backend, q, keys, values) == "triton":
                from laminae.triton_ops.elo_attention import launch_elo_attention

                out, rating = launch_elo_attention(q, keys, values, self.elo_log_k, self.elo_gain, prior, mask)
            else:
                out, rating = elo_attention_reference(q, keys, values, self.elo_log_k, self.elo_gain, prior, mask)
        if cache is not None:
            cache.rating = rating.detach()  # the new cache object, not the caller's
        return BlockOutput(out, cache)
