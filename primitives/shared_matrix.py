"""Elastic SharedMatrix and Readout: nested tiers of one full-size matrix.

ShellElastic's μ-Elastic supernets (MatFormer and Fully elastic, seed 003) hold
one full-size ``[out_features, in_features]`` matrix per projection; a tier reads
its leading ``[rows, cols]`` block. Split matrices store the frozen
initialisation ``init`` and the trained ``delta`` (Eq. 23 of the paper) and
combine them with the tier's fan-in ratio ``r`` (fan-in of the tier over the base
fan-in)::

    W_τ = r^(-1/2) · init[:rows, :cols] + r^(-1) · delta[:rows, :cols]
    y   = (x · (σ · W_τ)ᵀ) / e

σ is an optional learned scale folded into the weight (the Readout's per-tier
logit scale α), e an optional constant output divisor (the FFN's ``1/e``).
The reference rounds exactly as the seed does: each scalar product, their sum and
the product with σ are rounded to the parameter dtype; the block is then cast to
the activation dtype for the matmul, and the output is rounded before the
division by e.

:class:`ElasticTiers` holds the tier rules (width, FFN width, r and logit-scale
index per matrix and tier); :func:`extract_tier` and :func:`save_subnetwork`
turn one tier of a supernet built from these modules into a dense model.
"""
from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ._backend import Backend, check_backend, resolve_backend
from ._errors import ConfigError, DeviceError, ShapeError
from ._validation import (autocast_active, check_choice, check_has_tokens, check_keep_mask, check_param_dtype,
                          check_positive_int, check_tensor, without_autocast)

__all__ = [
    "MATRICES", "VARIANTS", "ElasticTiers", "SharedMatrix", "Readout",
    "fan_in_multipliers", "shared_matrix_block", "shared_matrix_reference",
    "extract_tier", "save_subnetwork",
]

# Every shared matrix of a ShellElastic model, by its name inside a layer, plus the readout.
MATRICES = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.gate_proj", "attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "lm_head")
VARIANTS = ("fully_elastic", "matformer")
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ----------------------------------------------------------------------------
# Validation shared by the reference, the module and the Triton op
# ----------------------------------------------------------------------------

def check_ratio(ratio: object) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio <= 0:
        raise ConfigError(f"`ratio` (the fan-in ratio r) must be a finite number > 0, got {ratio!r}")
    return float(ratio)


def check_block(rows: object, cols: object, weight: torch.Tensor) -> tuple[int, int]:
    out_features, in_features = weight.shape
    for name, value, limit, what in (("rows", rows, out_features, "out_features"),
                                      ("cols", cols, in_features, "in_features")):
        check_positive_int(name, value)
        if value > limit:
            raise ShapeError(f"`{name}` must be <= {what} = {limit} (the full matrix is "
                             f"{tuple(weight.shape)}), got {value}")
    return int(rows), int(cols)


def check_operands(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None, rows: int, cols: int,
                   ratio: float, scale: torch.Tensor | None, output_divisor: float,
                   attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Everything a call can get wrong, before any arithmetic; returns the bool keep mask."""
    check_tensor("weight", weight, ndim=2, dtypes=PARAM_DTYPES, layout="[out_features, in_features]")
    rows, cols = check_block(rows, cols, weight)
    ratio = check_ratio(ratio)
    if delta is None:
        if ratio != 1.0:
            raise ConfigError(f"an unsplit matrix (no `delta`) has no fan-in multipliers: `ratio` must be 1, "
                              f"got {ratio!r}")
    else:
        check_tensor("delta", delta, shape=tuple(weight.shape), dtypes=(weight.dtype,),
                     layout="the shape and dtype of `init`")
        if delta.device != weight.device:
            raise DeviceError(f"`delta` must be on the device of `init` ({weight.device}), got {delta.device}")
    check_tensor("x", x, dtypes=PARAM_DTYPES, layout="[..., cols]")
    if x.dim() < 1 or x.shape[-1] != cols:
        raise ShapeError(f"`x` must have last dim cols = {cols}, got shape {tuple(x.shape)}")
    if x.device != weight.device:
        raise DeviceError(f"`x` must be on the device of the weight ({weight.device}), got {x.device}")
    if scale is not None:
        check_tensor("scale", scale, dtypes=(weight.dtype,), layout="one element in the weight dtype")
        if scale.numel() != 1:
            raise ShapeError(f"`scale` must have exactly one element, got shape {tuple(scale.shape)}")
        if scale.device != weight.device:
            raise DeviceError(f"`scale` must be on the device of the weight ({weight.device}), got {scale.device}")
    if (isinstance(output_divisor, bool) or not isinstance(output_divisor, (int, float))
            or not math.isfinite(output_divisor) or output_divisor == 0):
        raise ConfigError(f"`output_divisor` must be a finite non-zero number, got {output_divisor!r}")
    if attention_mask is None:
        return None
    if x.dim() != 3:
        raise ShapeError(f"with `attention_mask`, `x` must be [batch, seq, cols], got shape {tuple(x.shape)}")
    keep = check_keep_mask("attention_mask", attention_mask, x.shape[0], x.shape[1])
    if keep.device != x.device:
        raise DeviceError(f"`attention_mask` must be on the device of `x` ({x.device}), got {keep.device}")
    return keep


# ----------------------------------------------------------------------------
# Reference math
# ----------------------------------------------------------------------------

def fan_in_multipliers(ratio: float) -> tuple[float, float]:
    """(a, b) = (r^(-1/2), r^(-1)): the multipliers of ``init`` and ``delta``."""
    return ratio ** -0.5, ratio ** -1.0


def shared_matrix_block(weight: torch.Tensor, delta: torch.Tensor | None, rows: int, cols: int,
                        ratio: float = 1.0, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Tier weight ``σ · (a·init[:rows, :cols] + b·delta[:rows, :cols])`` in the parameter dtype.

    ``weight`` is ``init`` of a split matrix, or the whole matrix when ``delta`` is None
    (then the block is the plain slice). Rounds like the seed: each product and the sum
    in the parameter dtype (for r = 1 this is exactly ``init + delta``).
    Returns a ``[rows, cols]`` tensor (a view when unsplit and unscaled).
    """
    w = weight[:rows, :cols]
    if delta is not None:
        a, b = fan_in_multipliers(ratio)
        w = a * w + b * delta[:rows, :cols]
    if scale is not None:
        w = w * scale.reshape(())
    return w


def shared_matrix_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    delta: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    rows: int,
    cols: int,
    ratio: float = 1.0,
    output_divisor: float = 1.0,
    upcast: bool = False,
) -> torch.Tensor:
    """Reference tier matmul ``y = (x · shared_matrix_block(...)ᵀ) / output_divisor``.

    Args:
        x: ``[..., cols]`` activations (fp32/bf16/fp16/fp64). May differ from the
            parameter dtype (autocast): the block is cast to ``x.dtype`` for the matmul.
        weight: ``[out_features, in_features]``: ``init`` of a split matrix, or the
            whole matrix when ``delta`` is None.
        delta: ``[out_features, in_features]`` or None (unsplit; then ``ratio`` must be 1).
        scale: optional one-element learned scale σ (the Readout's α_k), in the
            parameter dtype, folded into the weight.
        attention_mask: optional ``[batch, seq]`` keep mask for ``x = [batch, seq, cols]``;
            padded rows read as zero (output 0, no gradient contribution), whatever
            they contain.
        rows, cols: the tier's leading block; ratio: its fan-in ratio r > 0.
        output_divisor: e; the output is divided by it (the FFN's ``/ e``).
        upcast: False (default) reproduces the seed's numerics in the given dtypes;
            True computes in fp32 (fp64 stays fp64) and casts back: the ground truth
            for low-precision parity.
    Returns:
        ``[..., rows]`` in ``x.dtype``.
    """
    keep = check_operands(x, weight, delta, rows, cols, ratio, scale, output_divisor, attention_mask)
    out_dtype = x.dtype
    if upcast:
        work = torch.promote_types(x.dtype, torch.float32)
        x = x.to(work)
        weight, delta, scale = (None if t is None else t.to(work) for t in (weight, delta, scale))
    if keep is not None:
        # torch.where, not multiplication: 0 · NaN in a padded row would still be NaN.
        x = torch.where(keep[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))
    w = shared_matrix_block(weight, delta, rows, cols, ratio, scale)
    y = F.linear(x, w.to(x.dtype))
    if output_divisor != 1.0:
        y = y / output_divisor
    return y.to(out_dtype)


# ----------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------

class SharedMatrix(nn.Module):
    """A full-size ``[out_features, in_features]`` matrix whose tiers use its leading block.

    Args:
        out_features, in_features: the full (widest-tier) size.
        split: True stores ``init`` and ``delta`` (Eq. 23); False one ``weight``
            (usable only with ratio 1). State-dict names are the seed's.
        init_trainable: False (default, the paper's frozen initialisation) keeps
            ``init`` as a parameter with ``requires_grad=False``: same state-dict key,
            and no gradient is ever computed for it. True trains it too.
        base_fan_in: None (default) starts every tensor at zero, as the seed does
            (its weights are always loaded). An int draws ``init`` (or the unsplit
            ``weight``) i.i.d. normal with std ``1/sqrt(base_fan_in)``, the fan-in of
            the r = 1 tier, and ``delta`` = 0, so every tier starts at the standard
            ``1/sqrt(fan_in)`` scale (spec open point 1).
        backend: "auto" | "triton" | "reference".

    Shapes: ``forward(x [..., cols], attention_mask=None, *, rows=None, ratio=1.0,
    output_divisor=1.0) -> [..., rows]`` with ``cols = x.shape[-1]``; outputs in ``x``'s
    dtype (under autocast, the autocast dtype: the projection runs as ``F.linear`` would).

    Example::

        q_proj = SharedMatrix(640, 640, split=True)        # Fully elastic, tier s: n = 64·s
        q = q_proj(x[..., :n], rows=n, ratio=s)             # x: [batch, seq, n] -> [batch, seq, n]
    """

    def __init__(self, out_features: int, in_features: int, split: bool = True, *,
                 init_trainable: bool = False, base_fan_in: int | None = None,
                 backend: Backend = "auto", device=None, dtype=None) -> None:
        super().__init__()
        check_positive_int("out_features", out_features)
        check_positive_int("in_features", in_features)
        check_backend(backend)
        if base_fan_in is not None:
            check_positive_int("base_fan_in", base_fan_in)
        self.out_features, self.in_features = out_features, in_features
        self.split, self.init_trainable, self.base_fan_in = bool(split), bool(init_trainable), base_fan_in
        self.backend = backend
        shape, kw = (out_features, in_features), dict(device=device, dtype=dtype)
        if self.split:
            self.init = nn.Parameter(torch.zeros(shape, **kw), requires_grad=self.init_trainable)
            self.delta = nn.Parameter(torch.zeros(shape, **kw))
        else:
            self.weight = nn.Parameter(torch.zeros(shape, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.split:
                self.delta.zero_()
                if self.base_fan_in is None:
                    self.init.zero_()
                else:
                    self.init.normal_(0.0, self.base_fan_in ** -0.5)
            elif self.base_fan_in is None:
                self.weight.zero_()
            else:
                self.weight.normal_(0.0, self.in_features ** -0.5)

    def extra_repr(self) -> str:
        return (f"out_features={self.out_features}, in_features={self.in_features}, split={self.split}, "
                f"init_trainable={self.init_trainable}, backend={self.backend!r}")

    @property
    def full_weight(self) -> torch.Tensor:
        """``init`` (split) or ``weight`` (unsplit): the tensor the tier rule scales by a."""
        return self.init if self.split else self.weight

    def _delta(self) -> torch.Tensor | None:
        return self.delta if self.split else None

    def block(self, rows: int, cols: int, ratio: float = 1.0) -> torch.Tensor:
        """The tier weight ``[rows, cols]`` at fan-in ratio ``ratio`` (the seed's ``block``)."""
        w = self.full_weight
        check_block(rows, cols, w)
        ratio = check_ratio(ratio)
        if not self.split and ratio != 1.0:
            raise ConfigError(f"an unsplit SharedMatrix has no fan-in multipliers: `ratio` must be 1, got {ratio!r}")
        return shared_matrix_block(w, self._delta(), rows, cols, ratio)

    def _linear(self, x: torch.Tensor, rows: int, ratio: float, scale: torch.Tensor | None,
                output_divisor: float, attention_mask: torch.Tensor | None) -> torch.Tensor:
        w = self.full_weight
        if x.dim() == 0:
            raise ShapeError("`x` must be [..., cols], got a 0-dim tensor")
        check_has_tokens("x", x, None)
        check_param_dtype("x", x, w)
        if autocast_active(x.device.type):
            # A projection runs under autocast: the block is combined in the parameter dtype
            # and meets x in the autocast dtype, as F.linear under autocast would do with the
            # seed's block; the op itself then runs with autocast off on those dtypes.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        args = dict(x=x, weight=w, delta=self._delta(), scale=scale, attention_mask=attention_mask,
                    rows=rows, cols=x.shape[-1],
                    ratio=ratio, output_divisor=output_divisor)
        with without_autocast(x.device.type):
            if resolve_backend(self.backend, x, w) == "triton":
                from laminae.triton_ops.shared_matrix import shared_matrix

                return shared_matrix(**args)
            return shared_matrix_reference(**args)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, *, rows: int | None = None,
                ratio: float = 1.0, output_divisor: float = 1.0) -> torch.Tensor:
        """``x [..., cols] -> [..., rows]``: x times the tier block (``rows`` defaults
        to ``out_features``), divided by ``output_divisor``. ``attention_mask``: an
        optional ``[batch, seq]`` keep mask; padded rows give 0 and no gradient."""
        check_tensor("x", x, dtypes=PARAM_DTYPES, layout="[..., cols]")
        return self._linear(x, self.out_features if rows is None else rows, ratio, None,
                            output_divisor, attention_mask)


class Readout(SharedMatrix):
    """The elastic output projection: a ``[vocab_size, width]`` SharedMatrix with
    learned per-tier logit scales α (``logit_scale [num_scales]``, ones at init).

    ``forward(x [..., n], attention_mask=None, *, ratio=1.0, scale_index=0) -> logits
    [..., vocab_size]`` in fp32: ``(x · (α_k · W_τ)ᵀ).float()`` with ``W_τ`` the leading
    ``[vocab_size, n]`` block.
    Fully elastic: one scale per tier (``scale_index`` = tier index, r = s);
    MatFormer: one shared scale (index 0) and an unsplit ``weight`` (r = 1).
    """

    def __init__(self, vocab_size: int, width: int, split: bool = True, num_scales: int = 1, *,
                 init_trainable: bool = False, base_fan_in: int | None = None,
                 backend: Backend = "auto", device=None, dtype=None) -> None:
        check_positive_int("num_scales", num_scales)
        super().__init__(vocab_size, width, split, init_trainable=init_trainable, base_fan_in=base_fan_in,
                         backend=backend, device=device, dtype=dtype)
        self.num_scales = num_scales
        self.logit_scale = nn.Parameter(torch.ones(num_scales, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", num_scales={self.num_scales}"

    def _scale(self, scale_index: int) -> torch.Tensor:
        if isinstance(scale_index, bool) or not isinstance(scale_index, int) or not 0 <= scale_index < self.num_scales:
            raise ConfigError(f"`scale_index` must be an int in [0, {self.num_scales}), got {scale_index!r}")
        return self.logit_scale[scale_index:scale_index + 1]

    def tier_weight(self, width: int, ratio: float = 1.0, scale_index: int = 0) -> torch.Tensor:
        """``α_k · W_τ`` as a dense ``[vocab_size, width]`` tensor (the seed's ``readout_weight``)."""
        return self.block(self.out_features, width, ratio) * self._scale(scale_index).reshape(())

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, *, ratio: float = 1.0,
                scale_index: int = 0) -> torch.Tensor:  # type: ignore[override]
        check_tensor("x", x, dtypes=PARAM_DTYPES, layout="[..., width]")
        return self._linear(x, self.out_features, ratio, self._scale(scale_index), 1.0, attention_mask).float()


# ----------------------------------------------------------------------------
# Tier rules
# ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ElasticTiers:
    """The tier rules of a ShellElastic supernet (seed ``ElasticConfig``'s tier part).

    For tier τ with width entry s: Fully elastic has model width n = s·g
    (``base_width``), FFN width h = s·``mlp_base_width`` and r = s for every
    matrix, one logit scale per tier; MatFormer keeps n = ``hidden_size``,
    h = s·``mlp_base_width``, r = s only for ``mlp.down_proj`` (1 elsewhere) and one
    shared logit scale. Every FFN output is divided by ``mlp_output_divisor``.
    """

    variant: str = "fully_elastic"
    hidden_size: int = 640
    head_dim: int = 64
    base_width: int | None = 64
    mlp_base_width: int = 256
    widths: tuple[int, ...] = (6, 7, 8, 9, 10)
    tiers: tuple[str, ...] = ("low", "medium", "high", "extra", "max")
    mlp_output_divisor: float = 4.0
    split_matrices: tuple[str, ...] = field(default=MATRICES)

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        object.__setattr__(self, "tiers", tuple(str(t) for t in self.tiers))
        object.__setattr__(self, "split_matrices", tuple(str(m) for m in self.split_matrices))
        check_choice("variant", self.variant, VARIANTS)
        if not self.widths or any(b <= a for a, b in zip((0,) + self.widths, self.widths)):
            raise ConfigError(f"`widths` must be positive and strictly increasing, got {list(self.widths)}")
        if len(self.tiers) != len(self.widths) or len(set(self.tiers)) != len(self.tiers):
            raise ConfigError(f"`tiers` must be {len(self.widths)} distinct names (one per width), "
                              f"got {list(self.tiers)}")
        unknown = sorted(set(self.split_matrices) - set(MATRICES))
        if unknown:
            raise ConfigError(f"`split_matrices` has unknown names {unknown}; known: {list(MATRICES)}")
        for name in ("hidden_size", "head_dim", "mlp_base_width"):
            check_positive_int(name, getattr(self, name))
        if not (isinstance(self.mlp_output_divisor, (int, float)) and math.isfinite(self.mlp_output_divisor)
                and self.mlp_output_divisor > 0):
            raise ConfigError(f"`mlp_output_divisor` must be a finite number > 0, got {self.mlp_output_divisor!r}")
        if self.variant == "fully_elastic":
            if sorted(self.split_matrices) != sorted(MATRICES):
                missing = sorted(set(MATRICES) - set(self.split_matrices))
                raise ConfigError(f"a Fully elastic model stores every matrix split; `split_matrices` lacks {missing}")
            if self.base_width is None or self.base_width * self.widths[-1] != self.hidden_size:
                raise ConfigError(f"Fully elastic needs base_width · widths[-1] == hidden_size = {self.hidden_size}, "
                                  f"got base_width={self.base_width}, widths[-1]={self.widths[-1]}")
            if self.base_width % self.head_dim:
                raise ConfigError(f"`head_dim` ({self.head_dim}) must divide `base_width` ({self.base_width}) so "
                                  "every tier has whole heads")
        else:
            if "mlp.down_proj" not in self.split_matrices or "lm_head" in self.split_matrices:
                raise ConfigError("a MatFormer model stores mlp.down_proj split and lm_head whole, got "
                                  f"split_matrices={list(self.split_matrices)}")
            if self.hidden_size % self.head_dim:
                raise ConfigError(f"`head_dim` ({self.head_dim}) must divide `hidden_size` ({self.hidden_size})")

    @classmethod
    def from_seed_config(cls, values: Mapping) -> "ElasticTiers":
        """From the seed's ``ElasticConfig`` keys (other keys are ignored)."""
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items() if k in keys})

    def resolve(self, tier: str | None) -> str:
        """The tier name; None means the widest tier."""
        tier = self.tiers[-1] if tier is None else tier
        if tier not in self.tiers:
            raise ConfigError(f"unknown tier {tier!r}; this model has {list(self.tiers)}")
        return tier

    def index(self, tier: str | None) -> int:
        return self.tiers.index(self.resolve(tier))

    def ratio(self, tier: str | None) -> float:
        return float(self.widths[self.index(tier)])

    def width(self, tier: str | None) -> int:
        if self.variant == "matformer":
            self.resolve(tier)
            return self.hidden_size
        return self.widths[self.index(tier)] * self.base_width

    def num_heads(self, tier: str | None) -> int:
        return self.width(tier) // self.head_dim

    def intermediate_size(self, tier: str | None) -> int:
        return self.widths[self.index(tier)] * self.mlp_base_width

    @property
    def max_intermediate_size(self) -> int:
        return self.widths[-1] * self.mlp_base_width

    @property
    def num_logit_scales(self) -> int:
        return len(self.tiers) if self.variant == "fully_elastic" else 1

    def logit_scale_index(self, tier: str | None) -> int:
        index = self.index(tier)
        return index if self.variant == "fully_elastic" else 0

    def _check_matrix(self, matrix: str) -> None:
        if matrix not in MATRICES:
            raise ConfigError(f"unknown matrix {matrix!r}; known: {list(MATRICES)}")

    def fan_in_ratio(self, matrix: str, tier: str | None) -> float:
        """r of ``matrix`` in ``tier``: the tier's fan-in over the base fan-in."""
        self._check_matrix(matrix)
        if self.variant == "fully_elastic" or matrix == "mlp.down_proj":
            return self.ratio(tier)
        self.resolve(tier)
        return 1.0

    def full_shape(self, matrix: str, vocab_size: int | None = None) -> tuple[int, int]:
        """``(out_features, in_features)`` of the full-size matrix."""
        self._check_matrix(matrix)
        d, h = self.hidden_size, self.max_intermediate_size
        return {"mlp.gate_proj": (h, d), "mlp.up_proj": (h, d), "mlp.down_proj": (d, h),
                "lm_head": (vocab_size, d)}.get(matrix, (d, d))

    def block_shape(self, matrix: str, tier: str | None, vocab_size: int | None = None) -> tuple[int, int]:
        """``(rows, cols)`` of the leading block ``matrix`` uses in ``tier``."""
        self._check_matrix(matrix)
        n, h = self.width(tier), self.intermediate_size(tier)
        return {"mlp.gate_proj": (h, n), "mlp.up_proj": (h, n), "mlp.down_proj": (n, h),
                "lm_head": (vocab_size, n)}.get(matrix, (n, n))

    def output_divisor(self, matrix: str) -> float:
        self._check_matrix(matrix)
        return float(self.mlp_output_divisor) if matrix == "mlp.down_proj" else 1.0

    def shared_matrix(self, matrix: str, *, vocab_size: int | None = None, **kwargs) -> SharedMatrix:
        """A SharedMatrix (Readout for ``lm_head``) of the right size and layout."""
        out_features, in_features = self.full_shape(matrix, vocab_size)
        split = matrix in self.split_matrices
        if matrix == "lm_head":
            if vocab_size is None:
                raise ConfigError("`vocab_size` is needed to build lm_head")
            return Readout(vocab_size, in_features, split, self.num_logit_scales, **kwargs)
        return SharedMatrix(out_features, in_features, split, **kwargs)

    def subnetwork_config(self, tier: str | None, **model: object) -> "OrderedDict[str, object]":
        """Config of the dense model :func:`extract_tier` returns (spec §6). ``model``
        supplies the model-level keys: vocab_size, num_hidden_layers,
        max_position_embeddings, rope_theta, rope_precision, rms_norm_eps, tokenizer."""
        need = ("vocab_size", "num_hidden_layers", "max_position_embeddings", "rope_theta", "rope_precision",
                "rms_norm_eps", "tokenizer")
        missing = [k for k in need if k not in model]
        if missing:
            raise ConfigError(f"subnetwork_config needs the model keys {missing}")
        return OrderedDict(
            architectures=["DenseDecoder"], vocab_size=model["vocab_size"], hidden_size=self.width(tier),
            intermediate_size=self.intermediate_size(tier), num_hidden_layers=model["num_hidden_layers"],
            num_attention_heads=self.num_heads(tier), head_dim=self.head_dim,
            max_position_embeddings=model["max_position_embeddings"], rope_theta=model["rope_theta"],
            rope_precision=model["rope_precision"], rms_norm_eps=model["rms_norm_eps"], hidden_act="silu",
            attention_output_gate="sigmoid", qk_norm="rmsnorm_per_head", tie_word_embeddings=False,
            tokenizer=model["tokenizer"],
        )


# ----------------------------------------------------------------------------
# Dense sub-networks
# ----------------------------------------------------------------------------

def _matrix_kind(module_name: str) -> str:
    for kind in MATRICES:
        if module_name == kind or module_name.endswith("." + kind):
            return kind
    raise ConfigError(f"SharedMatrix at {module_name!r} is not one of the ShellElastic matrices {list(MATRICES)}; "
                      "extract_tier needs the seed's module names")


@torch.no_grad()
def extract_tier(model: nn.Module, tiers: ElasticTiers, tier: str | None) -> "OrderedDict[str, torch.Tensor]":
    """The weights of ``tier`` as a standalone dense model (spec §6).

    ``model`` is a supernet assembled with the seed's module names (``embed_tokens``,
    ``layers.{i}.attn.q_proj`` …, ``norm``, ``lm_head``). Every SharedMatrix becomes
    ``<name>.weight`` = its tier block (``mlp.down_proj`` with ``1/e`` folded in, the
    Readout with α_k folded in); every other 2-D parameter (the embedding) is cut to
    its first n columns and every 1-D parameter (norm gains) to its first n entries.
    Computed in the model's dtype; each tensor detached, cloned and contiguous, in
    the model's registration order.
    """
    tier = tiers.resolve(tier)
    n = tiers.width(tier)
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, SharedMatrix):
            kind = _matrix_kind(name)
            rows, cols = tiers.block_shape(kind, tier, module.out_features)
            ratio = tiers.fan_in_ratio(kind, tier)
            if isinstance(module, Readout):
                w = module.tier_weight(cols, ratio, tiers.logit_scale_index(tier))
            else:
                w = module.block(rows, cols, ratio)
                if kind == "mlp.down_proj":
                    w = w / tiers.mlp_output_divisor
            out[prefix + "weight"] = w
            continue
        for pname, p in module.named_parameters(recurse=False):
            out[prefix + pname] = p[:n] if p.dim() == 1 else p[:, :n]
    return OrderedDict((k, v.detach().clone().contiguous()) for k, v in out.items())


def save_subnetwork(model: nn.Module, tiers: ElasticTiers, tier: str | None, path: str | os.PathLike,
                    model_config: Mapping[str, object]) -> None:
    """Write ``extract_tier(model, tiers, tier)`` to ``path/model.safetensors`` (metadata
    format "pt") and its ``config.json`` (``tiers.subnetwork_config`` plus ``torch_dtype``)."""
    from safetensors.torch import save_file

    state = extract_tier(model, tiers, tier)
    values = tiers.subnetwork_config(tier, **model_config)
    first = next(iter(state.values()))
    values["torch_dtype"] = str(state.get("embed_tokens.weight", first).dtype).replace("torch.", "")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(values, fh, indent=2)
        fh.write("\n")
    save_file(dict(state), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def tier_parameter_count(tiers: ElasticTiers, tier: str | None, *, vocab_size: int, num_layers: int) -> int:
    """Parameters of the dense model of ``tier``: 2·V·n + L·(5n² + 3nh + 4n) + n."""
    n, h = tiers.width(tier), tiers.intermediate_size(tier)
    return 2 * vocab_size * n + num_layers * (5 * n * n + 3 * n * h + 4 * n) + n


__all__ += ["tier_parameter_count"]
