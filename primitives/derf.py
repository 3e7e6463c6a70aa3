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

import torch
from torch import nn

from ._attention import (KVCacheCore, check_attention_inputs, check_functional_core_inputs, reference_operands,
                         visible_keys)
from ._backend import Backend, check_backend, resolve_backend
from ._cache import KVCache
from ._errors import ConfigError, ShapeError
from ._outputs import BlockOutput
from ._validation import (
    check_has_tokens,
    check_param_dtype,
    check_positive_int,
    check_same_device,
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
    attention_mask: torch.Tensor | None = None,
    *,
    upcast: bool = True,
) -> torch.Tensor:
    """Reference DERF attention (materialises the [B, H, S, N] weights; clarity first).

    Args:
        derf_alpha, derf_bias, derf_gamma: ``[H]`` per-head erf slope, offset and scale.
        q, k, v, attention_mask, upcast: the layout and compute dtype of every core's
            reference (:func:`~laminae.primitives._attention.reference_operands`).
    Returns:
        ``[B, S, H, D]`` in the dtype of ``q``. A query that sees no key returns 0.

    The seed writes the masked scores as -10000 before the erf and then zeroes the
    masked weights. The fill is dead code: masked weights are overwritten with a
    constant, so neither their value nor their gradient depends on the filled score.
    Here the masked weights are simply replaced by 0.

    ``(γ·erf(z) + γ)/2`` is evaluated as ``γ·erfc(−z)/2`` (see :func:`_erf_plus_one_half`).
    """
    B, S, H, D = q.shape
    N = k.shape[1]
    compute, qc, kc, vc = reference_operands(q, k, v, upcast)
    scores = torch.einsum("bshd,bnhd->bhsn", qc, kc) / math.sqrt(D)
    alpha = derf_alpha.to(compute).view(1, H, 1, 1)
    bias = derf_bias.to(compute).view(1, H, 1, 1)
    gamma = derf_gamma.to(compute).view(1, H, 1, 1)
    weights = gamma * _erf_plus_one_half(alpha * scores + bias)
    visible = visible_keys(S, N, attention_mask, q.device)
    weights = torch.where(visible, weights, torch.zeros((), dtype=compute, device=q.device))
    weights = weights / (weights.sum(dim=-1, keepdim=True) + DERF_EPS)
    out = torch.einsum("bhsn,bnhd->bshd", weights, vc)
    return out.to(q.dtype)


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
    attention_mask: torch.Tensor | None = None,
) -> None:
    """Shapes, dtypes and devices of a functional DERF attention call (raises ShapeError,
    DTypeError or DeviceError naming the argument)."""
    check_functional_core_inputs(q, k, v, attention_mask, dict(derf_alpha=derf_alpha, derf_bias=derf_bias,
                                                                derf_gamma=derf_gamma))


# ----------------------------------------------------------------------------
# Decoding cache
# ----------------------------------------------------------------------------


class DERFCache(KVCache):
    """Keys, values and key keep mask of the tokens seen so far (see
    :class:`~laminae.primitives._cache.KVCache`): ``keys``/``values`` ``[B, length, H_kv, D]``,
    ``keep`` ``[B, length]`` or None. Made by :meth:`DERFAttention.empty_cache`; a call
    never changes the cache it was given, so one cache can be continued several ways.

    Example::

        cache = attn.empty_cache(batch)
        out, cache = attn(q_prompt, k_prompt, v_prompt, prompt_mask, cache)   # prefill
        out, cache = attn(q_next, k_next, v_next, cache=cache)                 # one token at a time
    """


# ----------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------


class DERFAttention(KVCacheCore, nn.Module):
    """DERF attention core: the per-head erf weighting that replaces softmax.

    Owns the seed's per-head parameters ``derf_alpha`` (ones), ``derf_bias`` (zeros)
    and ``derf_gamma`` (ones), each ``[num_heads]``; projections, norms and rotary
    embeddings stay with the caller.

    Args:
        num_heads: H, query heads.
        num_kv_heads: H_kv, key/value heads; must divide ``num_heads``.
        head_dim: D.
        backend: "auto" | "triton" | "reference".

    ``forward(q, k, v, attention_mask=None, cache=None) -> BlockOutput(output, cache)``:

    - without a cache (no decoding): ``q`` ``[B, S, H, D]``, ``k``/``v``
      ``[B, N, H_kv, D]`` with ``N ≥ S`` (the queries are the last S positions),
      ``attention_mask`` ``(B, N)``; ``cache`` is None.
    - with a :class:`DERFCache` (from :meth:`empty_cache`, then from the previous
      call): ``k``/``v`` are the new tokens ``[B, T, H_kv, D]`` and ``attention_mask``
      their ``(B, T)`` keep mask; they are appended, the queries attend to everything
      cached, and the new cache is returned.

    ``output`` is ``[B, S, H, D]`` in the dtype of ``q``.

    Example::

        attn = DERFAttention(num_heads=8, num_kv_heads=2, head_dim=64)
        out, _ = attn(q, k, v, attention_mask=keep)           # training: q, k, v [B, T, ., 64]

        cache = attn.empty_cache(batch)
        out, cache = attn(q_prompt, k_prompt, v_prompt, prompt_keep, cache)
        out, cache = attn(q_next, k_next, v_next, cache=cache)  # one token: [B, 1, ., 64]

    The seed's dropout on the attention weights (training only) is not part of this
    core; the kernels have no dropout.
    """

    cache_type = DERFCache

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

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: DERFCache | None = None,
    ) -> BlockOutput:
        params = (self.derf_alpha, self.derf_bias, self.derf_gamma)
        if cache is not None and not isinstance(cache, DERFCache):
            raise TypeError(f"`cache` must be a DERFCache or None, got {type(cache).__name__}")
        q, k, v, mask = check_attention_inputs(
            q, k, v, attention_mask, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, past=0 if cache is None else cache.length, derf_alpha=self.derf_alpha)
        k, v = zero_padding(mask, k, v)
        keys, values = k, v
        if cache is not None:
            cache.check("DERFAttention", self._cache_config(), k)
            cache = cache.append(k, v, mask)
            keys, values, mask = cache.keys, cache.values, cache.keep
        with without_autocast(q.device.type):
            if resolve_backend(self.backend, q, keys, values) == "triton":
                from laminae.triton_ops.derf import launch_derf_attention

                return BlockOutput(launch_derf_attention(q, keys, values, *params, mask), cache)
            return BlockOutput(derf_attention_reference(q, keys, values, *params, mask), cache)


class DERFContextGate(nn.Module):
    """DERF context gate: ``retrieved · γ·(erf(α·proj([retrieved, x]) + b) + 1)/2``.

    Parameters follow the seed: ``proj`` = ``nn.Linear(2·obs_size, obs_size)``
    (default init), ``alpha`` (ones), ``bias`` (``init_bias``; the default −4 starts
    the gate nearly closed, ≈ 1e-8·γ) and ``gamma`` (ones), each ``[obs_size]``.
    The projection runs in PyTorch on both backends; the kernel fuses the gate.

    ``forward(x, *, retrieved)``: ``x`` (the hidden state the gate reads) and
    ``retrieved`` (the value it gates) are ``[..., obs_size]`` with the same shape and
    dtype; the output has that shape and dtype.

    Example::

        gate = DERFContextGate(512)
        y = gate(hidden, retrieved=memory_read)
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

    def forward(self, x: torch.Tensor, *, retrieved: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x)
        check_tensor("retrieved", retrieved)
        if retrieved.dim() == 0 or retrieved.shape[-1] != self.obs_size:
            raise ShapeError(
                f"last dim of `retrieved` must be obs_size={self.obs_size}, got shape {tuple(retrieved.shape)}")
        if x.shape != retrieved.shape:
            raise ShapeError(
                f"`x` must have the shape of `retrieved` {tuple(retrieved.shape)}, got {tuple(x.shape)}")
        check_has_tokens("x", x, None)
        check_same_device(x=x, retrieved=retrieved, weight=self.proj.weight)
        x, retrieved = match_activation_dtypes(x=x, retrieved=retrieved)
        check_param_dtype("x", x, self.proj.weight)
        logits = self.proj(torch.cat([retrieved, x], dim=-1))
        with without_autocast(retrieved.device.type):
            if resolve_backend(self.backend, retrieved, logits) == "triton":
                from laminae.triton_ops.derf import derf_context_gate

                return derf_context_gate(retrieved, logits, self.alpha, self.bias, self.gamma)
            return derf_context_gate_reference(retrieved, logits, self.alpha, self.bias, self.gamma)
