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
:class:`LucidCache` (from ``module.empty_cache(batch)``); a new token's row of L is computed against the cached k̂ and its
v′ divided by its own computed diagonal, so prefill followed by one-token steps
equals the full forward.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ._attention import check_attention_inputs, visible_keys
from ._backend import Backend, check_backend, resolve_backend
from ._cache import KVCache, cache_placement
from ._errors import ConfigError, DTypeError
from ._outputs import BlockOutput
from ._validation import check_positive_int, dense_keep_mask, without_autocast, zero_padding

__all__ = [
    "LUCID_ATTENTION_EPS",
    "lucid_key_norm",
    "lucid_matrix",
    "lucid_precondition_reference",
    "lucid_attention_reference",
    "lucid_extend",
    "check_lucid_inputs",
    "LucidCache",
    "LucidAttention",
]

LUCID_ATTENTION_EPS = 1e-6  # the seed's ``lucid_attention_eps``


# ----------------------------------------------------------------------------
# Reference math
# ----------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def lucid_key_norm(k: torch.Tensor, eps: float = LUCID_ATTENTION_EPS,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """k̂ = k·(mean(k²) + eps)^(-1/2) in fp32 (fp64 for fp64 input); rows whose keep
    mask is 0 are set to 0 (they never enter L, see the padding rule)."""
    kc = k.to(_compute_dtype(k.dtype))
    k_hat = kc * torch.rsqrt(kc.square().mean(-1, keepdim=True) + eps)
    if attention_mask is not None:
        k_hat = torch.where(attention_mask.to(k.device).bool()[:, :, None, None], k_hat, torch.zeros_like(k_hat))
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


def lucid_matrix(k: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 eps: float = LUCID_ATTENTION_EPS, *, unit_diagonal: bool = False) -> torch.Tensor:
    """The dense preconditioner L ``[B, H_kv, N, N]`` (fp32/fp64) for keys ``[B, N, H_kv, D]``."""
    batch, length = k.shape[:2]
    keep = dense_keep_mask(attention_mask, batch, length, k.device)
    k_hat = lucid_key_norm(k, eps, attention_mask)
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


def lucid_precondition_reference(k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                 eps: float = LUCID_ATTENTION_EPS, *, unit_diagonal: bool = False) -> torch.Tensor:
    """V′ = L⁻¹V ``[B, N, H_kv, D]`` in fp32 (fp64 for fp64 input) by a triangular solve.

    ``unit_diagonal=True`` replaces the computed diagonal exp(s·‖k̂_i‖² − √d) by
    exactly 1 (the spec's open point 1 alternative; the default keeps the computed one)."""
    batch, length, heads, dim = k.shape
    compute = _compute_dtype(k.dtype)
    keep = dense_keep_mask(attention_mask, batch, length, k.device)
    k_hat = lucid_key_norm(k, eps, attention_mask)
    empty = k_hat.new_zeros(batch, 0, heads, dim)
    return lucid_extend(empty, empty, keep[:, :0], k_hat, v.to(compute), keep, unit_diagonal)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, values: torch.Tensor,
                      attention_mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q·kᵀ/√D + causal/key mask)·values with query i at position N − S + i;
    a query that sees no key returns 0."""
    batch, s_len, heads, dim = q.shape
    n_len, group = k.shape[1], heads // k.shape[2]
    kc = k.repeat_interleave(group, dim=2)
    vc = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bshd,bnhd->bhsn", q, kc) / math.sqrt(dim)
    visible = visible_keys(s_len, n_len, attention_mask, q.device)
    any_visible = visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~any_visible, 0.0)
    p = torch.softmax(scores, dim=-1).masked_fill(~visible, 0.0)
    return torch.einsum("bhsn,bnhd->bshd", p, vc)


def lucid_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
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
        attention_mask: optional ``(B, N)`` keep mask (1 = real key, 0 = padding).
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
    v_prime = lucid_precondition_reference(k, v, attention_mask, eps, unit_diagonal=unit_diagonal)
    compute = _compute_dtype(dtype) if upcast else dtype
    out = _causal_attention(q.to(compute), k.to(compute), v_prime.to(compute), attention_mask)
    return out.to(dtype)


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------


def check_lucid_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ConfigError(f"`lucid_attention_eps` must be a finite number >= 0, got {eps!r}")
    return float(eps)


def check_lucid_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None,
                       eps: float) -> None:
    """Shapes ``q [B, S, H, D]``, ``k``/``v`` ``[B, N, H_kv, D]`` with N ≥ S and H_kv | H,
    one dtype and device, a ``(B, N)`` keep mask, eps ≥ 0 (a functional LUCID call)."""
    check_attention_inputs(q, k, v, attention_mask, module=False)
    check_lucid_eps(eps)


# ----------------------------------------------------------------------------
# Decoding cache
# ----------------------------------------------------------------------------


class LucidCache(KVCache):
    """What LUCID decoding needs from earlier tokens, per layer (a
    :class:`~laminae.primitives._cache.KVCache`):

    keys      ``[B, C, H_kv, D]`` raw keys (input dtype), attended by later queries;
    values    ``[B, C, H_kv, D]`` the preconditioned values V′ (fp32/fp64), **not** v;
    key_hat   ``[B, C, H_kv, D]`` the keys RMS-normalised (fp32/fp64), for new rows of L;
    keep      ``[B, C]`` bool keep mask, or None when every key is kept.

    ``config`` records ``lucid_attention_eps`` and ``unit_diagonal`` with the heads.
    Made by :meth:`LucidAttention.empty_cache`; a call never changes the cache it was
    given. The class itself is the tag: a decode step accepts nothing else, because a
    cache of plain values mixed with LUCID would be silently wrong."""

    @property
    def key_hat(self) -> torch.Tensor | None:
        return self.buffers.get("key_hat")


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

    ``forward(q, k, v, attention_mask=None, cache=None) -> BlockOutput(output, cache)``:
    ``q`` ``[B, S, H, D]``, ``k``/``v`` ``[B, S, H_kv, D]`` for the S tokens of this
    call (the final keys: after RoPE and any other key transform); ``attention_mask``
    an optional ``(B, S)`` keep mask for these tokens (the cache remembers earlier
    ones). Returns ``output`` ``[B, S, H, D]`` and, given a :class:`LucidCache` (from
    :meth:`empty_cache`, then from the previous call), the cache extended by these
    tokens; without one (no decoding) the cache is None.

    Example::

        core = LucidAttention(num_heads=8, num_kv_heads=2, head_dim=64)
        out, _ = core(q, k, v)                                  # training
        out, cache = core(q, k, v, cache=core.empty_cache(batch))  # prefill
        out1, cache = core(q1, k1, v1, cache=cache)             # one decoding step
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

    def _cache_config(self) -> dict:
        return {"num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "lucid_attention_eps": self.lucid_attention_eps, "unit_diagonal": self.unit_diagonal}

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> LucidCache:
        """An empty decoding cache for ``batch`` sequences: keys in ``dtype`` (default
        float32, the core having no parameters, or autocast's dtype when made under
        ``torch.autocast``), V′ and the normalised keys in fp32 (fp64 for fp64), on
        ``device`` (default the CPU); its storage doubles when full."""
        dtype, device = cache_placement(self, dtype, device)
        tail, compute = (self.num_kv_heads, self.head_dim), _compute_dtype(dtype)
        return LucidCache._empty(batch, self._cache_config(), dtype=dtype, device=device,
                                 layout={"value": (tail, compute), "key_hat": (tail, compute)})

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: LucidCache | None = None,
                ) -> BlockOutput:
        if cache is not None and not isinstance(cache, LucidCache):
            raise TypeError(
                f"`cache` must be a LucidCache (it holds preconditioned values v′) or None, got "
                f"{type(cache).__name__}; a plain-attention cache holds v and cannot be continued with LUCID")
        q, k, v, mask = check_attention_inputs(
            q, k, v, attention_mask, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, new_keys_only=True)
        if cache is not None:
            cache.check("LucidAttention", self._cache_config(), k)
        with without_autocast(q.device.type):
            return self._forward(q, k, v, mask, cache)

    def _forward(self, q, k, v, mask, cache):
        eps, unit = self.lucid_attention_eps, self.unit_diagonal
        use_triton = resolve_backend(self.backend, q, k, v) == "triton"
        if use_triton and q.dtype == torch.float64:
            raise DTypeError("the Triton LUCID kernels support fp32/bf16/fp16; use backend='reference' for fp64")
        batch, s_len = q.shape[:2]
        k, v = zero_padding(mask, k, v)

        if cache is None or cache.length == 0:
            keys, attend_mask = k, mask
            if use_triton:
                from laminae.triton_ops.lucid_attention import lucid_precondition

                v_prime = lucid_precondition(k, v, attend_mask, eps, unit_diagonal=unit)
            else:
                v_prime = lucid_precondition_reference(k, v, attend_mask, eps, unit_diagonal=unit)
            v_prime_all = v_prime
            if cache is not None:
                cache = cache.append(k, v_prime, mask, extra={"key_hat": lucid_key_norm(k, eps, mask)})
        else:
            keep_new = dense_keep_mask(mask, batch, s_len, q.device)
            k_hat_new = lucid_key_norm(k, eps, mask)
            if use_triton:  # the new rows of L against the cache, by kernels (inference only)
                from laminae.triton_ops.lucid_attention import lucid_precondition_extend

                v_prime = lucid_precondition_extend(cache.keys, cache.values, k, v, cache.keep, mask, eps,
                                                    unit_diagonal=unit)
            else:
                v_prime = lucid_extend(cache.key_hat, cache.values, cache.buffers.get("keep"), k_hat_new, v,
                                       keep_new, unit)
            cache = cache.append(k, v_prime, mask, extra={"key_hat": k_hat_new})
            keys, v_prime_all, attend_mask = cache.keys, cache.values, cache.keep

        if use_triton:
            from laminae.triton_ops.lucid_attention import lucid_attend

            out = lucid_attend(q, keys, v_prime_all.to(q.dtype), attend_mask)
        else:
            compute = _compute_dtype(q.dtype)
            out = _causal_attention(q.to(compute), keys.to(compute), v_prime_all.to(compute), attend_mask).to(q.dtype)
        return BlockOutput(out, cache)
