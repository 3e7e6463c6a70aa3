"""Input checks shared by every mechanism. Messages name the argument, what was
expected and what was received, so the caller can fix the call without reading
the source."""
from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence

import torch

from ._errors import ConfigError, DeviceError, DTypeError, ShapeError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = FLOAT_DTYPES,
    layout: str | None = None,
) -> torch.Tensor:
    """Check type, rank, sizes (``None`` = any) and dtype of one tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    where = f" (expected layout {layout})" if layout else ""
    if ndim is not None and t.dim() != ndim:
        raise ShapeError(f"`{name}` must have {ndim} dimensions{where}, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape):
            raise ShapeError(f"`{name}` must have {len(shape)} dimensions{where}, got shape {tuple(t.shape)}")
        for axis, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                expected = tuple("*" if s is None else s for s in shape)
                raise ShapeError(
                    f"`{name}` has size {got} on dim {axis}, expected {want}: "
                    f"expected shape {expected}{where}, got {tuple(t.shape)}"
                )
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise DTypeError(f"`{name}` must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    return t


def check_has_tokens(name: str, t: torch.Tensor, token_dims: int | None = 2) -> None:
    """The empty-input rule (docs/protocol.md, "Empty inputs"): a block refuses an input
    without tokens (a batch or a sequence of size 0) with ShapeError, before any kernel.
    ``token_dims``: the leading dims that index tokens, 2 for ``[batch, seq, ...]``, None
    for a token-wise ``[..., D]`` input (every dim but the last)."""
    dims = t.shape[:-1] if token_dims is None else t.shape[:token_dims]
    if math.prod(dims) == 0:
        raise ShapeError(f"`{name}` must hold at least one token, got shape {tuple(t.shape)}")


def check_context(name: str, past: int, new: int, max_positions: int | None) -> None:
    """A model's context rule (docs/protocol.md, "Context length"): cached plus new
    tokens fit ``max_positions`` (``None``: no limit). Both are known on the host, so a
    sequence past a rotary table or a YaRN range is a ShapeError before any kernel."""
    if max_positions is not None and past + new > max_positions:
        raise ShapeError(f"`{name}`: {past} cached + {new} new tokens exceed the context "
                         f"max_positions={max_positions}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {k: v.device for k, v in present.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{k} on {d}" for k, d in devices.items())
        raise DeviceError(f"all tensors must be on one device, got {listing}")


def check_same_dtype(**tensors: torch.Tensor | None) -> None:
    present = {k: v.dtype for k, v in tensors.items() if v is not None}
    if len(set(present.values())) > 1:
        listing = ", ".join(f"{k}: {str(d).replace('torch.', '')}" for k, d in present.items())
        raise DTypeError(f"activations must share one dtype, got {listing}")


INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def debug_checks_enabled() -> bool:
    """``LAMINAE_DEBUG=1`` turns on the value checks that read tensors back to the host
    (a device sync per call), off by default; functions that have one also take
    ``validate=`` to decide per call."""
    return os.environ.get("LAMINAE_DEBUG", "0") not in ("", "0")


def check_keep_mask(name: str, mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """A 2-D ``(batch, length)`` keep mask (True = keep), returned as bool.

    bool, or an integer tensor as tokenizers return (read as ``mask != 0``). A floating
    mask is refused by its dtype, never by its values: an additive mask (0 = keep,
    -inf = drop) is all zeros on an unpadded batch, which read as a keep mask would drop
    every token. Checking that an integer mask holds only 0 and 1 reads it on the host,
    so it runs only with ``LAMINAE_DEBUG=1`` (and never while compiling)."""
    if mask is None:
        return None
    check_tensor(name, mask, dtypes=None, shape=(batch, length), layout="(batch, seq) keep mask")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        raise DTypeError(
            f"`{name}` must be a keep mask of dtype bool (True = keep) or integer 0/1, got "
            f"{str(mask.dtype).replace('torch.', '')}: for an additive mask (0 = keep, -inf = drop) pass "
            f"`{name}=(mask == 0)`; for a 0./1. float keep mask pass `{name}=mask.bool()`")
    if mask.dtype not in INTEGER_DTYPES:
        raise DTypeError(f"`{name}` must be a keep mask of dtype bool or integer 0/1, got "
                         f"{str(mask.dtype).replace('torch.', '')}")
    if debug_checks_enabled() and not torch.compiler.is_compiling() and mask.device.type != "meta":
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ConfigError(f"`{name}` must hold only 0 and 1 (1 = keep), got values in "
                              f"[{int(mask.min())}, {int(mask.max())}]")
    return mask != 0


def dense_keep_mask(mask: torch.Tensor | None, batch: int, length: int, device: torch.device | str) -> torch.Tensor:
    """The ``(batch, length)`` bool keep mask on ``device``: ``mask`` read as nonzero =
    keep, or every token kept when there is none (for math that needs a tensor; the
    checks are :func:`check_keep_mask`'s)."""
    if mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    return mask.to(device) != 0


def zero_padding(mask: torch.Tensor | None, *tensors: torch.Tensor | None) -> tuple:
    """Each ``[batch, seq, ...]`` tensor with its positions where ``mask`` (``(batch,
    seq)`` keep mask) is 0 replaced by 0, so padding contents (even NaN or inf) cannot
    reach kept positions through a ``0 · x`` inside a masked product. ``torch.where``,
    not a multiplication: 0 · NaN is NaN."""
    if mask is None:
        return tensors
    keep = mask.bool()
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        k = keep.to(t.device).view(*keep.shape, *([1] * (t.dim() - 2)))
        out.append(torch.where(k, t, torch.zeros((), dtype=t.dtype, device=t.device)))
    return tuple(out)


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"`{name}` must be a positive int, got {value!r}")
    return value


def check_positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"`{name}` must be a positive number, got {value!r}")
    return float(value)


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        raise ConfigError(f"`{name}` must be one of {list(choices)}, got {value!r}")


# ----------------------------------------------------------------------------
# The cast policy (docs/protocol.md, "Autocast and dtypes")
# ----------------------------------------------------------------------------


def autocast_active(device_type: str) -> bool:
    return torch.is_autocast_enabled(device_type)


def match_activation_dtypes(**tensors: torch.Tensor | None) -> tuple:
    """The activations of one call in one dtype.

    Outside autocast they must already share it (``DTypeError`` otherwise: a silent cast
    would hide a bug). Under ``torch.autocast`` a block receives what autocast produced
    (a bf16 sublayer output next to an fp32 residual stream): they are promoted to the
    widest dtype among them, as ``a + b`` would, and the block returns that dtype."""
    present = [t for t in tensors.values() if t is not None]
    if not present:
        return tuple(tensors.values())
    dtypes = {t.dtype for t in present}
    if len(dtypes) == 1:
        return tuple(tensors.values())
    if not autocast_active(present[0].device.type):
        check_same_dtype(**tensors)
    common = present[0].dtype
    for t in present[1:]:
        common = torch.promote_types(common, t.dtype)
    return tuple(None if t is None else t.to(common) for t in tensors.values())


def check_param_dtype(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Outside autocast, an activation that meets a module's own weights in a matmul
    must have their dtype (a bf16 input to an fp32 module raises DTypeError, not a
    raw torch error). Under autocast the matmul casts both."""
    if x.dtype != weight.dtype and not autocast_active(x.device.type):
        raise DTypeError(
            f"`{name}` has dtype {str(x.dtype).replace('torch.', '')} but the module's parameters are "
            f"{str(weight.dtype).replace('torch.', '')}: convert the module (module.to(dtype)) or the input, "
            "or run under torch.autocast")


def without_autocast(device_type: str):
    """The block's own math runs with autocast off, on the dtypes the policy chose, so
    the reference and the kernels compute the same thing (fp32 accumulation)."""
    if not torch.amp.is_autocast_available(device_type):   # e.g. meta tensors
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)
