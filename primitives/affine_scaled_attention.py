"""Affine-scaled attention (Bae et al., arXiv:2602.23057): softmax attention whose
weights are rescaled per head and per query by α ∈ [0, 1] and shifted so that each
row sums to a running mean α_ma of α.

For query t and a key j visible to it (``N_t`` = number of visible keys)::

    α_t    = φ(x_t·W_αᵀ)                        [B, S, H], φ = linear clipping
    A_tj   = α_t·P_tj + (α_ma − α_t)/N_t         P = softmax(q·kᵀ/√d + mask)
    O_t    = Σ_j A_tj·v_j
           = α_t·(P·V)_t + (α_ma − α_t)·v̄_t     v̄_t = mean of the visible values

Each row of A sums to α_ma whatever α_t is; A_tj = 0 for invisible keys; a query
that sees no key returns 0. ``α_ma`` ``[H]`` is an exponential moving average of the
batch mean of α over valid query positions, updated once per training forward
(before use) and frozen in eval.

Layout (the toolkit's attention convention): ``q`` ``[B, S, H, D]``, ``k``/``v``
``[B, N, H_kv, D]`` with ``N ≥ S``; query i sits at absolute position ``N − S + i``;
key j is visible to query i iff ``j ≤ N − S + i`` and ``attention_mask[b, j]``; query head
h reads kv head ``h // (H // H_kv)``.
"""
from __future__ import annotations

import math
import torch
from torch import nn

from ._attention import KVCacheCore, check_attention_inputs, masked_softmax, reference_operands, visible_keys
from ._backend import Backend, check_backend, resolve_backend
from ._cache import KVCache
from ._errors import ConfigError
from ._outputs import BlockOutput
from ._validation import (check_choice, check_param_dtype, check_positive_int, check_tensor, without_autocast,
                          zero_padding)

__all__ = [
    "ACTIVATIONS",
    "affine_alpha",
    "affine_scaled_attention_reference",
    "AffineScaledAttention",
    "AffineScaledAttentionCache",
]

ACTIVATIONS = ("linear_clip", "sigmoid")


def affine_alpha(x: torch.Tensor, weight: torch.Tensor, activation: str = "linear_clip") -> torch.Tensor:
    """α = φ(x·Wᵀ) in fp32 (fp64 for fp64 inputs): ``x`` ``[..., hidden]``, ``weight``
    ``[H, hidden]`` → ``[..., H]``.

    ``activation``: "linear_clip" (the paper's choice) φ(u) = clamp(0.1·u + 0.5, 0, 1),
    whose gradient is 0.1 on the closed interval [−5, 5] and 0 outside; or "sigmoid".
    """
    check_choice("activation", activation, ACTIVATIONS)
    compute = torch.promote_types(x.dtype, torch.float32)
    u = torch.nn.functional.linear(x.to(compute), weight.to(compute))
    if activation == "sigmoid":
        return torch.sigmoid(u)
    return torch.clamp(0.1 * u + 0.5, 0.0, 1.0)


def affine_scaled_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    alpha_ma: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    upcast: bool = True,
) -> torch.Tensor:
    """Reference affine-scaled attention, materialising A = α·P + (α_ma − α)/N_t.

    Args:
        alpha: ``[B, S, H]`` per-query, per-head scale α (already activated).
        alpha_ma: ``[H]`` the running mean of α (a buffer; no gradient is expected).
        q, k, v, attention_mask, upcast: the layout and compute dtype of every core's
            reference (:func:`~laminae.primitives._attention.reference_operands`).
    Returns:
        ``[B, S, H, D]`` in the dtype of ``q``. A query that sees no key returns 0.
    """
    B, S, H, D = q.shape
    N = k.shape[1]
    compute, qc, kc, vc = reference_operands(q, k, v, upcast)
    scores = torch.einsum("bshd,bnhd->bhsn", qc, kc) / math.sqrt(D)
    visible = visible_keys(S, N, attention_mask, q.device)            # [B|1, 1, S, N]
    probs = masked_softmax(scores, visible)
    n_visible = visible.sum(-1, keepdim=True).clamp_min(1).to(compute)  # N_t, never 0
    a = alpha.to(compute).permute(0, 2, 1)[..., None]                  # [B, H, S, 1]
    beta = (alpha_ma.to(compute).view(1, H, 1, 1) - a) / n_visible
    weights = torch.where(visible, a * probs + beta, torch.zeros((), dtype=compute, device=q.device))
    out = torch.einsum("bhsn,bnhd->bshd", weights, vc)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------
# Decoding cache
# ----------------------------------------------------------------------------


class AffineScaledAttentionCache(KVCache):
    """Keys, values and key keep mask of the tokens seen so far (see
    :class:`~laminae.primitives._cache.KVCache`). The running value mean v̄ is
    recomputed from the cached values at each step. Made by
    :meth:`AffineScaledAttention.empty_cache`; a call never changes the cache it was
    given.

    Example::

        cache = attn.empty_cache(batch)
        out, cache = attn(q, k, v, prompt_mask, cache, x=x_prompt)   # prefill
        out, cache = attn(q1, k1, v1, cache=cache, x=x_next)         # one token at a time
    """


# ----------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------


def _inside_backward() -> bool:
    """True while autograd is running a backward pass: where activation checkpointing
    (reentrant or not) recomputes a forward. The EMA must not update there."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class AffineScaledAttention(KVCacheCore, nn.Module):
    """Affine-scaled attention core: α-rescaled softmax weights plus the β shift.

    Owns ``alpha_proj`` (``nn.Linear(hidden_size, num_heads, bias=False)``, weight
    Normal(0, ``initializer_range``)) and the persistent fp32 buffer ``alpha_ma``
    ``[num_heads]`` (init ``alpha_ma_init``). Projections, norms and rotary embeddings
    stay with the caller.

    Args:
        hidden_size: width of ``x``, the normalised hidden state feeding q/k/v.
        num_heads, num_kv_heads, head_dim: H, H_kv (divides H), D.
        affine_momentum: ρ ∈ [0, 1] of the EMA ``α_ma ← ρ·α_ma + (1−ρ)·mean(α)``.
        alpha_ma_init: initial α_ma (paper: 0; 0.5 is a common alternative).
        activation: φ, "linear_clip" (paper) or "sigmoid".
        initializer_range: std of ``alpha_proj.weight`` (0 gives α ≡ 0.5 with linear_clip).
        backend: "auto" | "triton" | "reference".

    ``forward(q, k, v, attention_mask=None, cache=None, *, x) -> BlockOutput(output, cache)``:

    - ``q`` ``[B, S, H, D]``; ``x`` ``[B, S, hidden_size]`` (keyword), the normalised
      hidden state of the S queries, from which α is read.
    - without a cache (no decoding): ``k``/``v`` ``[B, N, H_kv, D]`` with ``N ≥ S``;
      ``attention_mask`` is the ``(B, N)`` key keep mask; ``cache`` is None.
    - with an :class:`AffineScaledAttentionCache` (from :meth:`empty_cache`, then from
      the previous call): ``k``/``v`` are the new tokens and ``attention_mask`` their
      ``(B, T)`` keep mask; they are appended to the cache, which is returned.

    In training mode the EMA is updated once per call, from α averaged over the batch
    and the valid query positions (the keep mask at the query positions), before the
    attention uses it. It is not updated again when activation checkpointing
    recomputes the forward during backward, nor in eval mode. With several
    checkpointed training forwards before one backward, each recompute reads the
    latest α_ma. Under ``torch.distributed`` the batch mean is averaged over ranks.

    Example::

        attn = AffineScaledAttention(512, num_heads=8, num_kv_heads=2, head_dim=64)
        out, _ = attn(q, k, v, attention_mask=keep, x=h)
    """

    cache_type = AffineScaledAttentionCache

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        affine_momentum: float = 0.9,
        alpha_ma_init: float = 0.0,
        activation: str = "linear_clip",
        initializer_range: float = 0.02,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_positive_int(name, value)
        check_backend(backend)
        check_choice("activation", activation, ACTIVATIONS)
        if num_heads % num_kv_heads:
            raise ConfigError(f"`num_kv_heads` must divide num_heads={num_heads}, got {num_kv_heads}")
        if (isinstance(affine_momentum, bool) or not isinstance(affine_momentum, (int, float))
                or not math.isfinite(affine_momentum) or not 0.0 <= affine_momentum <= 1.0):
            raise ConfigError(f"`affine_momentum` must be a finite number in [0, 1], got {affine_momentum!r}")
        for name, value in (("alpha_ma_init", alpha_ma_init), ("initializer_range", initializer_range)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"`{name}` must be a finite number, got {value!r}")
        if initializer_range < 0:
            raise ConfigError(f"`initializer_range` must be >= 0, got {initializer_range!r}")
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = (
            hidden_size, num_heads, num_kv_heads, head_dim)
        self.affine_momentum = float(affine_momentum)
        self.activation, self.backend = activation, backend
        self.alpha_proj = nn.Linear(hidden_size, num_heads, bias=False)
        nn.init.normal_(self.alpha_proj.weight, mean=0.0, std=float(initializer_range))
        self.register_buffer("alpha_ma", torch.full((num_heads,), float(alpha_ma_init), dtype=torch.float32))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, affine_momentum={self.affine_momentum}, "
                f"activation={self.activation!r}, backend={self.backend!r}")

    def _cache_config(self) -> dict:
        return {"num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}

    @torch.no_grad()
    def _update_ema(self, alpha: torch.Tensor, query_keep: torch.Tensor | None) -> None:
        """α_ma ← ρ·α_ma + (1−ρ)·m, m = mean of α over batch and valid query positions."""
        a = alpha.detach().float()
        if query_keep is None:
            total = a.sum(dim=(0, 1))
            count = torch.full((), a.shape[0] * a.shape[1], dtype=torch.float32, device=a.device)
        else:
            w = query_keep.to(device=a.device, dtype=torch.bool)
            # where, not a product: a padded query's α (even NaN) must not reach the mean
            total = torch.where(w[..., None], a, torch.zeros((), dtype=a.dtype, device=a.device)).sum(dim=(0, 1))
            count = w.sum().to(torch.float32)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            stats = torch.cat([total, count.reshape(1)])
            torch.distributed.all_reduce(stats)
            total, count = stats[:-1], stats[-1]
        rho = self.affine_momentum
        updated = rho * self.alpha_ma + (1.0 - rho) * total / count.clamp_min(1.0)
        # a batch with no valid query leaves the EMA unchanged
        self.alpha_ma.copy_(torch.where(count > 0, updated, self.alpha_ma))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: AffineScaledAttentionCache | None = None,
        *,
        x: torch.Tensor,
    ) -> BlockOutput:
        if cache is not None and not isinstance(cache, AffineScaledAttentionCache):
            raise TypeError(f"`cache` must be an AffineScaledAttentionCache or None, got {type(cache).__name__}")
        check_tensor("x", x, ndim=3, layout="[batch, seq, hidden_size]")
        q, k, v, mask = check_attention_inputs(
            q, k, v, attention_mask, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, past=0 if cache is None else cache.length, x=x, weight=self.alpha_proj.weight)
        check_tensor("x", x, shape=(q.shape[0], q.shape[1], self.hidden_size), layout="[batch, seq, hidden_size]")
        check_param_dtype("x", x, self.alpha_proj.weight)
        if cache is not None:
            cache.check("AffineScaledAttention", self._cache_config(), k)
        with without_autocast(q.device.type):
            return self._forward(x, q, k, v, mask, cache)

    def _forward(self, x, q, k, v, mask, cache):
        S = q.shape[1]
        k, v = zero_padding(mask, k, v)
        alpha = affine_alpha(x, self.alpha_proj.weight, self.activation)
        if self.training and (torch.compiler.is_compiling() or not _inside_backward()):
            query_keep = None if mask is None else mask[:, mask.shape[1] - S:]
            self._update_ema(alpha, query_keep)
        keys, values = k, v
        if cache is not None:
            cache = cache.append(k, v, mask)
            keys, values, mask = cache.keys, cache.values, cache.keep
        # a snapshot: a later training forward updates the buffer in place, and this
        # call's backward must see the value its forward used
        alpha_ma = self.alpha_ma.clone()
        if resolve_backend(self.backend, q, keys, values) == "triton":
            from laminae.triton_ops.affine_scaled_attention import affine_scaled_attention

            return BlockOutput(affine_scaled_attention(q, keys, values, alpha, alpha_ma, mask), cache)
        return BlockOutput(affine_scaled_attention_reference(q, keys, values, alpha, alpha_ma, mask), cache)
