"""A decoder stack whose layers own their residual flow: SiameseNorm's two streams, or
one pre-norm stream with optional LAuReL residual weights, and StackMemory on the
attention-branch input.

    ids → token embedding (nn.Embedding or a generator such as Leviathan)
        → [Spelling Bee]                                   e = bee(ids, token_embeddings=e)
    two streams:  X = Y = e;  (X, Y) ← SiameseNormLayer(X, Y)   per layer;  z = SiameseNormFinal(X, Y)
    one stream:   x = e;      x ← PreNormLayer(x)                per layer;  z = norm(x)

Each layer's attention is an :class:`AttentionSublayer` (``h → ×input_scale →
[StackMemory] → GQA``); its MLP a :class:`ScaledSublayer` (``h → ×input_scale → MLP``).
``input_scale`` is LayerNorm Scaling's 1/√(ℓ+1) (or 1). The StackMemory state (depth
mode: per token, carried from layer to layer) and the KV caches travel in a
:class:`FlowContext` built per call, so no module keeps per-call state.

Decoding: ``cache = model.empty_cache(batch)``, then ``forward(ids, cache=cache)``
returns a new cache (one KV cache per layer, each never mutated in place), so two
continuations of one cache are both right.
Depth-mode StackMemory mixes nothing across positions, so it needs no decoding state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from laminae.primitives._errors import ConfigError, ShapeError
from laminae.primitives._validation import check_positive_int
from laminae.primitives.blocks.gqa import GroupedQueryAttention
from laminae.primitives.siamese_norm import SiameseNormFinal, SiameseNormLayer, siamese_start
from laminae.primitives.stack_memory import StackMemory, StackMemoryState

from .decoder import DecoderCache, DecoderOutput, check_decoder_call, start_decoder_cache

__all__ = ["FlowContext", "AttentionSublayer", "ScaledSublayer", "PreNormLayer", "StreamDecoderModel"]


@dataclass
class FlowContext:
    """Per-call state read and written by the sublayers: positions ``[1, S]``, the
    ``(B, S)`` keep mask, the KV caches in/out by layer, the StackMemory state."""

    positions: torch.Tensor
    attention_mask: torch.Tensor | None
    decoding: bool
    caches_in: tuple
    caches_out: list = field(default_factory=list)
    stack_state: StackMemoryState | None = None
    cache_dtype: torch.dtype | None = None         # the layers' caches start in it (None: their own)


class AttentionSublayer(nn.Module):
    """Attention branch of one layer: ``h → h·input_scale → [stack(h)] → attention``.

    Args:
        attention: a :class:`GroupedQueryAttention`.
        layer_idx: slot of this layer's KV cache.
        stack: optional depth-mode :class:`StackMemory` augmenting the branch input.
        input_scale: multiplies the normalised input (LayerNorm Scaling), 1 = off.

    ``forward(h [B, S, D], ctx) -> [B, S, D]`` in ``h``'s dtype (under autocast the
    projections compute in the autocast dtype; the streams keep theirs).
    """

    def __init__(self, attention: GroupedQueryAttention, layer_idx: int, stack: StackMemory | None = None,
                 input_scale: float = 1.0) -> None:
        super().__init__()
        if stack is not None and stack.mode != "depth":
            raise ConfigError(f"`stack` must be a depth-mode StackMemory, got mode={stack.mode!r}")
        self.attention, self.stack = attention, stack
        self.layer_idx, self.input_scale = layer_idx, float(input_scale)

    def forward(self, h: torch.Tensor, ctx: FlowContext) -> torch.Tensor:
        inp = h * self.input_scale if self.input_scale != 1.0 else h
        if self.stack is not None:
            inp, _, ctx.stack_state = self.stack(inp, ctx.attention_mask, state=ctx.stack_state)
        # decoding starts from the block's empty cache (its core's own kind: LUCID keeps v')
        cache = ctx.caches_in[self.layer_idx] if ctx.decoding else None
        if ctx.decoding and cache is None:
            cache = self.attention.empty_cache(h.shape[0], dtype=ctx.cache_dtype, device=h.device)
        out, cache, _ = self.attention(inp, ctx.attention_mask, cache, position_ids=ctx.positions)
        ctx.caches_out[self.layer_idx] = cache if ctx.decoding else None
        return out.to(h.dtype)


class ScaledSublayer(nn.Module):
    """``h → module(h·input_scale)`` cast back to ``h``'s dtype (the MLP branch)."""

    def __init__(self, module: nn.Module, input_scale: float = 1.0) -> None:
        super().__init__()
        self.module, self.input_scale = module, float(input_scale)

    def forward(self, h: torch.Tensor, ctx: FlowContext | None = None) -> torch.Tensor:
        return self.module(h * self.input_scale if self.input_scale != 1.0 else h).to(h.dtype)


class PreNormLayer(nn.Module):
    """One pre-norm layer, ``x += attn(attn_norm(x)); x += mlp(mlp_norm(x))``, or with
    LAuReL modules ``x = laurel(x, sublayer_output=f)`` for each sublayer (the seed applies LAuReL to
    both). ``attn_norm`` may be ``nn.Identity`` (no input norm at layer 0).

    ``forward(x [B, S, D], attn_kwargs, mlp_kwargs) -> x``."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, attn_norm: nn.Module, mlp_norm: nn.Module,
                 attn_laurel: nn.Module | None = None, mlp_laurel: nn.Module | None = None,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.attention, self.mlp, self.attn_norm, self.mlp_norm = attention, mlp, attn_norm, mlp_norm
        self.attn_laurel, self.mlp_laurel = attn_laurel, mlp_laurel
        self.dropout = float(dropout)

    def _residual(self, laurel, f, x):
        f = F.dropout(f, self.dropout, self.training)
        return laurel(x, sublayer_output=f) if laurel is not None else x + f

    def forward(self, x: torch.Tensor, attn_kwargs: dict | None = None, mlp_kwargs: dict | None = None):
        x = self._residual(self.attn_laurel, self.attention(self.attn_norm(x), **(attn_kwargs or {})), x)
        return self._residual(self.mlp_laurel, self.mlp(self.mlp_norm(x), **(mlp_kwargs or {})), x)


class StreamDecoderModel(nn.Module):
    """Embedding → [Spelling Bee] → layers (two streams or one) → final fusion/norm.

    Args:
        token_embed: ``(name, module)``: ``nn.Embedding`` (called ``module(ids)``) or a
            generator with ``forward(ids, attention_mask)`` (e.g. ``("token_generator",
            LeviathanGenerator(...))``); padded ids never reach it.
        layers: :class:`SiameseNormLayer` (all) or :class:`PreNormLayer` (all), each
            built around an :class:`AttentionSublayer` and a :class:`ScaledSublayer`.
        final: :class:`SiameseNormFinal` for two streams, a norm for one.
        hidden_size: D.
        spelling_bee: optional ``SpellingBeeEmbedding`` applied to the embeddings.
        max_positions: the context (cached + new tokens); longer inputs raise ShapeError
            before any layer runs (None: no limit).

    ``forward(input_ids [B, S], attention_mask=None, cache=None) -> DecoderOutput``
    (``cache=None`` decodes nothing; decoding starts from ``empty_cache(batch)``);
    ``aux_loss`` is the StackMemory entropy term λ·mean H (0 without StackMemory).
    """

    def __init__(self, token_embed: tuple[str, nn.Module], layers, final: nn.Module, hidden_size: int,
                 spelling_bee: nn.Module | None = None, max_positions: int | None = None) -> None:
        super().__init__()
        if max_positions is not None:
            check_positive_int("max_positions", max_positions)
        self.max_positions = max_positions
        self.embed_name = token_embed[0]
        self.add_module(*token_embed)
        if spelling_bee is not None:
            self.spelling_bee = spelling_bee
        self.layers = nn.ModuleList(layers)
        kinds = {type(layer) for layer in self.layers}
        if len(kinds) != 1 or not kinds <= {SiameseNormLayer, PreNormLayer}:
            raise ConfigError("`layers` must be all SiameseNormLayer or all PreNormLayer, "
                              f"got {sorted(k.__name__ for k in kinds)}")
        self.two_streams = kinds == {SiameseNormLayer}
        if self.two_streams != isinstance(final, SiameseNormFinal):
            raise ConfigError("`final` must be a SiameseNormFinal exactly when the layers are SiameseNormLayer")
        self.final, self.hidden_size = final, hidden_size
        self.stacks = [layer.attention.stack for layer in self.layers if layer.attention.stack is not None]

    @property
    def signature(self) -> tuple:
        return ("stream_decoder", len(self.layers), self.hidden_size, self.two_streams)

    def _check(self, input_ids, attention_mask, cache) -> None:
        check_decoder_call(self, input_ids, attention_mask, cache, next(self.parameters()))

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> DecoderCache:
        """An empty :class:`~laminae.recipes.assembly.decoder.DecoderCache` for ``batch``
        sequences on ``device`` (default: the parameters'); each layer's attention cache
        starts on the first call from its own ``empty_cache``, in ``dtype`` (default
        None: the attention's own default)."""
        return start_decoder_cache(self, batch, dtype, device, self.signature)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        keep = None if attention_mask is None else attention_mask.bool()
        ids = input_ids if keep is None else torch.where(keep, input_ids, torch.zeros_like(input_ids))
        embed = getattr(self, self.embed_name)
        x = embed(ids) if isinstance(embed, nn.Embedding) else embed(ids, attention_mask)
        if hasattr(self, "spelling_bee"):
            x = self.spelling_bee(ids, token_embeddings=x)
        return x

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: DecoderCache | None = None) -> DecoderOutput:
        self._check(input_ids, attention_mask, cache)
        S = input_ids.shape[1]
        past = cache.length if cache is not None else 0
        positions = torch.arange(past, past + S, device=input_ids.device).unsqueeze(0)
        n = len(self.layers)
        ctx = FlowContext(positions, attention_mask, cache is not None,
                          cache.slots if cache is not None and cache.slots else (None,) * n, [None] * n,
                          cache_dtype=cache.dtype if cache is not None else None)
        x = self.embed(input_ids, attention_mask)
        kwargs = {"ctx": ctx}
        if self.two_streams:
            xs, ys = siamese_start(x)
            for layer in self.layers:
                xs, ys = layer(xs, ys, attn_kwargs=kwargs, mlp_kwargs=kwargs)
            z = self.final(xs, ys)
        else:
            for layer in self.layers:
                x = layer(x, attn_kwargs=kwargs, mlp_kwargs=kwargs)
            z = self.final(x)
        aux = z.new_zeros((), dtype=torch.float32)
        if ctx.stack_state is not None:
            aux = self.stacks[0].aux_loss(ctx.stack_state)
        new_cache = (cache.advanced(S, ctx.caches_out, None, self.signature, input_ids) if cache is not None
                     else None)
        return DecoderOutput(z, new_cache, aux, None)
