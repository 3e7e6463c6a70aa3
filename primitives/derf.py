"""DERF: attention with erf-shaped weights instead of a softmax, and the DERF context gate.

Attention, per head h, for query i and key j (``d`` = head_dim)::

    s_ij = q_i·k_j / sqrt(d)
    z_ij = α_h·s_ij + b_h
    w_ij = (γ_h·erf(z_ij) + γ_h) / 2          for visible (i, j), 0 otherwise
    o_i  = Σ_j w_ij·v_j / (Σ_j w_ij + 1e-8)

A key j is visible to query i when it is causal (j ≤ N − S + i: the S queries are
the last S of the N key positions) and kept by the ``(batch, N)`` padding mask. The
weights are bounded, ``w ∈ [min(0, γ), max(0, γ)]``, and are normalised by their
plain sum (the 1e-8 keeps a fully masked row at 0 instead of 0/0). Per-head
parameters ``derf_alpha`` (init 1), ``derf_bias`` (init 0), ``derf_gamma`` (init 1).
Because of that normalisation γ_h cancels except through the 1e-8: the output
hardly depends on ``derf_gamma`` and its gradient is of the order of 1e-8 (kept,
as in the seed, so that seed checkpoints load unchanged).

Context gate (per feature f)::

    logits = proj([retrieved, x])
    gate_f = γ_f·(erf(α_f·logits_f + b_f) + 1) / 2
    out    = retrieved·gate

Layout is batch-first: ``q`` is ``[B, S, H, D]``, ``k``/``v`` are ``[B, N, H_kv, D]``
with ``N ≥ S`` and ``H % H_kv == 0`` (grouped-query attention: query head ``h`` reads
kv head ``h // (H // H_kv)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ._attention import visible_keys
from ._backend import Backend, check_backend, resolve_backend
from ._cache import AppendBuffer, KVCache
from ._errors import ConfigError, DTypeError, ShapeError
from ._validation import (
    check_has_tokens,
    check_keep_mask,
    check_positive_int,
    check_same_device,
    check_same_dtype,
    check_tensor,
    match_activation_dtypes,
    without_autocast,
    zero_padding,
)

__all__ = [
    "DERF_EPS",
    "check_derf_attention_inputs",
    "derf_attention_reference",
    "derf_context_gate_reference",
    "DERFAttention",
    "DERFCache",
    "DERFContextGate",
]

# Added to the row sum of the weights before normalising, exactly as in the seed.
DERF_EPS = 1e-8


def _erf_plus_one_half(z: torch.Tensor) -> torch.Tensor:
    """(erf(z) + 1)/2, computed as erfc(−z)/2.

    The same function as the seed's ``(erf(z) + 1)/2``, without its cancellation:
    for z ≲ −3, erf(z) is within a few fp32 ulps of −1 (erf(−4) rounds to −1
    exactly), so erf(z) + 1 keeps at most a bit or two of its value. A DERF row
    whose weights all sit there would be normalised noise."""
    return torch.special.erfc(-z) / 2.0


def derf_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    derf_alpha: torch.Tensor,
    derf_bias: torch.Tensor,
    derf_gamma: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    *,
    upcast: bool = True,
) -> torch.Tensor:
    """Reference DERF attention (materialises the [B, H, S, N] weights; clarity first).

    Args:
        q: ``[B, S, H, D]`` queries; query i sits at absolute position ``N − S + i``.
        k, v: ``[B, N, H_kv, D]`` keys and values (``N ≥ S``, ``H % H_kv == 0``).
        derf_alpha, derf_bias, derf_gamma: ``[H]`` per-head erf slope, offset and scale.
        key_mask: optional ``(B, N)`` keep mask over keys (bool or 0/1).
        upcast: compute in fp32 and cast back (the ground truth); ``False`` keeps the
            input dtype (the same-dtype eager baseline, and fp64 for gradcheck).
    Returns:
        ``[B, S, H, D]`` in the dtype of ``q``. A query that sees no key returns 0.

    The seed writes the masked scores as -10000 before the erf and then zeroes the
    masked weights. The fill is dead code: masked weights are overwritten with a
    constant, so neither their value nor their gradient depends on the filled score.
    Here the masked weights are simply replaced by 0.

    ``(γ·erf(z) + γ)/2`` is evaluated as ``γ·erfc(−z)/2`` (see :func:`_erf_plus_one_half`).
    """
    dtype = q.dtype
    compute = torch.promote_types(dtype, torch.float32) if upcast else dtype
    B, S, H, D = q.shape
    N, kv_heads = k.shape[1], k.shape[2]
    group = H // kv_heads
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    if group > 1:
        kc = kc.repeat_interleave(group, dim=2)
        vc = vc.repeat_interleave(group, dim=2)
    scores = torch.einsum("bshd,bnhd->bhsn", qc, kc) / math.sqrt(D)
    alpha = derf_alpha.to(compute).view(1, H, 1, 1)
    bias = derf_bias.to(compute).view(1, H, 1, 1)
    gamma = derf_gamma.to(compute).view(1, H, 1, 1)
    weights = gamma * _erf_plus_one_half(alpha * scores + bias)
    visible = visible_keys(S, N, key_mask, q.device)
    weights = torch.where(visible, weights, torch.zeros((), dtype=compute, device=q.device))
    weights = weights / (weights.sum(dim=-1, keepdim=True) + DERF_EPS)
    out = torch.einsum("bhsn,bnhd->bshd", weights, vc)
    return out.to(dtype)


def derf_context_gate_reference(
    retrieved: torch.Tensor,
    logits: torch.Tensor,
    alpha: torch.Tensor,
    bias: torch.Tensor,
    gamma: torch.Tensor,
    *,
    upcast: bool = True,
) -> torch.Tensor:
    """Reference DERF context gate: ``retrieved · γ·(erf(α·logits + b) + 1)/2``.

    Args:
        retrieved: ``[..., F]`` the value being gated.
        logits: ``[..., F]`` gate pre-activations (``proj([retrieved, x])`` in the module).
        alpha, bias, gamma: ``[F]`` per-feature slope, offset and scale.
        upcast: compute in fp32 and cast back; ``False`` keeps the input dtype.
    Returns:
        ``[..., F]`` in the dtype of ``retrieved``.
    """
    dtype = retrieved.dtype
    compute = torch.promote_types(dtype, torch.float32) if upcast else dtype
    r, lg = retrieved.to(compute), logits.to(compute)
    gate = gamma.to(compute) * _erf_plus_one_half(alpha.to(compute) * lg + bias.to(compute))
    return (r * gate).to(dtype)


def check_derf_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    derf_alpha: torch.Tensor,
    derf_bias: torch.Tensor,
    derf_gamma: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    *,
    mask_name: str = "key_mask",
) -> None:
    """Shapes, dtypes and devices of a DERF attention call (raises ShapeError,
    DTypeError, DeviceError or ValueError naming the argument)."""
    check_tensor("q", q, ndim=4, layout="[batch, seq, num_heads, head_dim]")
    B, S, H, D = q.shape
    kv_layout = "[batch, keys, num_kv_heads, head_dim]"
    check_tensor("k", k, ndim=4, layout=kv_layout)
    check_tensor("v", v, ndim=4, layout=kv_layout)
    if k.shape[0] != B or k.shape[3] != D:
        raise ShapeError(f"`k` must be [batch={B}, keys, num_kv_heads, head_dim={D}] {kv_layout}, "
                         f"got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ShapeError(f"`v` must have the shape of `k` {tuple(k.shape)}, got {tuple(v.shape)}")
    N, kv_heads = k.shape[1], k.shape[2]
    if S == 0:
        raise ShapeError(f"`q` must hold at least one query position, got shape {tuple(q.shape)}")
    if kv_heads == 0 or H % kv_heads:
        raise ShapeError(f"num_kv_heads (dim 2 of `k`) must divide num_heads={H} (dim 2 of `q`), got {kv_heads}")
    if N < S:
        raise ShapeError(f"`k`/`v` must cover the {S} query positions and any earlier ones (N >= S), got N={N}")
    for name, p in (("derf_alpha", derf_alpha), ("derf_bias", derf_bias), ("derf_gamma", derf_gamma)):
        check_tensor(name, p, shape=(H,), layout="[num_heads]")
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v, derf_alpha=derf_alpha, derf_bias=derf_bias, derf_gamma=derf_gamma,
                      **{mask_name: key_mask})
    check_keep_mask(mask_name, key_mask, B, N)


# ----------------------------------------------------------------------------
# Decoding cache
# ----------------------------------------------------------------------------


class DERFCache(KVCache):
    """Keys, values and key keep mask of the tokens seen so far (see
    :class:`~laminae.primitives._cache.KVCache`): ``key``/``value`` ``[B, length, H_kv, D]``,
    ``keep`` ``[B, length]`` or None. Returned by :class:`DERFAttention`; a call never
    changes the cache it was given, so one cache can be continued several ways.

    Example::

        out, cache = attn(q_prompt, k_prompt, v_prompt, prompt_mask)   # prefill
        out, cache = attn(q_next, k_next, v_next, cache=cache)          # one token at a time
    """


# ----------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------


class DERFAttention(nn.Module):
    """DERF attention core: the per-head erf weighting that replaces softmax.

    Owns the seed's per-head parameters ``derf_alpha`` (ones), ``derf_bias`` (zeros)
    and ``derf_gamma`` (ones), each ``[num_heads]``; projections, norms and rotary
    embeddings stay with the caller.

    Args:
        num_heads: H, query heads.
        num_kv_heads: H_kv, key/value heads; must divide ``num_heads``.
        head_dim: D.
        backend: "auto" | "triton" | "reference".

    ``forward(q, k, v, attention_mask=None, cache=None) -> (out, cache)``:

    - without a cache: ``q`` ``[B, S, H, D]``, ``k``/``v`` ``[B, N, H_kv, D]`` with
      ``N ≥ S`` (the queries are the last S positions), ``attention_mask`` ``(B, N)``;
      returns ``(out, None)``.
    - with a :class:`DERFCache`: ``k``/``v`` are the S new tokens ``[B, S, H_kv, D]``
      and ``attention_mask`` is their ``(B, S)`` keep mask; they are appended to the
      cache, the queries attend to everything cached, and the cache is returned.

    ``out`` is ``[B, S, H, D]`` in the dtype of ``q``.

    Example::

        attn = DERFAttention(num_heads=8, num_kv_heads=2, head_dim=64)
        out, _ = attn(q, k, v, attention_mask=keep)           # training: q, k, v [B, T, ., 64]

        cache = attn.allocate_cache(batch, max_len, dtype=q.dtype)
        out, cache = attn(q_prompt, k_prompt, v_prompt, prompt_keep, cache=cache)
        out, cache = attn(q_next, k_next, v_next, cache=cache)  # one token: [B, 1, ., 64]

    The seed's dropout on the attention weights (training only) is not part of this
    core; the kernels have no dropout.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: Backend = "auto") -> None:
        super().__init__()
        check_positive_int("num_heads", num_heads)
        check_positive_int("num_kv_heads", num_kv_heads)
        check_positive_int("head_dim", head_dim)
        check_backend(backend)
        if num_heads % num_kv_heads:
            raise ConfigError(f"`num_kv_heads` must divide num_heads={num_heads}, got {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.backend = backend
        self.derf_alpha = nn.Parameter(torch.ones(num_heads))
        self.derf_bias = nn.Parameter(torch.zeros(num_heads))
        self.derf_gamma = nn.Parameter(torch.ones(num_heads))

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, backend={self.backend!r}")

    def _cache_config(self) -> dict:
        return {"num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}

    def allocate_cache(self, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                       device: torch.device | str | None = None) -> DERFCache:
        """An empty cache with room for ``max_len`` tokens (it grows past that by doubling)."""
        return DERFCache.allocate(batch, max_len, self.num_kv_heads, self.head_dim, dtype,
                                  device if device is not None else self.derf_alpha.device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: DERFCache | None = None,
    ) -> tuple[torch.Tensor, DERFCache]:
        params = (self.derf_alpha, self.derf_bias, self.derf_gamma)
        check_tensor("q", q, shape=(None, None, self.num_heads, self.head_dim),
                     layout="[batch, seq, num_heads, head_dim]")
        check_tensor("k", k, shape=(q.shape[0], None, self.num_kv_heads, self.head_dim),
                     layout="[batch, keys, num_kv_heads, head_dim]")
        check_tensor("v", v, shape=tuple(k.shape), layout="[batch, keys, num_kv_heads, head_dim]")
        check_has_tokens("q", q)
        q, k, v = match_activation_dtypes(q=q, k=k, v=v)
        if cache is not None:
            if not isinstance(cache, DERFCache):
                raise TypeError(f"`cache` must be a DERFCache or None, got {type(cache).__name__}")
            cache.check("DERFAttention", self._cache_config(), k)
        past = 0 if cache is None else cache.length
        if past + k.shape[1] < q.shape[1]:
            raise ShapeError(f"the {q.shape[1]} queries must be the last of the keys (N >= S): got {k.shape[1]} new "
                             f"key positions and {past} cached")
        check_same_device(q=q, k=k, v=v, attention_mask=attention_mask)
        check_keep_mask("attention_mask", attention_mask, k.shape[0], k.shape[1])
        k, v = zero_padding(attention_mask, k, v)
        if cache is None:
            check_derf_attention_inputs(q, k, v, *params, attention_mask, mask_name="attention_mask")
            keys, values, key_mask = k, v, attention_mask
            keep = torch.ones(k.shape[:2], dtype=torch.bool, device=k.device) if attention_mask is None \
                else attention_mask.bool()
            cache = DERFCache(AppendBuffer.wrap(key=k, value=v, keep=keep), attention_mask is not None,
                              self._cache_config())
        else:
            cache = cache.append(k, v, attention_mask)
            keys, values, key_mask = cache.keys, cache.values, cache.keep
            check_derf_attention_inputs(q, keys, values, *params, None)
        with without_autocast(q.device.type):
            if resolve_backend(self.backend, q, keys, values) == "triton":
                from laminae.triton_ops.derf import launch_derf_attention

                return launch_derf_attention(q, keys, values, *params, key_mask), cache
            return derf_attention_reference(q, keys, values, *params, key_mask), cache


class DERFContextGate(nn.Module):
    """DERF context gate: ``retrieved · γ·(erf(α·proj([retrieved, x]) + b) + 1)/2``.

    Parameters follow the seed: ``proj`` = ``nn.Linear(2·obs_size, obs_size)``
    (default init), ``alpha`` (ones), ``bias`` (``init_bias``; the default −4 starts
    the gate nearly closed, ≈ 1e-8·γ) and ``gamma`` (ones), each ``[obs_size]``.
    The projection runs in PyTorch on both backends; the kernel fuses the gate.

    Shapes: ``retrieved`` and ``x`` are ``[..., obs_size]`` with the same shape and
    dtype; the output has that shape and dtype.

    Example::

        gate = DERFContextGate(512)
        y = gate(memory_read, hidden)
    """

    def __init__(self, obs_size: int, init_bias: float = -4.0, backend: Backend = "auto") -> None:
        super().__init__()
        check_positive_int("obs_size", obs_size)
        check_backend(backend)
        if isinstance(init_bias, bool) or not isinstance(init_bias, (int, float)) or not math.isfinite(init_bias):
            raise ConfigError(f"`init_bias` must be a finite number, got {init_bias!r}")
        self.obs_size, self.backend = obs_size, backend
        self.proj = nn.Linear(obs_size * 2, obs_size)
        self.alpha = nn.Parameter(torch.ones(obs_size))
        self.bias = nn.Parameter(torch.full((obs_size,), float(init_bias)))
        self.gamma = nn.Parameter(torch.ones(obs_size))

    def extra_repr(self) -> str:
        return f"obs_size={self.obs_size}, backend={self.backend!r}"

    def forward(self, retrieved: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        check_tensor("retrieved", retrieved)
        check_tensor("x", x)
        if retrieved.dim() == 0 or retrieved.shape[-1] != self.obs_size:
            raise ShapeError(
                f"last dim of `retrieved` must be obs_size={self.obs_size}, got shape {tuple(retrieved.shape)}")
        check_has_tokens("retrieved", retrieved, None)
        if x.shape != retrieved.shape:
            raise ShapeError(
                f"`x` must have the shape of `retrieved` {tuple(retrieved.shape)}, got {tuple(x.shape)}")
        check_same_device(retrieved=retrieved, x=x, weight=self.proj.weight)
        retrieved, x = match_activation_dtypes(retrieved=retrieved, x=x)
        if not torch.is_autocast_enabled(retrieved.device.type) and retrieved.dtype != self.proj.weight.dtype:
            raise DTypeError(
                f"`retrieved`/`x` dtype must match the module parameters ({self.proj.weight.dtype}) "
                f"outside autocast, got {retrieved.dtype}")
        logits = self.proj(torch.cat([retrieved, x], dim=-1))
        with without_autocast(retrieved.device.type):
            if resolve_backend(self.backend, retrieved, logits) == "triton":
                from laminae.triton_ops.derf import derf_context_gate

                return derf_context_gate(retrieved, logits, self.alpha, self.bias, self.gamma)
            return derf_context_gate_reference(retrieved, logits, self.alpha, self.bias, self.gamma)
