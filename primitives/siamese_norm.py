"""SiameseNorm: a two-stream residual topology that uses RMSNorm only
(Li, Han, et al., *SiameseNorm: Breaking the Barrier to Reconciling Pre/Post-Norm*,
ICML 2026; the "hybrid_pre" language-model variant).

Two residual streams of shape ``[..., D]`` run through every decoder layer:

* ``X``, the **bounded** (Post-Norm-like) stream: renormalised once per layer and
  fed depth-damped updates, so its RMS stays near the norm weight;
* ``Y``, the **unbounded** (Pre-Norm-like) stream: a clean residual sum, an identity
  gradient path from the embedding to the output.

Both start as the embedding output (``X₀ = Y₀ = e``, :func:`siamese_start`). Layer
``l`` (attention ``A`` and MLP ``F`` are shared by the two streams; c = √(2(l+1))):

    u = s ⊙ X + RMSNorm_attn_y(Y)         h = RMSNorm_attn_in(u)      a = A(h)
    X ← X + a/c                           Y ← Y + a
    X ← RMSNorm_mlp_x(X)                                              (post-norm)
    u = X + RMSNorm_mlp_y(Y)              h = RMSNorm_mlp_in(u)       m = F(h)
    X ← X + m/c                           Y ← Y + m

and the model output is ``z = RMSNorm_final(RMSNorm_final_x(X) + RMSNorm_final_y(Y))``.

Every step between two sublayers is one row-wise *boundary*
(:func:`siamese_boundary_reference`):

    x1 = x + c_inv·update,  y1 = y + update        (when an update is given)
    x2 = RMSNorm(x1; wx)                            (when an X post-norm is given) → new X
    u  = s ⊙ x2 + RMSNorm(y1; wy)                   (scale and Y norm optional)
    h  = RMSNorm(u; w_in)                           (when the input is normalised) → sublayer input

The attention boundary, the MLP boundary, the end-of-layer update and the final
fusion are this one function with different pieces switched on; the Triton kernel
(``laminae.triton_ops.siamese_norm``) fuses each into one memory pass.

SiameseNorm owns the residual flow, so it must not be combined with LAuReL or AttnRes
in one model (the recipe enforces this). StackMemory is allowed: it acts on the
shared sublayer input ``h`` (wrap the attention callable so it sees ``h`` first).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import nn

from ._backend import Backend, check_backend, resolve_backend
from ._errors import ConfigError, DTypeError, ShapeError
from ._validation import (autocast_active, check_choice, check_has_tokens, check_positive_int, check_same_device,
                          check_same_dtype, check_tensor, without_autocast)
from .blocks.norms import RMSNorm, rms_norm

__all__ = [
    "siamese_boundary_reference",
    "siamese_start",
    "siamese_depth_constant",
    "SiameseStreams",
    "SiameseNormLayer",
    "SiameseNormFinal",
    "ATTN_X_MODES",
]

ATTN_X_MODES = ("scale", "postnorm")
NORM_TYPES = ("rmsnorm",)


class SiameseStreams(NamedTuple):
    """What a :class:`SiameseNormLayer` returns: both residual streams, each ``[..., D]``
    (the one block whose outputs are two activations, so neither field is a cache)."""

    x: torch.Tensor   # the bounded (Post-Norm-like) stream X
    y: torch.Tensor   # the unbounded (Pre-Norm-like) stream Y


# ----------------------------------------------------------------------------
# Reference math
# ----------------------------------------------------------------------------


def check_boundary_args(
    x: torch.Tensor,
    y: torch.Tensor,
    update: torch.Tensor | None,
    c_inv: float,
    x_scale: torch.Tensor | None,
    x_norm_weight: torch.Tensor | None,
    y_norm_weight: torch.Tensor | None,
    in_norm_weight: torch.Tensor | None,
    eps: float,
) -> None:
    """Checks shared by the reference and the Triton boundary (the modules check more)."""
    check_tensor("x", x)
    check_tensor("y", y)
    if x.dim() == 0:
        raise ShapeError(f"`x` must have at least one dimension [..., D], got shape {tuple(x.shape)}")
    if x.shape != y.shape:
        raise ShapeError(f"`x` and `y` must have the same shape, got x {tuple(x.shape)} and y {tuple(y.shape)}")
    d = x.shape[-1]
    if update is not None:
        check_tensor("update", update)
        if update.shape != x.shape:
            raise ShapeError(
                f"`update` must have the shape of `x` {tuple(x.shape)}, got {tuple(update.shape)}"
            )
    check_same_dtype(x=x, y=y, update=update)
    for name, w in (("x_scale", x_scale), ("x_norm_weight", x_norm_weight),
                    ("y_norm_weight", y_norm_weight), ("in_norm_weight", in_norm_weight)):
        if w is not None:
            check_tensor(name, w, shape=(d,), layout="[D]")
    check_same_device(x=x, y=y, update=update, x_scale=x_scale, x_norm_weight=x_norm_weight,
                      y_norm_weight=y_norm_weight, in_norm_weight=in_norm_weight)
    if isinstance(c_inv, bool) or not isinstance(c_inv, (int, float)) or not math.isfinite(c_inv):
        raise ConfigError(f"`c_inv` must be a finite float, got {c_inv!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ConfigError(f"`eps` must be a number >= 0, got {eps!r}")


def _rms_norm(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(t; w) = t·rsqrt(mean(t²) + eps)·w in fp32 (fp64 stays fp64), returned in t's dtype."""
    return rms_norm(t, weight, eps, upcast=True, upcast_weight=True)


def siamese_boundary_reference(
    x: torch.Tensor,
    y: torch.Tensor,
    update: torch.Tensor | None = None,
    c_inv: float = 1.0,
    x_scale: torch.Tensor | None = None,
    x_norm_weight: torch.Tensor | None = None,
    y_norm_weight: torch.Tensor | None = None,
    in_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    return_streams: bool = True,
    return_h: bool = True,
    upcast: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One SiameseNorm boundary, row-wise over the last dim D.

    Args:
        x: bounded stream X ``[..., D]`` (fp32/bf16/fp16/fp64).
        y: unbounded stream Y, same shape and dtype as ``x``.
        update: the previous sublayer's output (``[..., D]``) or None. Applied as
            ``x + c_inv·update`` and ``y + update``.
        c_inv: 1/c_l, the depth damping of the bounded stream's update.
        x_scale: elementwise scale s ``[D]`` of X in the fused input, or None.
        x_norm_weight: RMSNorm weight ``[D]`` of the X post-norm (replaces X), or None.
        y_norm_weight: RMSNorm weight ``[D]`` of Y in the fused input, or None.
        in_norm_weight: RMSNorm weight ``[D]`` of the fused input, or None.
        eps: RMSNorm epsilon, >= 0 (the modules require > 0; 0 only reproduces
            exact worked examples and divides by zero on a zero row).
        return_streams: return the new X and Y (else None, None).
        return_h: compute and return the sublayer input h (else None).
        upcast: compute in fp32 (fp64 for fp64 inputs) and cast back: the ground
            truth. ``False`` rounds every step to the input dtype, each RMSNorm still
            computed in fp32, as an eager chain of modules would (the same-dtype
            baseline).

    Returns:
        ``(x_new, y_new, h)``, each ``[..., D]`` in the input dtype or None.
    """
    check_boundary_args(x, y, update, c_inv, x_scale, x_norm_weight, y_norm_weight, in_norm_weight, eps)
    dtype = x.dtype
    work = torch.promote_types(dtype, torch.float32) if upcast else dtype

    x1, y1 = x.to(work), y.to(work)
    if update is not None:
        a = update.to(work)
        x1 = x1 + c_inv * a
        y1 = y1 + a
    x2 = _rms_norm(x1, x_norm_weight, eps) if x_norm_weight is not None else x1

    h = None
    if return_h:
        xs = x_scale.to(work) * x2 if x_scale is not None else x2
        yn = _rms_norm(y1, y_norm_weight, eps) if y_norm_weight is not None else y1
        u = xs + yn
        h = _rms_norm(u, in_norm_weight, eps) if in_norm_weight is not None else u
        h = h.to(dtype)
    if not return_streams:
        return None, None, h
    return x2.to(dtype), y1.to(dtype), h


def siamese_start(embeddings: torch.Tensor) -> SiameseStreams:
    """The two streams at the first layer: ``X₀ = Y₀ = e`` (the embedding output)."""
    check_tensor("embeddings", embeddings)
    return SiameseStreams(embeddings, embeddings)


def siamese_depth_constant(layer_idx: int, depth_scaling: bool = True) -> float:
    """c_l = √(2·(layer_idx+1)) with a zero-based layer index (1 without depth scaling)."""
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
        raise ConfigError(f"`layer_idx` must be an int >= 0 (zero-based), got {layer_idx!r}")
    return math.sqrt(2.0 * (layer_idx + 1)) if depth_scaling else 1.0


# ----------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
        raise ConfigError(f"`eps` must be a finite number > 0 (a zero row needs it), got {eps!r}")
    return float(eps)


def _check_norm_type(norm_type: object) -> None:
    if norm_type not in NORM_TYPES:
        raise ConfigError(f"`norm_type` must be 'rmsnorm' (SiameseNorm is RMSNorm only), got {norm_type!r}")


def _stream_norm(hidden_size: int, eps: float) -> RMSNorm:
    """An RMSNorm weight ``[D]`` initialised to 1 (state-dict key ``<name>.weight``), computed
    in fp32 with one rounding at the end. The SiameseNorm modules read only its ``weight``
    and fuse the normalisation into the boundary op."""
    return RMSNorm(hidden_size, eps, upcast=True, upcast_weight=True)


def _boundary(backend: str, x, y, update=None, c_inv=1.0, x_scale=None, x_norm_weight=None,
              y_norm_weight=None, in_norm_weight=None, eps=1e-6, *, return_streams=True, return_h=True):
    if resolve_backend(backend, x, y, update) == "triton":
        from laminae.triton_ops.siamese_norm import siamese_boundary

        fn = siamese_boundary
    else:
        fn = siamese_boundary_reference
    with without_autocast(x.device.type):
        return fn(x, y, update, c_inv, x_scale, x_norm_weight, y_norm_weight, in_norm_weight, eps,
                  return_streams=return_streams, return_h=return_h)


def _check_streams(module: nn.Module, hidden_size: int, x: torch.Tensor, y: torch.Tensor) -> None:
    check_tensor("x", x)
    check_tensor("y", y)
    if x.shape != y.shape:
        raise ShapeError(f"`x` and `y` must have the same shape, got x {tuple(x.shape)} and y {tuple(y.shape)}")
    if x.dim() == 0 or x.shape[-1] != hidden_size:
        raise ShapeError(f"last dim of `x`/`y` must be hidden_size={hidden_size}, got shape {tuple(x.shape)}")
    check_has_tokens("x", x, None)
    check_same_dtype(x=x, y=y)
    check_same_device(x=x, y=y, parameters=next(module.parameters()))


def _check_branch(name: str, out: object, h: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the {name} sublayer must return a torch.Tensor, got {type(out).__name__}")
    if out.shape != h.shape:
        raise ShapeError(
            f"the {name} sublayer must return its input's shape {tuple(h.shape)}, got {tuple(out.shape)}"
        )
    if out.dtype != h.dtype and autocast_active(h.device.type):
        # the cast policy: under autocast a sublayer returns the autocast dtype; the
        # streams keep theirs (the residual stream's precision is the point of fp32 streams)
        return out.to(h.dtype)
    if out.dtype != h.dtype:
        raise DTypeError(
            f"the {name} sublayer must return the streams' dtype {str(h.dtype).replace('torch.', '')}, "
            f"got {str(out.dtype).replace('torch.', '')}"
        )
    check_same_device(**{"streams": h, f"{name} output": out})
    return out


class SiameseNormLayer(nn.Module):
    """One SiameseNorm decoder layer around any attention and MLP: ``(X, Y) → (X', Y')``.

    Args:
        hidden_size: D.
        layer_idx: zero-based depth l; the bounded stream's updates are divided by
            c_l = √(2(l+1)).
        attention, mlp: callables ``h [..., D] → [..., D]`` (typically modules; their
            parameters then live under ``attention.*`` / ``mlp.*``). Both streams share
            one call of each.
        normalized_input: RMSNorm the fused input before each sublayer (the seed's
            ``siamese_normalized_input``, default True; spec open point 3: both sides).
        depth_scaling: use c_l (the seed's ``siamese_depth_scaling``); False gives c = 1
            and identical updates to both streams.
        attn_x_scale_init: initial value of the elementwise scale ``attn_x_scale``
            (the seed's ``siamese_attn_x_scale_init``, 1.0).
        attn_x_mode: how X enters the attention input (spec open point 1).
            "scale" (default; the hybrid_pre LM variant): ``s ⊙ X``, X unchanged.
            "postnorm" (the DeiT/DiT releases): X is replaced by ``RMSNorm_attn_x(X)``.
        use_attn_y_norm: False drops ``attn_y_norm`` so Y enters the attention input
            unnormalised: the seed's ``use_embedding_input_norm=False`` at layer 0
            (spec open point 4).
        eps: RMSNorm epsilon (the seed's ``rms_norm_eps``), > 0.
        dropout: dropout on each sublayer output; one mask per output, shared by the
            updates of both streams.
        norm_type: must be "rmsnorm" (SiameseNorm is RMSNorm only).
        backend: "auto" | "triton" | "reference".

    Parameters (state-dict keys): ``attn_x_scale`` [D] (mode "scale") or
    ``attn_x_norm.weight`` (mode "postnorm"); ``attn_y_norm.weight`` (if
    use_attn_y_norm); ``attn_in_norm.weight`` (if normalized_input);
    ``mlp_x_norm.weight``; ``mlp_y_norm.weight``; ``mlp_in_norm.weight`` (if
    normalized_input); plus the wrapped sublayers' own parameters.

    Shapes: ``x``, ``y`` are ``[batch, seq, D]`` (any leading dims), one float dtype;
    each sublayer must return ``h``'s shape and dtype (under autocast its output is
    cast back to the streams' dtype: the streams keep their precision).

    Returns :class:`SiameseStreams` ``(x, y)``, the two updated streams (both are
    outputs: the next layer reads both).

    SiameseNorm owns the residual flow: do not combine it with LAuReL or AttnRes in
    one model. StackMemory may act on the sublayer input ``h`` (wrap ``attention``).

    Example::

        layers = [SiameseNormLayer(512, l, attn_l, mlp_l) for l, (attn_l, mlp_l) in enumerate(blocks)]
        final = SiameseNormFinal(512)
        x, y = siamese_start(embed(tokens))
        for layer in layers:
            x, y = layer(x, y, attn_kwargs={"attention_mask": mask})
        logits = lm_head(final(x, y))
    """

    def __init__(
        self,
        hidden_size: int,
        layer_idx: int,
        attention: Callable[..., torch.Tensor],
        mlp: Callable[..., torch.Tensor],
        normalized_input: bool = True,
        depth_scaling: bool = True,
        attn_x_scale_init: float = 1.0,
        attn_x_mode: str = "scale",
        use_attn_y_norm: bool = True,
        eps: float = 1e-6,
        dropout: float = 0.0,
        norm_type: str = "rmsnorm",
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        self.depth_scale = siamese_depth_constant(layer_idx, bool(depth_scaling))
        check_choice("attn_x_mode", attn_x_mode, ATTN_X_MODES)
        _check_norm_type(norm_type)
        check_backend(backend)
        eps = _check_eps(eps)
        if isinstance(attn_x_scale_init, bool) or not isinstance(attn_x_scale_init, (int, float)) \
                or not math.isfinite(attn_x_scale_init):
            raise ConfigError(f"`attn_x_scale_init` must be a finite float, got {attn_x_scale_init!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ConfigError(f"`dropout` must be a float in [0, 1), got {dropout!r}")
        for name, fn in (("attention", attention), ("mlp", mlp)):
            if not callable(fn):
                raise TypeError(f"`{name}` must be callable (h -> tensor of h's shape), got {type(fn).__name__}")
        self.hidden_size, self.layer_idx, self.eps, self.backend = hidden_size, layer_idx, eps, backend
        self.normalized_input, self.depth_scaling = bool(normalized_input), bool(depth_scaling)
        self.attn_x_mode, self.use_attn_y_norm = attn_x_mode, bool(use_attn_y_norm)

        self.attention = attention
        self.mlp = mlp
        self.dropout = nn.Dropout(float(dropout))
        if attn_x_mode == "scale":
            self.attn_x_scale = nn.Parameter(torch.full((hidden_size,), float(attn_x_scale_init)))
        else:
            self.attn_x_norm = _stream_norm(hidden_size, eps)
        if self.use_attn_y_norm:
            self.attn_y_norm = _stream_norm(hidden_size, eps)
        if self.normalized_input:
            self.attn_in_norm = _stream_norm(hidden_size, eps)
        self.mlp_x_norm = _stream_norm(hidden_size, eps)
        self.mlp_y_norm = _stream_norm(hidden_size, eps)
        if self.normalized_input:
            self.mlp_in_norm = _stream_norm(hidden_size, eps)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, layer_idx={self.layer_idx}, depth_scale={self.depth_scale:.6g}, "
                f"attn_x_mode={self.attn_x_mode!r}, normalized_input={self.normalized_input}, "
                f"use_attn_y_norm={self.use_attn_y_norm}, eps={self.eps}, backend={self.backend!r}")

    def _weight(self, name: str) -> torch.Tensor | None:
        norm = getattr(self, name, None)
        return None if norm is None else norm.weight

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        attn_kwargs: dict | None = None,
        mlp_kwargs: dict | None = None,
    ) -> SiameseStreams:
        """``x``, ``y``: the streams ``[..., D]``; the kwargs go to the sublayer calls
        (e.g. an ``attention_mask``). Returns the new streams, ``SiameseStreams(x, y)``."""
        _check_streams(self, self.hidden_size, x, y)
        c_inv = 1.0 / self.depth_scale
        # attention boundary: u = s ⊙ X (or X ← RMSNorm(X)) + RMSNorm(Y); h = RMSNorm(u)
        x, y, h = _boundary(
            self.backend, x, y,
            x_scale=self.attn_x_scale if self.attn_x_mode == "scale" else None,
            x_norm_weight=self._weight("attn_x_norm"),
            y_norm_weight=self._weight("attn_y_norm"),
            in_norm_weight=self._weight("attn_in_norm"),
            eps=self.eps,
        )
        a = self.dropout(_check_branch("attention", self.attention(h, **(attn_kwargs or {})), h))
        # MLP boundary: X += a/c, Y += a; X ← RMSNorm(X); u = X + RMSNorm(Y); h = RMSNorm(u)
        x, y, h = _boundary(
            self.backend, x, y, a, c_inv,
            x_norm_weight=self.mlp_x_norm.weight,
            y_norm_weight=self.mlp_y_norm.weight,
            in_norm_weight=self._weight("mlp_in_norm"),
            eps=self.eps,
        )
        m = self.dropout(_check_branch("mlp", self.mlp(h, **(mlp_kwargs or {})), h))
        # end of layer: X += m/c, Y += m
        x, y, _ = _boundary(self.backend, x, y, m, c_inv, eps=self.eps, return_h=False)
        return SiameseStreams(x, y)


class SiameseNormFinal(nn.Module):
    """The model-level fusion ``z = RMSNorm_final(RMSNorm_final_x(X) + RMSNorm_final_y(Y))``
    (spec open point 6), replacing the usual final norm before the LM head.

    Parameters: ``final_x_norm.weight``, ``final_y_norm.weight``, ``final_norm.weight``,
    each [D] initialised to 1. ``x``, ``y``: ``[..., D]``; returns ``z`` of that shape.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, norm_type: str = "rmsnorm",
                 backend: Backend = "auto") -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        _check_norm_type(norm_type)
        check_backend(backend)
        self.hidden_size, self.eps, self.backend = hidden_size, _check_eps(eps), backend
        self.final_x_norm = _stream_norm(hidden_size, eps)
        self.final_y_norm = _stream_norm(hidden_size, eps)
        self.final_norm = _stream_norm(hidden_size, eps)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.eps}, backend={self.backend!r}"

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _check_streams(self, self.hidden_size, x, y)
        _, _, z = _boundary(
            self.backend, x, y,
            x_norm_weight=self.final_x_norm.weight,
            y_norm_weight=self.final_y_norm.weight,
            in_norm_weight=self.final_norm.weight,
            eps=self.eps, return_streams=False,
        )
        return z
