"""The attention masks transformers hands an attention function, read as laminae's keep mask.

laminae's attention cores take a ``(batch, keys)`` keep mask (True = keep) and imply
causality, with the S queries the last S of the N keys. transformers passes, depending
on the implementation's registered mask function and on its version, one of: None
(plain causal), a 2-D ``(batch, keys)`` mask (its flash-attention form), a 4-D bool
mask ``[batch, 1 | heads, S, N]`` (True = attend), or a 4-D additive float mask
(0 = attend, the dtype's minimum or −inf = masked). Each form is read explicitly —
an additive mask is never taken for a keep mask — and the 4-D pattern is checked to
be exactly "causal and padding"; what a keep mask cannot express (a sliding window,
packed sequences, bidirectional blocks, per-head masks, a cache whose slots run past
the queries) is refused with a ConfigError that says what it is.
"""
from __future__ import annotations

import torch

from laminae.primitives import ConfigError, DTypeError, ShapeError

__all__ = ["keep_mask_from_hf"]


def _causal(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``[S, N]``: query i (absolute position N − S + i) sees key j ≤ N − S + i."""
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] <= rows


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """The 4-D mask as bool "query attends key"."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise DTypeError(f"a 4-D attention mask must be bool (True = attend) or additive float, got {mask.dtype}")
    visible = mask == 0
    blocked = mask.masked_select(~visible)
    if blocked.numel() and not bool((blocked <= torch.finfo(mask.dtype).min / 2).all()):
        raise ConfigError("the additive attention mask holds values other than 0 and the dtype's minimum/−inf "
                          "(an attention bias such as ALiBi); laminae cores take no additive bias")
    return visible


def _diagnose(visible: torch.Tensor, expected: torch.Tensor, q_len: int, kv_len: int) -> str:
    b, i, j = (int(x) for x in (visible ^ expected).nonzero()[0])
    where = f"row {b}, query {i} (position {kv_len - q_len + i} of {kv_len}), key {j}"
    if visible[b, i, j]:
        return (f"the attention mask lets a query see a later key ({where}): a bidirectional or prefix block, or "
                "a cache whose key slots run past the queries (StaticCache); laminae cores are causal over a "
                "DynamicCache, whose keys end at the last query")
    return (f"the attention mask hides an earlier, unpadded key from a query ({where}): a sliding window, "
            "chunked attention or packed (varlen) sequences, which a (batch, keys) keep mask cannot express")


def keep_mask_from_hf(attention_mask: object, batch: int, q_len: int, kv_len: int,
                      device: torch.device) -> torch.Tensor | None:
    """The ``(batch, kv_len)`` bool keep mask equivalent to ``attention_mask``, or None
    when every key is kept (plain causal attention)."""
    if attention_mask is None:
        if q_len == 1 or q_len == kv_len:
            return None
        # transformers skips the mask with a top-left causal meaning only for a StaticCache prefill
        raise ConfigError(f"no attention mask for {q_len} queries over {kv_len} key slots: the queries are not the "
                          "last keys (a StaticCache prefill?); use the default DynamicCache")
    if not isinstance(attention_mask, torch.Tensor):
        raise ConfigError(f"the attention mask must be None or a tensor, got {type(attention_mask).__name__} "
                          "(a flex-attention BlockMask is not read by laminae cores)")
    if attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (batch, kv_len):
            raise ShapeError(f"a 2-D attention mask must be (batch={batch}, keys={kv_len}), "
                             f"got {tuple(attention_mask.shape)}")
        if attention_mask.is_floating_point():
            raise DTypeError("a 2-D attention mask must be bool or 0/1 integers (True/1 = keep), got "
                             f"{attention_mask.dtype}")
        keep = attention_mask.to(device=device, dtype=torch.bool)
        return None if bool(keep.all()) else keep
    if attention_mask.dim() != 4 or attention_mask.shape[0] not in (1, batch) \
            or tuple(attention_mask.shape[-2:]) != (q_len, kv_len):
        raise ShapeError(f"a 4-D attention mask must be [batch={batch}, 1 or heads, queries={q_len}, "
                         f"keys={kv_len}], got {tuple(attention_mask.shape)}")
    visible = _visible(attention_mask.to(device))
    if visible.shape[1] > 1 and not bool((visible == visible[:, :1]).all()):
        raise ConfigError("the attention mask differs between heads; laminae cores take one mask for all heads")
    visible = visible[:, 0].expand(batch, q_len, kv_len)
    # causal with padding: the keys some query sees are the kept ones (the last query sees them all)
    keep = visible.any(dim=1)
    expected = _causal(q_len, kv_len, visible.device)[None] & keep[:, None, :]
    if not torch.equal(visible, expected):
        raise ConfigError(_diagnose(visible, expected, q_len, kv_len))
    return None if bool(keep.all()) else keep.contiguous()
