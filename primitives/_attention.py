"""Pieces shared by the attention cores and their references: the one check of an
attention call's inputs, and the causal visibility of keys."""
from __future__ import annotations

import torch

from ._cache import KVCache, cache_placement
from ._errors import ShapeError
from ._validation import (check_has_tokens, check_keep_mask, check_same_device, check_same_dtype, check_tensor,
                          match_activation_dtypes)

Q_LAYOUT = "[batch, seq, num_heads, head_dim]"
KV_LAYOUT = "[batch, keys, num_kv_heads, head_dim]"


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    past: int = 0,
    new_keys_only: bool = False,
    module: bool = True,
    **others: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inputs of one attention-core call, checked the same way for every core.

    ``q`` ``[B, S, H, D]``; ``k``/``v`` ``[B, N, H_kv, D]`` with ``H_kv`` dividing ``H``
    (grouped-query attention) and ``past + N ≥ S`` (the queries are the last S of the
    ``past`` cached and N given key positions); ``new_keys_only``: N must be S (a core
    whose keys are this call's tokens). ``num_heads``/``num_kv_heads``/``head_dim``
    (None = any) are a module's configuration. ``attention_mask``: the ``(B, N)`` keep
    mask of the given keys. ``others``: parameters that must share the tensors' device.

    Returns ``q, k, v`` in one dtype and the keep mask as bool (None stays None). For a
    ``module``'s call the activations follow the cast policy
    (:func:`~laminae.primitives._validation.match_activation_dtypes`: one dtype outside
    autocast, promoted to the widest under it) and an input without tokens is refused;
    for a functional op (``module=False``) they must share one dtype, and what an empty
    input gives is the op's own math. Raises ShapeError, DTypeError or DeviceError
    naming the argument, before any kernel."""
    check_tensor("q", q, shape=(None, None, num_heads, head_dim), layout=Q_LAYOUT)
    B, S, H, D = q.shape
    kv_layout = KV_LAYOUT + (" of this call's tokens (earlier ones are cached)" if new_keys_only else "")
    check_tensor("k", k, shape=(B, S if new_keys_only else None, num_kv_heads, D), layout=kv_layout)
    check_tensor("v", v, shape=tuple(k.shape), layout=kv_layout)
    if module:
        check_has_tokens("q", q)
    if D == 0:
        raise ShapeError(f"`q` must have head_dim >= 1, got shape {tuple(q.shape)}")
    N, kv_heads = k.shape[1], k.shape[2]
    if kv_heads == 0 or H % kv_heads:
        raise ShapeError(f"num_kv_heads (dim 2 of `k`) must divide num_heads={H} (dim 2 of `q`), got {kv_heads}")
    if past + N < S:
        cached = f" and {past} cached" if past else ""
        raise ShapeError(f"`k`/`v` must cover the {S} query positions and any earlier ones (N >= S), got "
                         f"{N} key positions{cached}")
    check_same_device(q=q, k=k, v=v, attention_mask=attention_mask, **others)
    if module:
        q, k, v = match_activation_dtypes(q=q, k=k, v=v)
    else:
        check_same_dtype(q=q, k=k, v=v)
    return q, k, v, check_keep_mask("attention_mask", attention_mask, B, N)


def check_functional_core_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    per_head: dict[str, torch.Tensor],
    **others: torch.Tensor | None,
) -> None:
    """A functional core call (``module=False`` in :func:`check_attention_inputs`): the
    attention inputs, a ``q`` with tokens, and each ``per_head`` parameter ``[num_heads]``
    on the tensors' device; ``others`` must share that device too."""
    check_attention_inputs(q, k, v, attention_mask, module=False, **per_head, **others)
    check_has_tokens("q", q)
    for name, p in per_head.items():
        check_tensor(name, p, shape=(q.shape[2],), layout="[num_heads]")


def reference_operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, upcast: bool,
) -> tuple[torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a core's ``*_reference`` computes with: the compute dtype (fp32, fp64 for
    fp64 inputs; ``q``'s own dtype when ``upcast`` is False, the same-dtype eager
    baseline), and ``q``, ``k``, ``v`` in it, each kv head repeated for the
    ``H // H_kv`` query heads that read it.

    The layout every reference shares: ``q`` ``[B, S, H, D]``, query i at absolute
    position ``N − S + i``; ``k``/``v`` ``[B, N, H_kv, D]`` with ``N ≥ S`` and
    ``H % H_kv == 0``; ``attention_mask`` an optional ``(B, N)`` keep mask over keys
    (bool or 0/1)."""
    compute = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    group = q.shape[2] // k.shape[2]
    return (compute, q.to(compute), k.to(compute).repeat_interleave(group, dim=2),
            v.to(compute).repeat_interleave(group, dim=2))


class KVCacheCore:
    """``empty_cache`` of an attention core whose cache is the :class:`KVCache` subclass
    ``cache_type``, configured by the core's ``_cache_config()``."""

    cache_type: type[KVCache]

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> KVCache:
        """An empty decoding cache for ``batch`` sequences, holding keys and values in
        ``dtype`` on ``device`` (default: the parameters', or autocast's dtype when made
        under ``torch.autocast``); its storage doubles when full."""
        dtype, device = cache_placement(self, dtype, device)
        return self.cache_type._empty(batch, self._cache_config(), dtype=dtype, device=device)


def masked_softmax(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Softmax over visible keys; rows with none visible are all zeros (no NaN)."""
    any_visible = visible.any(-1, keepdim=True)
    logits = logits.masked_fill(~visible, float("-inf")).masked_fill(~any_visible, 0.0)
    return torch.softmax(logits, dim=-1).masked_fill(~visible, 0.0)


def visible_keys(S: int, N: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``[B or 1, 1, S, N]`` bool: query i (absolute position N − S + i) sees key j when
    j ≤ N − S + i (causal, with S ≤ N cached-or-current keys) and ``attention_mask[b, j]``."""
    rows = torch.arange(S, device=device)[:, None] + (N - S)
    visible = (torch.arange(N, device=device)[None, :] <= rows)[None, None]
    if attention_mask is not None:
        visible = visible & attention_mask.to(device).bool()[:, None, None, :]
    return visible
