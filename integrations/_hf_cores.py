"""The laminae attention cores as transformers attention functions, and their decoding state.

Each registered name runs one core on what a transformers attention module hands its
attention function: queries ``[B, H, S, D]`` after the module's projections, norms and
RoPE, and keys/values ``[B, H_kv, N, D]`` holding the S new tokens after everything the
module's cache (a ``DynamicCache``) held. The core module lives on the attention module
as ``laminae_core`` (DERF's context gate as ``laminae_gate``), so its parameters, init,
names and ``backend`` are the laminae module's own.

Decoding with the transformers cache (per step, one new query over N cached keys):

- DERF, affine-scaled, softmax + XSA are functions of (q, K, V): each step runs the core
  on the cached keys and values; nothing else is kept.
- Elo carries a rating per key accumulated over every earlier *query*, which the
  transformers cache does not hold: a side cache keyed by (transformers cache, layer)
  keeps the core's own decoding cache (its ratings, and its keys and values), and a step
  extends it. A transformers cache it cannot follow (reordered by beam search, cropped,
  or not the one of the previous step) is refused, since the ratings cannot be
  recomputed from keys.
- LUCID's preconditioned values V′ = L⁻¹V are kept the same way (the core's own cache);
  when the side cache does not match the transformers cache it is recomputed from the
  cached keys and values, which is all V′ depends on.

Every call into laminae goes through one small adapter per core below, so a change of
the cores' calling convention is a change here only.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from laminae.primitives import (
    AffineScaledAttention,
    ConfigError,
    DERFAttention,
    DERFContextGate,
    EloAttention,
    ExclusiveSelfAttention,
    LucidAttention,
    ShapeError,
    sdpa_core,
)

__all__ = ["CORES", "OPTIONS", "build_core", "attend"]

# core name -> the options convert() accepts for it (each a constructor argument of the
# laminae module, except DERF's context gate switch and its init bias)
OPTIONS: dict[str, tuple[str, ...]] = {
    "derf": ("context_gate", "gate_init_bias"),
    "elo": ("elo_k_init",),
    "affine": ("affine_momentum", "alpha_ma_init", "activation", "initializer_range"),
    "lucid": ("lucid_attention_eps", "unit_diagonal"),
    "xsa": ("mode", "eps"),
}
CORES = tuple(OPTIONS)


def build_core(kind: str, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
               backend: str, options: dict[str, Any]) -> dict[str, nn.Module]:
    """The laminae modules one attention module gets, by attribute name."""
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    opts = dict(options)
    if kind == "derf":
        gate, bias = opts.pop("context_gate", False), opts.pop("gate_init_bias", None)
        if not isinstance(gate, bool):
            raise ConfigError(f"`context_gate` must be a bool, got {gate!r}")
        modules: dict[str, nn.Module] = {"laminae_core": DERFAttention(**heads, backend=backend)}
        if gate:
            if num_heads * head_dim != hidden_size:
                raise ConfigError(f"the DERF context gate gates the attention output ({num_heads}·{head_dim} "
                                  f"features) by the hidden state ({hidden_size}): they must be equal")
            extra = {} if bias is None else {"init_bias": bias}
            modules["laminae_gate"] = DERFContextGate(hidden_size, **extra, backend=backend)
        elif bias is not None:
            raise ConfigError("`gate_init_bias` needs `context_gate=True`")
        return modules
    if kind == "elo":
        return {"laminae_core": EloAttention(**heads, **opts, backend=backend)}
    if kind == "affine":
        return {"laminae_core": AffineScaledAttention(hidden_size, **heads, **opts, backend=backend)}
    if kind == "lucid":
        return {"laminae_core": LucidAttention(**heads, **opts, backend=backend)}
    return {"laminae_core": ExclusiveSelfAttention(**heads, **opts, backend=backend)}


# ----------------------------------------------------------------------------
# Adapters: the only calls into laminae's cores
# ----------------------------------------------------------------------------


def _derf(core: DERFAttention, q, k, v, keep):
    return core(q, k, v, keep).output


def _affine(core: AffineScaledAttention, q, k, v, keep, x):
    return core(q, k, v, keep, x=x).output


def _elo(core: EloAttention, q, k, v, keep, cache):
    return core(q, k, v, keep, cache)


def _lucid(core: LucidAttention, q, k, v, keep, cache):
    return core(q, k, v, keep, cache)


def _gate(gate: DERFContextGate, y, hidden):
    return gate(hidden, retrieved=y)


def _softmax_xsa(xsa: ExclusiveSelfAttention, q, k, v, keep):
    y = sdpa_core(q, k, v, keep)
    v_new = v[:, k.shape[1] - q.shape[1]:]
    if keep is not None:
        # as GroupedQueryAttention does: XSA reads the values with padding zeroed
        v_new = torch.where(keep[:, -q.shape[1]:, None, None], v_new, torch.zeros_like(v_new))
    return xsa(y, v=v_new)


def _empty_cache(core: nn.Module, batch: int, like: torch.Tensor):
    """The core's empty decoding cache, in the dtype and on the device of ``like``."""
    return core.empty_cache(batch, dtype=like.dtype, device=like.device)


# ----------------------------------------------------------------------------
# Decoding state the transformers cache cannot hold (Elo ratings, LUCID's V′)
# ----------------------------------------------------------------------------


@dataclass
class _Side:
    keys: torch.Tensor     # the transformers cache's keys [B, H_kv, N, D] this state was built with
    cache: Any             # the core's own decoding cache after those N keys


# transformers cache -> {layer index: _Side}; an entry lives as long as its cache
_SIDE: "weakref.WeakKeyDictionary[Any, dict[int, _Side]]" = weakref.WeakKeyDictionary()


def _side_state(hf_cache: Any, layer: int, key: torch.Tensor, past: int) -> _Side | None:
    """The state left by the previous step, if it describes exactly these cached keys."""
    entry = _SIDE.get(hf_cache, {}).get(layer) if hf_cache is not None else None
    if entry is None or entry.keys.shape[2] != past or entry.keys.shape[:2] != key.shape[:2]:
        return None
    return entry if torch.equal(entry.keys, key[:, :, :past]) else None


def _store(hf_cache: Any, layer: int, key: torch.Tensor, cache: Any) -> None:
    if hf_cache is not None and cache is not None:
        _SIDE.setdefault(hf_cache, {})[layer] = _Side(key, cache)


def _stateful(kind: str, module: nn.Module, key: torch.Tensor, q, k, v, keep, hf_cache: Any) -> torch.Tensor:
    """Elo and LUCID: prefill, or one more step of the core's own cache."""
    core, call = module.laminae_core, (_elo if kind == "elo" else _lucid)
    layer = getattr(module, "layer_idx", 0)
    past = k.shape[1] - q.shape[1]
    if past == 0:
        # nothing is decoded without a transformers cache (use_cache=False) or with
        # gradients on (training): the core's caches hold detached tensors
        start = None if hf_cache is None or torch.is_grad_enabled() else _empty_cache(core, q.shape[0], k)
        out, cache = call(core, q, k, v, keep, start)
        _store(hf_cache, layer, key, cache)
        return out
    side = _side_state(hf_cache, layer, key, past)
    if side is not None:
        new_keep = None if keep is None else keep[:, past:]
        out, cache = call(core, q, k[:, past:], v[:, past:], new_keep, side.cache)
    elif kind == "lucid":
        # V′ depends on the keys and values only: rebuild it over every cached key
        # (the first `past` queries are placeholders whose outputs are dropped)
        padded = torch.cat([q.new_zeros(q.shape[0], past, *q.shape[2:]), q], dim=1)
        out, cache = call(core, padded, k, v, keep, _empty_cache(core, q.shape[0], k))
        out = out[:, past:]
    elif hf_cache is None:
        raise ConfigError(f"Elo attention (layer {layer}) got {past} cached keys but no transformers cache object "
                          "(the attention module's `cache` argument) to find their ratings by")
    else:
        raise ConfigError(
            f"Elo attention (layer {layer}) got {past} cached keys whose ratings it did not compute: the "
            "transformers cache was reordered (beam search), cropped (assisted decoding), is not the one "
            "of the previous step, or was filled with gradients on; Elo ratings accumulate over earlier "
            "queries and cannot be rebuilt from keys, so decode with greedy search or sampling over one "
            "DynamicCache, under torch.no_grad()")
    _store(hf_cache, layer, key, cache)
    return out


# ----------------------------------------------------------------------------
# One call
# ----------------------------------------------------------------------------


def attend(kind: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           keep: torch.Tensor | None, scaling: float | None, hidden: torch.Tensor | None,
           hf_cache: Any) -> torch.Tensor:
    """``[B, S, H, D]`` attention output of ``kind`` for transformers' ``query``
    ``[B, H, S, D]`` and ``key``/``value`` ``[B, H_kv, N, D]``."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    D = q.shape[-1]
    if k.shape[-1] != D or v.shape[-1] != D:
        raise ShapeError(f"laminae cores need one head dim for queries, keys and values, got "
                         f"{D}, {k.shape[-1]} and {v.shape[-1]}")
    if scaling is not None and not math.isclose(scaling * math.sqrt(D), 1.0, rel_tol=1e-12):
        # the cores scale scores by 1/√D: a module's other scale is carried by the queries
        q = q * (scaling * math.sqrt(D))
    core = module.laminae_core
    if kind == "derf":
        y = _derf(core, q, k, v, keep)
        gate = getattr(module, "laminae_gate", None)
        if gate is not None:
            B, S, H, _ = y.shape
            y = _gate(gate, y.reshape(B, S, H * D), _needs_hidden(hidden, kind)).view(B, S, H, D)
        return y
    if kind == "affine":
        return _affine(core, q, k, v, keep, _needs_hidden(hidden, kind))
    if kind == "xsa":
        return _softmax_xsa(core, q, k, v, keep)
    return _stateful(kind, module, key, q, k, v, keep, hf_cache)


def _needs_hidden(hidden: torch.Tensor | None, kind: str) -> torch.Tensor:
    if hidden is None:
        raise ConfigError(f"the {kind} core reads the attention module's input hidden state, which this call did "
                          "not pass on (was the module converted with laminae's convert?)")
    return hidden
