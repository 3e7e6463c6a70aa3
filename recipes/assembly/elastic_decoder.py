"""An elastic decoder: every tier of a ShellElastic supernet from one set of weights.

Each projection is a :class:`~laminae.primitives.shared_matrix.SharedMatrix` (the
readout a :class:`~laminae.primitives.shared_matrix.Readout`); a tier τ of width n
and FFN width h reads the leading blocks, the first n embedding columns and the first
n entries of every norm gain::

    x = embed_tokens[ids][..., :n]
    × num_layers:
        h = RMSNorm(x; attn_norm[:n])
        q, k = RMSNorm_per_head(q_proj(h); q_norm[:n]), …(k_proj(h); k_norm[:n])
        q, k = RoPE(q), RoPE(k)                           rotate-half, optional bf16 tables
        x += o_proj(causal_attention(q, k, v_proj(h)) ⊙ σ(gate_proj(h)))
        h = RMSNorm(x; mlp_norm[:n])
        x += down_proj(SiLU(gate_proj(h)) ⊙ up_proj(h)) / e
    logits = Readout(RMSNorm(x; norm[:n]))               fp32, α_τ-scaled

Module names are the seed's (``layers.{i}.attn.q_proj`` …), so its checkpoints load
as they are and :func:`~laminae.primitives.shared_matrix.extract_tier` finds every
matrix. ``forward(ids, attention_mask=None, cache=None, tier=None) -> LMOutput``;
decoding starts from ``empty_cache(batch)`` and keeps one
:class:`~laminae.primitives.KVCache` per layer inside a
:class:`~laminae.recipes.assembly.decoder.DecoderCache` tied to the tier of its first call.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from laminae.primitives._backend import Backend, check_backend, resolve_backend
from laminae.primitives._errors import ShapeError
from laminae.primitives._validation import (check_choice, check_context, check_has_tokens, check_keep_mask,
                                            check_positive_int, check_tensor)
from laminae.primitives.blocks.gqa import KVCache, sdpa_core
from laminae.primitives.blocks.norms import RMSNorm, rms_norm
from laminae.primitives.blocks.rotary import RotaryEmbedding, apply_rotary
from laminae.primitives.shared_matrix import ElasticTiers, SharedMatrix, extract_tier

from .decoder import DecoderCache, LMOutput, start_decoder_cache

__all__ = ["ROPE_PRECISIONS", "ElasticAttention", "ElasticMLP", "ElasticLayer",
           "ElasticCausalLM"]

ROPE_PRECISIONS = ("bfloat16", "float32")


# rope_precision → the one RoPE's precision options; "bfloat16" rounds the positions, the
# frequencies, their product and the cosine and sine to bf16 (the seed's default,
# whatever the compute dtype)
_ROPE_OPTIONS = {"bfloat16": dict(angle_dtype=torch.bfloat16, table_dtype=torch.bfloat16), "float32": {}}


class _TierLinear:
    """Applies the layer's shared matrices at one tier (rows, fan-in ratio, divisor)."""

    def __init__(self, tiers: ElasticTiers, tier: str) -> None:
        self.tiers, self.tier = tiers, tier

    def __call__(self, kind: str, module: SharedMatrix, x: torch.Tensor) -> torch.Tensor:
        t = self.tiers
        rows, _ = t.block_shape(kind, self.tier)
        return module(x, rows=rows, ratio=t.fan_in_ratio(kind, self.tier), output_divisor=t.output_divisor(kind))


class ElasticAttention(nn.Module):
    """Causal MHA over the tier's heads: per-head QK RMSNorm (fp32 statistics, per-feature
    gains), RoPE, scale ``head_dim^-1/2``, sigmoid output gate. ``x [B, S, n]``."""

    def __init__(self, tiers: ElasticTiers, eps: float, **matrix_kwargs) -> None:
        super().__init__()
        self.head_dim, self.eps = tiers.head_dim, eps
        self.backend = matrix_kwargs.get("backend", "auto")
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "o_proj"):
            self.add_module(name, tiers.shared_matrix(f"attn.{name}", **matrix_kwargs))
        self.q_norm = RMSNorm(tiers.hidden_size, eps)
        self.k_norm = RMSNorm(tiers.hidden_size, eps)

    def forward(self, x: torch.Tensor, linear: _TierLinear, cos: torch.Tensor, sin: torch.Tensor,
                keep: torch.Tensor | None, cache: KVCache | None, signature: tuple, decoding: bool,
                cache_dtype: torch.dtype | None = None):
        B, S, n = x.shape
        shape = (B, S, n // self.head_dim, self.head_dim)
        gate = linear("attn.gate_proj", self.gate_proj, x).view(shape)
        q = rms_norm(linear("attn.q_proj", self.q_proj, x), self.q_norm.weight[:n], self.eps,
                     group_size=self.head_dim).view(shape)
        k = rms_norm(linear("attn.k_proj", self.k_proj, x), self.k_norm.weight[:n], self.eps,
                     group_size=self.head_dim).view(shape)
        v = linear("attn.v_proj", self.v_proj, x).view(shape)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attention_mask = keep
        if decoding:
            # the library's one KV cache (primitives/_cache.py), tied to this tier's signature
            config = {"num_kv_heads": k.shape[2], "head_dim": self.head_dim, "signature": signature}
            if cache is None:
                cache = KVCache._empty(B, config, dtype=cache_dtype or k.dtype, device=k.device)
            cache.check("ElasticAttention", config, k)
            cache = cache.append(k, v, keep)
            k, v, attention_mask = cache.keys.to(q.dtype), cache.values.to(q.dtype), cache.keep
        if resolve_backend(self.backend, q) == "triton":
            from laminae.triton_ops import _flash

            if decoding and S <= _flash.DECODE_MAX_QUERIES and not (torch.is_grad_enabled() and q.requires_grad):
                # a decoding step: keys split over programs (flash-decoding), partials merged;
                # the cache's live rows are read in place from its storage (no copy per step)
                y = _flash.flash_decode(q, k, v, _flash.mask_arg(attention_mask))
            else:
                y = _flash.flash_attention(q, k, v, attention_mask)
        else:
            y = sdpa_core(q, k, v, attention_mask)
        y = y * torch.sigmoid(gate)
        return linear("attn.o_proj", self.o_proj, y.reshape(B, S, n)), cache


class ElasticMLP(nn.Module):
    """SwiGLU over the tier's first h hidden units, output divided by e (``mlp_output_divisor``)."""

    def __init__(self, tiers: ElasticTiers, **matrix_kwargs) -> None:
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj"):
            self.add_module(name, tiers.shared_matrix(f"mlp.{name}", **matrix_kwargs))

    def forward(self, x: torch.Tensor, linear: _TierLinear) -> torch.Tensor:
        up = F.silu(linear("mlp.gate_proj", self.gate_proj, x)) * linear("mlp.up_proj", self.up_proj, x)
        return linear("mlp.down_proj", self.down_proj, up)


class ElasticLayer(nn.Module):
    """Pre-norm layer: ``x += attn(attn_norm(x)); x += mlp(mlp_norm(x))`` at one tier."""

    def __init__(self, tiers: ElasticTiers, eps: float, **matrix_kwargs) -> None:
        super().__init__()
        self.eps = eps
        self.attn_norm = RMSNorm(tiers.hidden_size, eps)
        self.attn = ElasticAttention(tiers, eps, **matrix_kwargs)
        self.mlp_norm = RMSNorm(tiers.hidden_size, eps)
        self.mlp = ElasticMLP(tiers, **matrix_kwargs)

    def forward(self, x, linear, cos, sin, keep, cache, signature, decoding, cache_dtype=None):
        n = x.shape[-1]
        a, cache = self.attn(rms_norm(x, self.attn_norm.weight[:n], self.eps), linear, cos, sin, keep, cache,
                             signature, decoding, cache_dtype)
        x = x + a
        return x + self.mlp(rms_norm(x, self.mlp_norm.weight[:n], self.eps), linear), cache


class ElasticCausalLM(nn.Module):
    """A ShellElastic supernet (MatFormer or Fully elastic, by ``tiers.variant``).

    Args:
        tiers: the tier rules (:class:`~laminae.primitives.shared_matrix.ElasticTiers`).
        vocab_size, num_layers: model size.
        eps: RMSNorm epsilon. rope_theta, rope_precision ("bfloat16" | "float32"): RoPE.
        max_positions: the context; longer inputs (cache included) raise ShapeError.
        init_trainable: train the split matrices' ``init`` too (the seed does).
        base_init: draw every matrix at ``1/sqrt(base fan-in)`` (training from
            scratch); False leaves zeros for a checkpoint to fill.
        backend: "auto" | "triton" | "reference": the shared-matrix products and the
            causal attention (the flash core; a cached step of at most 16 tokens runs
            the split-K decoding kernel over the cache).

    ``forward(input_ids [B, S], attention_mask=None, cache=None, tier=None) -> LMOutput``
    (fp32 ``logits [B, S, V]``, ``hidden [B, S, n]``); ``tier=None`` is the widest;
    ``cache=None`` decodes nothing, decoding starts from ``empty_cache(batch)``.
    ``extract(tier)`` is the tier as a dense state dict (same logits).
    """

    def __init__(self, tiers: ElasticTiers, vocab_size: int, num_layers: int, *, eps: float = 1e-5,
                 rope_theta: float = 10000.0, rope_precision: str = "bfloat16", max_positions: int = 2048,
                 init_trainable: bool = True, base_init: bool = True, backend: Backend = "auto") -> None:
        super().__init__()
        check_positive_int("vocab_size", vocab_size)
        check_positive_int("num_layers", num_layers)
        check_positive_int("max_positions", max_positions)
        check_choice("rope_precision", rope_precision, ROPE_PRECISIONS)
        check_backend(backend)
        self.tiers, self.vocab_size, self.eps = tiers, vocab_size, float(eps)
        self.rope_theta, self.rope_precision, self.max_positions = float(rope_theta), rope_precision, max_positions
        self._backend = backend
        self.embed_tokens = nn.Embedding(vocab_size, tiers.hidden_size)
        self.layers = nn.ModuleList(ElasticLayer(tiers, self.eps, init_trainable=init_trainable, backend=backend)
                                    for _ in range(num_layers))
        self.norm = RMSNorm(tiers.hidden_size, self.eps)
        self.rotary = RotaryEmbedding(tiers.head_dim, self.rope_theta, **_ROPE_OPTIONS[rope_precision])
        self.lm_head = tiers.shared_matrix("lm_head", vocab_size=vocab_size, init_trainable=init_trainable,
                                           backend=backend)
        if base_init:
            self._init_base_fan_in()

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        check_backend(value)
        self._backend = value
        for m in self.modules():
            if isinstance(m, (SharedMatrix, ElasticAttention)):
                m.backend = value

    @torch.no_grad()
    def _init_base_fan_in(self) -> None:
        # every tier then starts at the usual 1/sqrt(fan-in) scale (spec open point 1)
        nn.init.normal_(self.embed_tokens.weight, std=1.0)
        smallest = self.tiers.tiers[0]
        for name, m in self.named_modules():
            if isinstance(m, SharedMatrix):
                kind = name if name == "lm_head" else name.split(".", 2)[2]
                cols = self.tiers.block_shape(kind, smallest, self.vocab_size)[1]
                m.base_fan_in = max(1, round(cols / self.tiers.fan_in_ratio(kind, smallest)))
                m.reset_parameters()

    def signature(self, tier: str) -> tuple:
        return ("elastic", tier, len(self.layers), self.tiers.hidden_size)

    def _check(self, input_ids, attention_mask, cache, tier) -> tuple[str, int]:
        check_tensor("input_ids", input_ids, ndim=2, dtypes=(torch.int64, torch.int32), layout="(batch, seq)")
        check_has_tokens("input_ids", input_ids)
        check_keep_mask("attention_mask", attention_mask, *input_ids.shape)
        tier = self.tiers.resolve(tier)
        past = 0
        if cache is not None:
            if not isinstance(cache, DecoderCache):
                raise TypeError("`cache` must be a DecoderCache (from empty_cache) or None, "
                                f"got {type(cache).__name__}")
            cache.check(self.signature(tier), input_ids)
            past = cache.length
        check_context("input_ids", past, input_ids.shape[1], self.max_positions)
        return tier, past

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> DecoderCache:
        """An empty :class:`~laminae.recipes.assembly.decoder.DecoderCache` for ``batch``
        sequences on ``device`` (default: the parameters'); the first call ties it to its
        tier and starts each layer's KV cache in ``dtype`` (default None: the keys')."""
        return start_decoder_cache(self, batch, dtype, device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: DecoderCache | None = None, tier: str | None = None) -> LMOutput:
        tier, past = self._check(input_ids, attention_mask, cache, tier)
        n, S = self.tiers.width(tier), input_ids.shape[1]
        keep = None if attention_mask is None else attention_mask.bool()
        x = self.embed_tokens(input_ids)[..., :n]
        cos, sin = self.rotary.cos_sin(torch.arange(past, past + S, device=input_ids.device)[None])
        linear, sig = _TierLinear(self.tiers, tier), self.signature(tier)
        slots = cache.slots if cache is not None and cache.slots else (None,) * len(self.layers)
        new_slots = []
        for layer, slot in zip(self.layers, slots):
            x, slot = layer(x, linear, cos, sin, keep, slot, sig, cache is not None,
                            cache.dtype if cache is not None else None)
            new_slots.append(slot)
        h = rms_norm(x, self.norm.weight[:n], self.eps)
        logits = self.lm_head(h, ratio=self.tiers.fan_in_ratio("lm_head", tier),
                              scale_index=self.tiers.logit_scale_index(tier))
        new_cache = cache.advanced(S, new_slots, None, sig, input_ids) if cache is not None else None
        return LMOutput(logits, h, logits.new_zeros(()), new_cache, None)

    def extract(self, tier: str | None = None) -> "OrderedDict[str, torch.Tensor]":
        """The weights of ``tier`` as a dense decoder's state dict (``.weight`` names)."""
        return extract_tier(self, self.tiers, tier)
