"""LUCID: attention with preconditioned values (Duvvuri, Patel, Gupta & Dhillon, 2026).

Per (batch, kv head), over the N keys of the sequence (scale s = 1/√d):

    k̂_i  = k_i · (mean_c k_ic² + eps)^(-1/2)                RMS norm, no affine
    L_ij = exp(s·k̂_i·k̂_j − √d)        for j ≤ i, else 0     lower triangular, L_ii ≈ 1
    V′   = L⁻¹ V                                              forward substitution
    O    = softmax(q·kᵀ·s + causal mask) · V′                 on the raw keys k

Each query head reads the V′ of its kv head (GQA). Padding keys (keep mask 0) are
never mixed: their row and column of L are zero except a unit diagonal, so their
V′ is their own v and they contribute to no other row.

Layout is batch-first: ``q`` ``[B, S, H, D]``, ``k``/``v`` ``[B, N, H_kv, D]`` with
``N ≥ S``; query ``i`` sits at absolute position ``N − S + i`` (``S < N`` when
decoding after a cache).

Incremental decoding keeps the raw keys, the normalised keys and V′ (not v) in a
:class:`LucidCache`; a new token's row of L is computed against the cached k̂ and its
v′ divided by its own computed diagonal, so prefill followed by one-token steps
equals the full forward.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ._attention import visible_keys
from ._backend import Backend, check_backend, resolve_backend
from ._cache import AppendBuffer, DecodingCache, check_cache
from ._errors import ConfigError, DeviceError, DTypeError, ShapeError
from ._validation import (check_has_tokens, check_keep_mask, check_positive_int, check_same_device, check_same_dtype,
                          check_tensor, dense_keep_mask, match_activation_dtypes, without_autocast, zero_padding)

__all__ = [
    "LUCID_ATTENTION_EPS",
    "lucid_key_norm",
    "lucid_matrix",
    "lucid_precondition_reference",
    "lucid_attention_reference",
    "lucid_extend",
    "check_lucid_inputs",
    "LucidCache",
    "LucidCacheError",
    "LucidAttention",
]

LUCID_ATTENTION_EPS = 1e-6  # the seed's ``lucid_attention_eps``


class LucidCacheError(TypeError):
    """A decode step got a cache that does not hold LUCID's preconditioned values
    (for instance a plain-attention cache, which holds v instead of v′)."""


# ----------------------------------------------------------------------------
# Reference math
# ----------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def lucid_key_norm(k: torch.Tensor, eps: float = LUCID_ATTENTION_EPS,
                   key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """k̂ = k·(mean(k²) + eps)^(-1/2) in fp32 (fp64 for fp64 input); rows whose keep
    mask is 0 are set to 0 (they never enter L, see the padding rule)."""
    kc = k.to(_compute_dtype(k.dtype))
    k_hat = kc * torch.rsqrt(kc.square().mean(-1, keepdim=True) + eps)
    if key_mask is not None:
        k_hat = torch.where(key_mask.to(k.device).bool()[:, :, None, None], k_hat, torch.zeros_like(k_hat))
    return k_hat


def _lucid_rows(k_hat_rows: torch.Tensor, k_hat_cols: torch.Tensor, keep_rows: torch.Tensor,
                keep_cols: torch.Tensor, offset: int, unit_diagonal: bool = False) -> torch.Tensor:
    """Rows ``offset ..`` of L against columns ``0 ..``: ``[B, H_kv, R, C]``.

    Entry (i, j), absolute positions (offset + i, j), is exp(s·k̂_i·k̂_j − √d) when
    j ≤ offset + i and both keys are kept; a padding key has a unit diagonal (every key
    does with ``unit_diagonal``)."""
    d = k_hat_rows.shape[-1]
    scores = torch.einsum("brhd,bchd->bhrc", k_hat_rows, k_hat_cols) / math.sqrt(d) - math.sqrt(d)
    rows = torch.arange(k_hat_rows.shape[1], device=scores.device)[:, None] + offset
    cols = torch.arange(k_hat_cols.shape[1], device=scores.device)[None, :]
    allowed = (cols <= rows)[None, None] & keep_rows[:, None, :, None] & keep_cols[:, None, None, :]
    L = torch.exp(scores.masked_fill(~allowed, float("-inf")))
    diag = (cols == rows)[None, None]
    unit = diag if unit_diagonal else diag & ~keep_rows[:, None, :, None]
    return torch.where(unit, torch.ones_like(L), L)


def lucid_matrix(k: torch.Tensor, key_mask: torch.Tensor | None = None,
                 eps: float = LUCID_ATTENTION_EPS, *, unit_diagonal: bool = False) -> torch.Tensor:
    """The dense preconditioner L ``[B, H_kv, N, N]`` (fp32/fp64) for keys ``[B, N, H_kv, D]``."""
    batch, length = k.shape[:2]
    keep = dense_keep_mask(key_mask, batch, length, k.device)
    k_hat = lucid_key_norm(k, eps, key_mask)
    return _lucid_rows(k_hat, k_hat, keep, keep, 0, unit_diagonal)


def lucid_extend(k_hat_cache: torch.Tensor, v_prime_cache: torch.Tensor, keep_cache: torch.Tensor,
                 k_hat_new: torch.Tensor, v_new: torch.Tensor, keep_new: torch.Tensor,
                 unit_diagonal: bool = False) -> torch.Tensor:
    """V′ of T new keys given C cached ones: solve the new rows of L V′ = V.

    ``k_hat_*`` and ``v_prime_cache`` ``[B, C or T, H_kv, D]`` in the compute dtype,
    ``keep_*`` bool ``[B, C or T]``. Returns ``[B, T, H_kv, D]`` in the compute dtype:

        v′_new = L_nn⁻¹ (v_new − L_nc v′_cache)

    where L_nc are the new rows against the cache and L_nn the new diagonal block
    (with its computed diagonal, so decoding matches prefill). With C = 0 this is the
    whole prefill solve."""
    offset = k_hat_cache.shape[1]
    k_hat_all = torch.cat([k_hat_cache, k_hat_new], dim=1)
    keep_all = torch.cat([keep_cache, keep_new], dim=1)
    rows = _lucid_rows(k_hat_new, k_hat_all, keep_new, keep_all, offset, unit_diagonal)  # [B, Hkv, T, C + T]
    rhs = v_new.to(k_hat_new.dtype).transpose(1, 2)  # [B, Hkv, T, D]
    if offset:
        rhs = rhs - rows[..., :offset] @ v_prime_cache.transpose(1, 2)
    solved = torch.linalg.solve_triangular(rows[..., offset:], rhs, upper=False)
    return solved.transpose(1, 2)


def lucid_precondition_reference(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                                 eps: float = LUCID_ATTENTION_EPS, *, unit_diagonal: bool = False) -> torch.Tensor:
    """V′ = L⁻¹V ``[B, N, H_kv, D]`` in fp32 (fp64 for fp64 input) by a triangular solve.

    ``unit_diagonal=True`` replaces the computed diagonal exp(s·‖k̂_i‖² − √d) by
    exactly 1 (the spec's open point 1 alternative; the default keeps the computed one)."""
    batch, length, heads, dim = k.shape
    compute = _compute_dtype(k.dtype)
    keep = dense_keep_mask(key_mask, batch, length, k.device)
    k_hat = lucid_key_norm(k, eps, key_mask)
    empty = k_hat.new_zeros(batch, 0, heads, dim)
    return lucid_extend(empty, empty, keep[:, :0], k_hat, v.to(compute), keep, unit_diagonal)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, values: torch.Tensor,
                      key_mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q·kᵀ/√D + causal/key mask)·values with query i at position N − S + i;
    a query that sees no key returns 0."""
    batch, s_len, heads, dim = q.shape
    n_len, group = k.shape[1], heads // k.shape[2]
    kc = k.repeat_interleave(group, dim=2)
    vc = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bshd,bnhd->bhsn", q, kc) / math.sqrt(dim)
    visible = visible_keys(s_len, n_len, key_mask, q.device)
    any_visible = visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~any_visible, 0.0)
    p = torch.softmax(scores, dim=-1).masked_fill(~visible, 0.0)
    return torch.einsum("bhsn,bnhd->bshd", p, vc)


def lucid_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    eps: float = LUCID_ATTENTION_EPS,
    *,
    upcast: bool = True,
    unit_diagonal: bool = False,
) -> torch.Tensor:
    """Reference LUCID attention.

    Args:
        q: ``[B, S, H, D]`` queries (after RoPE).
        k, v: ``[B, N, H_kv, D]`` keys (the keys the softmax sees) and values, N ≥ S,
            H_kv divides H.
        key_mask: optional ``(B, N)`` keep mask (1 = real key, 0 = padding).
        eps: ``lucid_attention_eps`` of the key RMS norm.
        upcast: attention in fp32 and cast back (the ground truth); ``False`` runs the
            attention in the input dtype (the same-dtype baseline). The key norm, L and
            the solve are fp32 either way, as the method requires.
        unit_diagonal: use L_ii = 1 instead of the computed diagonal (spec open point 1;
            the recommendation, and default, is the computed diagonal).
    Returns:
        ``[B, S, H, D]`` in the dtype of ``q``.
    """
    dtype = q.dtype
    v_prime = lucid_precondition_reference(k, v, key_mask, eps, unit_diagonal=unit_diagonal)
    compute = _compute_dtype(dtype) if upcast else dtype
    out = _causal_attention(q.to(compute), k.to(compute), v_prime.to(compute), key_mask)
    return out.to(dtype)


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------


def check_lucid_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ConfigError(f"`lucid_attention_eps` must be a finite number >= 0, got {eps!r}")
    return float(eps)


def check_lucid_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                       eps: float) -> None:
    """Shapes ``q [B, S, H, D]``, ``k``/``v`` ``[B, N, H_kv, D]`` with N ≥ S and H_kv | H,
    one dtype and device, a ``(B, N)`` keep mask, eps ≥ 0."""
    check_tensor("q", q, ndim=4, layout="[batch, seq, heads, head_dim]")
    batch, s_len, heads, dim = q.shape
    check_tensor("k", k, ndim=4, layout="[batch, keys, kv_heads, head_dim]")
    n_len, kv_heads = k.shape[1], k.shape[2]
    check_tensor("k", k, shape=(batch, None, None, dim), layout="[batch, keys, kv_heads, head_dim]")
    check_tensor("v", v, shape=(batch, n_len, kv_heads, dim), layout="[batch, keys, kv_heads, head_dim]")
    if kv_heads == 0 or heads % kv_heads:
        raise ShapeError(f"kv heads of `k` ({kv_heads}) must divide the query heads of `q` ({heads})")
    if n_len < s_len:
        raise ShapeError(f"`k`/`v` must cover every query position (N >= S), got S={s_len}, N={n_len}")
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v, key_mask=key_mask)
    check_keep_mask("key_mask", key_mask, batch, n_len)
    check_lucid_eps(eps)


# ----------------------------------------------------------------------------
# Decoding cache
# ----------------------------------------------------------------------------


class LucidCache(DecodingCache):
    """What LUCID decoding needs from earlier tokens, per layer.

    keys      ``[B, C, H_kv, D]`` raw keys (input dtype), attended by later queries;
    key_hat   ``[B, C, H_kv, D]`` their RMS-normalised form (fp32/fp64), for new rows of L;
    v_prime   ``[B, C, H_kv, D]`` preconditioned values V′ (fp32/fp64), **not** v;
    keep      ``[B, C]`` bool keep mask, or None when every key is kept;
    eps       the ``lucid_attention_eps`` the cache was built with;
    unit_diagonal  whether L's diagonal was taken as exactly 1.

    Per-position tensors live in an :class:`~laminae.primitives._cache.AppendBuffer`
    (amortised O(1) appends, copy-on-branch); a call never changes the cache it was
    given. The class itself is the tag: a decode step accepts nothing else, because a
    cache of plain values mixed with LUCID would be silently wrong."""

    def __init__(self, buffers: AppendBuffer | None = None, has_mask: bool = False, eps: float = LUCID_ATTENTION_EPS,
                 unit_diagonal: bool = False, config: dict | None = None) -> None:
        self.buffers = buffers if buffers is not None else AppendBuffer()
        self.has_mask, self.eps, self.unit_diagonal = bool(has_mask), float(eps), bool(unit_diagonal)
        self.config = dict(config or {})

    @property
    def length(self) -> int:
        return self.buffers.length

    @property
    def seq_len(self) -> int:
        return self.buffers.length

    @property
    def keys(self) -> torch.Tensor | None:
        return self.buffers.get("keys")

    @property
    def key_hat(self) -> torch.Tensor | None:
        return self.buffers.get("key_hat")

    @property
    def v_prime(self) -> torch.Tensor | None:
        return self.buffers.get("v_prime")

    @property
    def keep(self) -> torch.Tensor | None:
        return self.buffers.get("keep") if self.has_mask else None

    def keep_mask(self) -> torch.Tensor:
        return self.buffers.get("keep")

    def reset(self) -> None:
        self.buffers, self.has_mask = AppendBuffer(self.buffers._storage, 0), False

    def clone(self) -> "LucidCache":
        return LucidCache(self.buffers.clone(), self.has_mask, self.eps, self.unit_diagonal, self.config)

    def extend(self, keys, key_hat, v_prime, keep, masked: bool) -> "LucidCache":
        return LucidCache(self.buffers.append(keys=keys, key_hat=key_hat, v_prime=v_prime, keep=keep),
                          self.has_mask or masked, self.eps, self.unit_diagonal, self.config)


# ----------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------


class LucidAttention(nn.Module):
    """LUCID preconditioned causal attention core (no parameters: the q/k/v/o
    projections belong to the surrounding attention block).

    Args:
        num_heads: query heads H.
        num_kv_heads: key/value heads H_kv (divides H; the preconditioner is per kv head).
        head_dim: D.
        lucid_attention_eps: eps of the key RMS norm inside the preconditioner (seed: 1e-6).
        backend: "auto" | "triton" | "reference".
        unit_diagonal: take L_ii = 1 instead of its computed value exp(s·‖k̂_i‖² − √d)
            (spec open point 1; default False, the recommendation, in prefill and decode).

    ``forward(q, k, v, attention_mask=None, cache=None) -> (out, cache)``:
    ``q`` ``[B, S, H, D]``, ``k``/``v`` ``[B, S, H_kv, D]`` for the S tokens of this
    call (the final keys: after RoPE and any other key transform); ``attention_mask``
    an optional ``(B, S)`` keep mask for these tokens (the cache remembers earlier
    ones). Returns ``out`` ``[B, S, H, D]`` and the :class:`LucidCache` extended by
    these tokens. Without a cache this is the full (prefill) forward.

    Example::

        core = LucidAttention(num_heads=8, num_kv_heads=2, head_dim=64)
        out, cache = core(q, k, v)                  # prefill
        out1, cache = core(q1, k1, v1, cache=cache)  # one decoding step
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 lucid_attention_eps: float = LUCID_ATTENTION_EPS, backend: Backend = "auto",
                 unit_diagonal: bool = False) -> None:
        super().__init__()
        check_positive_int("num_heads", num_heads)
        check_positive_int("num_kv_heads", num_kv_heads)
        check_positive_int("head_dim", head_dim)
        if num_heads % num_kv_heads:
            raise ConfigError(f"`num_kv_heads` ({num_kv_heads}) must divide `num_heads` ({num_heads})")
        check_lucid_eps(lucid_attention_eps)
        check_backend(backend)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.lucid_attention_eps = float(lucid_attention_eps)
        self.backend = backend
        if not isinstance(unit_diagonal, bool):
            raise ConfigError(f"`unit_diagonal` must be a bool, got {unit_diagonal!r}")
        self.unit_diagonal = unit_diagonal

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"lucid_attention_eps={self.lucid_attention_eps}, backend={self.backend!r}"
                + (", unit_diagonal=True" if self.unit_diagonal else ""))

    def _check(self, q, k, v, attention_mask, cache) -> None:
        check_tensor("q", q, ndim=4, layout="[batch, seq, heads, head_dim]")
        batch, s_len = q.shape[:2]
        check_tensor("q", q, shape=(batch, s_len, self.num_heads, self.head_dim),
                     layout="[batch, seq, num_heads, head_dim]")
        check_has_tokens("q", q)
        kv_shape = (batch, s_len, self.num_kv_heads, self.head_dim)
        check_tensor("k", k, shape=kv_shape, layout="[batch, seq, num_kv_heads, head_dim]")
        check_tensor("v", v, shape=kv_shape, layout="[batch, seq, num_kv_heads, head_dim]")
        check_same_dtype(q=q, k=k, v=v)
        check_same_device(q=q, k=k, v=v, attention_mask=attention_mask)
        check_keep_mask("attention_mask", attention_mask, batch, s_len)
        if cache is None:
            return
        if not isinstance(cache, LucidCache):
            raise LucidCacheError(
                f"`cache` must be a LucidCache (it holds preconditioned values v′), got {type(cache).__name__}; "
                "a plain-attention cache holds v and cannot be continued with LUCID")
        if cache.eps != self.lucid_attention_eps:
            raise ConfigError(f"`cache` was built with lucid_attention_eps={cache.eps}, "
                              f"this module uses {self.lucid_attention_eps}")
        if cache.unit_diagonal != self.unit_diagonal:
            raise ConfigError(f"`cache` was built with unit_diagonal={cache.unit_diagonal}, "
                              f"this module uses {self.unit_diagonal}")
        keys = cache.keys
        check_cache(cache, LucidCache, self._cache_config(), batch=batch, dtype=q.dtype, device=q.device,
                    cache_batch=None if keys is None else keys.shape[0],
                    cache_dtype=None if keys is None else keys.dtype,
                    cache_device=None if keys is None else keys.device)
        if keys is not None:
            want = (batch, cache.seq_len, self.num_kv_heads, self.head_dim)
            for name in ("keys", "key_hat", "v_prime"):
                check_tensor(f"cache.{name}", getattr(cache, name), shape=want,
                             dtypes=None, layout="[batch, cached, num_kv_heads, head_dim]")

    def _cache_config(self) -> dict:
        return {"num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: LucidCache | None = None,
                ) -> tuple[torch.Tensor, LucidCache]:
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t, ndim=4, layout="[batch, seq, heads, head_dim]")
        q, k, v = match_activation_dtypes(q=q, k=k, v=v)
        with without_autocast(q.device.type):
            return self._forward(q, k, v, attention_mask, cache)

    def _forward(self, q, k, v, attention_mask, cache):
        self._check(q, k, v, attention_mask, cache)
        eps, unit = self.lucid_attention_eps, self.unit_diagonal
        use_triton = resolve_backend(self.backend, q, k, v) == "triton"
        if use_triton and q.dtype == torch.float64:
            raise DTypeError("the Triton LUCID kernels support fp32/bf16/fp16; use backend='reference' for fp64")
        batch, s_len = q.shape[:2]
        k, v = zero_padding(attention_mask, k, v)
        keep_new = dense_keep_mask(attention_mask, batch, s_len, q.device)
        k_hat_new = lucid_key_norm(k, eps, attention_mask)
        masked = attention_mask is not None

        if cache is None or cache.seq_len == 0:
            keys, key_mask = k, attention_mask
            if use_triton:
                from laminae.triton_ops.lucid_attention import lucid_precondition

                v_prime = lucid_precondition(k, v, key_mask, eps, unit_diagonal=unit)
            else:
                v_prime = lucid_precondition_reference(k, v, key_mask, eps, unit_diagonal=unit)
            v_prime_all = v_prime
            new_cache = LucidCache(AppendBuffer.wrap(keys=k, key_hat=k_hat_new, v_prime=v_prime, keep=keep_new),
                                   masked, eps, unit, self._cache_config())
        else:
            v_prime = lucid_extend(cache.key_hat, cache.v_prime, cache.keep_mask(), k_hat_new, v, keep_new, unit)
            new_cache = cache.extend(k, k_hat_new, v_prime, keep_new, masked)
            keys, v_prime_all, key_mask = new_cache.keys, new_cache.v_prime, new_cache.keep

        if use_triton:
            from laminae.triton_ops.lucid_attention import lucid_attend

            out = lucid_attend(q, keys, v_prime_all.to(q.dtype), key_mask)
        else:
            compute = _compute_dtype(q.dtype)
            out = _causal_attention(q.to(compute), keys.to(compute), v_prime_all.to(compute), key_mask).to(q.dtype)
        return out, new_cache
