"""Pieces shared by the attention cores and their references: the one check of an
attention call's inputs, and the causal visibility of keys."""
from __future__ import annotations

import torch

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


def visible_keys(S: int, N: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``[B or 1, 1, S, N]`` bool: query i (absolute position N − S + i) sees key j when
    j ≤ N − S + i (causal, with S ≤ N cached-or-current keys) and ``attention_mask[b, j]``."""
    rows = torch.arange(S, device=device)[:, None] + (N - S)
    visible = (torch.arange(N, device=device)[None, :] <= rows)[None, None]
    if attention_mask is not None:
        visible = visible & attention_mask.to(device).bool()[:, None, None, :]
    return visible
