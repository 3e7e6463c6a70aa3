"""XSA: exclusive self-attention (Zhai, 2026).

After any attention core, each query head's output ``y`` is made orthogonal to the
value vector of its own position, so the attention layer carries only context and
not a copy of the token itself:

    y ← y − c·v,    c = (y·v) / den(v)

Two denominators are in use, selected with ``mode``:

    "normalized"    den = (‖v‖ + ε)²    ε = 1e-8   v is normalised first:
                                                  vn = v/(‖v‖+ε), y ← y − (y·vn)·vn
    "squared_norm"  den = ‖v‖² + ε      ε = 1e-6   y ← y − (y·v)/(‖v‖²+ε)·v

Both are the same projection away from ``v`` for ‖v‖ ≫ ε and differ only in how
a near-zero value vector is regularised (v = 0 leaves ``y`` unchanged in both).

``v`` is each query head's own value vector at the same position: under grouped-
query attention query head ``h`` uses kv head ``h // (H / Hkv)`` (the order of
``repeat_interleave`` over heads). It may be any reference value tensor, e.g. the
values after a preconditioning step, as long as it is the one that was aggregated.
With a KV cache, pass the value vectors of the S new positions only (the slice of
the cache the current queries sit at), not the whole cache.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ._backend import Backend, check_backend, resolve_backend
from ._errors import ConfigError, ShapeError
from ._validation import (check_choice, check_has_tokens, check_positive_int, check_same_device, check_same_dtype,
                          check_tensor, match_activation_dtypes, without_autocast)

__all__ = ["xsa_reference", "ExclusiveSelfAttention", "XSA_MODES", "xsa_eps", "check_xsa_inputs"]

# mode -> default ε
XSA_MODES: dict[str, float] = {"normalized": 1e-8, "squared_norm": 1e-6}


def xsa_eps(mode: str, eps: float | None) -> float:
    """Validate ``mode`` and return ε (the mode's default when ``eps`` is None)."""
    check_choice("mode", mode, tuple(XSA_MODES))
    if eps is None:
        return XSA_MODES[mode]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
        raise ConfigError(f"`eps` must be a positive finite number, got {eps!r}")
    return float(eps)


def check_xsa_inputs(y: object, v: object, num_heads: int | None = None, num_kv_heads: int | None = None,
                     head_dim: int | None = None) -> tuple[int, int, int, int, int]:
    """Check ``y`` [B, S, H, D] against ``v`` [B, S, Hkv, D]; return (B, S, H, Hkv, D)."""
    check_tensor("y", y, shape=(None, None, num_heads, head_dim), layout="(batch, seq, num_heads, head_dim)")
    batch, seq, heads, dim = y.shape
    check_tensor("v", v, shape=(batch, seq, num_kv_heads, dim), layout="(batch, seq, num_kv_heads, head_dim)")
    kv_heads = v.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ShapeError(f"num_heads of `y` ({heads}) must be a multiple of num_kv_heads of `v` ({kv_heads})")
    check_same_dtype(y=y, v=v)
    check_same_device(y=y, v=v)
    return batch, seq, heads, kv_heads, dim


def xsa_reference(
    y: torch.Tensor,
    v: torch.Tensor,
    *,
    mode: str = "normalized",
    eps: float | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Reference XSA projection.

    Args:
        y: attention output ``[B, S, H, D]``.
        v: value vectors ``[B, S, Hkv, D]`` of the same positions, Hkv dividing H.
        mode: "normalized" (den = (‖v‖+ε)², default ε 1e-8) or "squared_norm"
            (den = ‖v‖²+ε, default ε 1e-6).
        eps: ε; None picks the mode's default.
        upcast: compute in fp32 (fp64 stays fp64) and cast back (the ground truth);
            ``False`` keeps the input dtype (the same-dtype eager baseline).
    Returns:
        ``y − ((y·v)/den)·v`` with the shape and dtype of ``y``.
    """
    eps = xsa_eps(mode, eps)
    batch, seq, heads, kv_heads, dim = check_xsa_inputs(y, v)
    dtype = y.dtype
    if upcast:
        compute = torch.promote_types(dtype, torch.float32)
        y, v = y.to(compute), v.to(compute)
    yg = y.reshape(batch, seq, kv_heads, heads // kv_heads, dim)
    vg = v.unsqueeze(3)  # [B, S, Hkv, 1, D], shared by the group's query heads
    if mode == "normalized":
        vn = vg / (torch.linalg.vector_norm(vg, dim=-1, keepdim=True) + eps)
        out = yg - (yg * vn).sum(-1, keepdim=True) * vn
    else:
        den = (vg * vg).sum(-1, keepdim=True) + eps
        out = yg - ((yg * vg).sum(-1, keepdim=True) / den) * vg
    return out.reshape(batch, seq, heads, dim).to(dtype)


class ExclusiveSelfAttention(nn.Module):
    """XSA as a module: ``y_out = module(y, v=v)``. Introduces no parameters.

    Args:
        num_heads: H, query heads of ``y``.
        num_kv_heads: Hkv, heads of ``v``; must divide H (H == Hkv for plain
            multi-head attention, 1 for multi-query attention).
        head_dim: D.
        mode: "normalized" (v/(‖v‖+ε), ε = 1e-8) or "squared_norm" (‖v‖²+ε, ε = 1e-6).
        eps: ε; None picks the mode's default.
        backend: "auto" | "triton" | "reference".

    Shapes: ``y`` ``[B, S, H, D]`` (the attention output before heads are merged),
    ``v`` ``[B, S, Hkv, D]`` (the values of the same S positions; with a KV cache,
    the newly appended ones). fp32/bf16/fp16 (fp64 on the reference backend).

    Example::

        xsa = ExclusiveSelfAttention(num_heads=8, num_kv_heads=2, head_dim=64)
        y = attention(q, k, v)[0]       # [B, S, 8, 64], v: [B, S, 2, 64]
        y = xsa(y, v=v)
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        mode: str = "normalized",
        eps: float | None = None,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        check_positive_int("num_heads", num_heads)
        check_positive_int("num_kv_heads", num_kv_heads)
        check_positive_int("head_dim", head_dim)
        check_backend(backend)
        if num_heads % num_kv_heads != 0:
            raise ConfigError(f"`num_heads` ({num_heads}) must be a multiple of `num_kv_heads` ({num_kv_heads})")
        self.eps = xsa_eps(mode, eps)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.mode, self.backend = mode, backend

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"mode={self.mode!r}, eps={self.eps}, backend={self.backend!r}")

    def forward(self, y: torch.Tensor, *, v: torch.Tensor) -> torch.Tensor:
        check_tensor("y", y, ndim=4, layout="(batch, seq, num_heads, head_dim)")
        check_tensor("v", v, ndim=4, layout="(batch, seq, num_kv_heads, head_dim)")
        y, v = match_activation_dtypes(y=y, v=v)
        check_xsa_inputs(y, v, self.num_heads, self.num_kv_heads, self.head_dim)
        check_has_tokens("y", y)
        with without_autocast(y.device.type):
            if resolve_backend(self.backend, y, v) == "triton":
                from laminae.triton_ops.xsa import xsa

                return xsa(y, v, mode=self.mode, eps=self.eps)
            return xsa_reference(y, v, mode=self.mode, eps=self.eps)
