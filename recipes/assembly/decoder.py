"""Generic decoder containers: a residual block of parallel, pre-normed branches, a
decoder stack that runs its layers along a plan (looped stacks) with one cache, and a
causal LM around it. Recipes wire primitives into these; they define no module.

``ResidualBlock`` — one layer as a list of *stages*; each stage is a list of
:class:`Branch` (norm → module → optional ``tanh(gate)``) whose outputs are summed and
added to the residual stream::

    Llama:       [[attn]], [[mlp]]                       x += attn(n1(x)); x += mlp(n2(x))
    Naylis:      [[attn]], [[mom]], [[mlp]]
    SpikeWhale:  [[attn, mc (tanh-gated)]], [[ffn]]      + hyper-connections, value
                                                           embedding, Engram fusion

With hyper-connections the stream is ``[B, M, S, H]`` and each stage reads
``hc.pre(streams)`` and writes ``hc.post(streams, out)``. An *injection*
(``h += tanh(gate)·shared[key]``, SpikeWhale's value embedding) is added to the first
stage's input; without hyper-connections it therefore stays in the stream. A *post*
module (Engram fusion) maps the stream after the last stage.

A branch module is called by its parameter names (read once, at construction): the
activation, then whichever of ``attention_mask``, ``cache``, ``position_ids``,
``depth_sources`` and the ``shared`` tensors (a memory bank as ``M_blocks=``, Engram's
read as ``ngram=``) its forward takes; its NamedTuple result is read by field name
(``output``, ``cache``, and the aux losses, MaxVio and depth entries the decoder
collects). A :class:`Branch` can carry its own ``call`` for unusual wiring, and a type
whose wiring its names cannot say registers one in :data:`BRANCH_CALLS`.

``DecoderModel`` — ``embed_tokens`` → optional input stage (Engram) → layers along a
``plan`` of (layer, pass) pairs (see :func:`layer_plan`; a new pass adds
``loop_pass_embed[pass]``) → optional stream mix → optional refiner (HRM) → ``norm``.

Decoding: ``cache = model.empty_cache(batch)``, then ``out = model(ids, cache=cache)``
and ``cache = out.cache`` for the prefill and every step; each call returns a new cache
and the one passed in is left as it was (every block state returns a fresh object), so two different
next steps from one cache are both right.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from laminae.primitives._cache import DecodingCache
from laminae.primitives._errors import ConfigError, DeviceError, DTypeError, ShapeError
from laminae.primitives._validation import (FLOAT_DTYPES, check_context, check_has_tokens, check_keep_mask,
                                            check_positive_int, check_same_device, check_tensor)
from laminae.primitives.blocks.hyper_connections import HCOutputMix, HyperConnection, expand_streams

__all__ = ["BlockContext", "Branch", "BRANCH_CALLS", "ResidualBlock", "layer_plan", "DecoderCache",
           "DecoderOutput", "DecoderModel", "CausalLM", "LMOutput"]


@dataclass
class BlockContext:
    """What every branch of one forward may read: positions ``[B|1, S]``, the
    ``(B, S)`` keep mask of this call's tokens, model-level tensors (``shared``:
    a memory bank, the token embedding, the n-gram read, …), the depth-attention
    sources of this pass, and a list collecting aux losses."""

    positions: torch.Tensor
    attention_mask: torch.Tensor | None = None
    shared: dict[str, Any] = field(default_factory=dict)
    depth_sources: list = field(default_factory=list)
    aux_losses: list = field(default_factory=list)
    decoding: bool = False
    metrics: dict = field(default_factory=dict)      # monitoring values a branch reports (detached)
    cache_dtype: torch.dtype | None = None           # the branches' caches start in it (None: their own)


BranchCall = Callable[[nn.Module, torch.Tensor, BlockContext, Any], tuple[torch.Tensor, Any]]

# Calls for module types whose wiring their parameter names cannot say; empty here
# (SHRAM's HybridAttention registers one: its positions come from its mask).
BRANCH_CALLS: dict[type, BranchCall] = {}


def _on_streams(value: Any, h: torch.Tensor) -> Any:
    """A model-level tensor read by a module on hyper-connection streams ``[B, M, S, H]``
    is shared by every stream."""
    if torch.is_tensor(value) and h.dim() == 4 and value.dim() == 3 and value.shape[-1] == h.shape[-1]:
        return value.unsqueeze(1).expand(-1, h.shape[1], *value.shape[1:])
    return value


class _NamedCall:
    """How :class:`ResidualBlock` calls one branch module, read once from its forward's
    parameters: the activation first, then by name ``attention_mask``, ``cache`` (the
    branch's own from the previous call, or the one :class:`ResidualBlock` started from
    its ``empty_cache`` on the first decoding call; None in training), ``position_ids``,
    ``depth_sources`` and any ``ctx.shared`` entry of the same name (``M_blocks``,
    ``ngram``, ...). A NamedTuple result is read by field name: ``output``, ``cache``,
    and the extras the decoder collects (``aux_loss``/``load_balance_loss`` into the aux
    losses, ``max_vio`` into the metrics as the max over layers, ``depth_entry`` into
    the depth sources)."""

    CONTEXT = ("attention_mask", "cache", "position_ids", "depth_sources")

    def __init__(self, module: nn.Module) -> None:
        params = list(inspect.signature(module.forward).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise ConfigError(f"branch {type(module).__name__}: its forward must take the activation first, got "
                              f"forward{inspect.signature(module.forward)}")
        self.names = [p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self.required = {p.name for p in params[1:] if p.default is p.empty
                         and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def __call__(self, module: nn.Module, h: torch.Tensor, ctx: BlockContext, state: Any):
        kwargs = {}
        for name in self.names:
            if name == "attention_mask":
                kwargs[name] = ctx.attention_mask
            elif name == "cache":
                kwargs[name] = state if ctx.decoding else None
            elif name == "position_ids":
                kwargs[name] = ctx.positions
            elif name == "depth_sources":
                kwargs[name] = ctx.depth_sources
            elif name in ctx.shared:
                kwargs[name] = _on_streams(ctx.shared[name], h)
            elif name in self.required:
                raise ConfigError(f"branch {type(module).__name__} needs `{name}`: pass it in the decoder's "
                                  f"`shared` (given: {sorted(ctx.shared)})")
        out = module(h, **kwargs)
        if torch.is_tensor(out):
            return out, None
        fields = getattr(out, "_fields", None)
        if fields is None or fields[0] != "output":
            raise ConfigError(f"branch {type(module).__name__} returned {type(out).__name__}: a tensor or a "
                              "NamedTuple whose first field is `output`")
        extras = dict(zip(fields, out))
        for name in ("aux_loss", "load_balance_loss"):
            if extras.get(name) is not None:
                ctx.aux_losses.append(extras[name])
        if extras.get("max_vio") is not None:
            prev = ctx.metrics.get("max_vio")
            ctx.metrics["max_vio"] = extras["max_vio"] if prev is None else torch.maximum(prev, extras["max_vio"])
        if extras.get("depth_entry") is not None:
            ctx.depth_sources.append(extras["depth_entry"])
        return out.output, (extras.get("cache") if ctx.decoding else None)


def _decodes(module: nn.Module, call: BranchCall) -> bool:
    """Whether a branch keeps a decoding cache: its forward takes ``cache`` (a call by
    name), or it has an ``empty_cache`` (a registered or own call)."""
    return "cache" in call.names if isinstance(call, _NamedCall) else hasattr(module, "empty_cache")


def _branch_call(module: nn.Module, call: BranchCall | None = None) -> BranchCall:
    """A branch's own ``call``, else a registered one for its type, else by its parameter names."""
    return call or next((fn for cls, fn in BRANCH_CALLS.items() if isinstance(module, cls)), None) \
        or _NamedCall(module)


@dataclass
class Branch:
    """One pre-normed branch of a stage: registered on the block as ``name`` (the
    module), ``norm_name`` (default ``f"{name}_norm"``) and, with ``gate``, a zero-init
    scalar ``f"{name}_gate"`` applied as ``tanh(gate)·out``."""

    name: str
    module: nn.Module
    norm: nn.Module | None = None
    norm_name: str | None = None
    gate: bool = False
    call: BranchCall | None = None


class ResidualBlock(nn.Module):
    """A decoder layer made of residual stages of parallel branches (see module doc).

    Args:
        stages: list of stages, each a list of :class:`Branch`.
        hyper_connections: names of one :class:`HyperConnection` per stage (e.g.
            ``["hc_attn", "hc_ffn"]``); None = plain residual.
        hc_mult: number of streams with hyper-connections.
        injection: ``(gate_name, shared_key)``: ``h += tanh(gate)·ctx.shared[key]`` at
            the first stage's input (zero-init gate).
        post: ``(name, module)`` applied to the stream after the last stage.
        dropout: on every branch output in training (the seed's hidden dropout).

    ``forward(x, ctx, state=None) -> (x, state)``; ``x`` ``[B, S, H]`` or
    ``[B, M, S, H]``; ``state`` maps branch names to their decoding states.
    """

    def __init__(self, stages: Sequence[Sequence[Branch]], *, hyper_connections: Sequence[str] | None = None,
                 hc_mult: int = 1, injection: tuple[str, str] | None = None,
                 post: tuple[str, nn.Module] | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        if not stages or any(not stage for stage in stages):
            raise ConfigError("`stages` must be a non-empty list of non-empty branch lists")
        if hyper_connections is not None and len(hyper_connections) != len(stages):
            raise ConfigError(f"`hyper_connections` names one per stage ({len(stages)}), got {len(hyper_connections)}")
        self.stages = [[b.name for b in stage] for stage in stages]
        self._norm_names, self._gated, self._calls, self._decoding = {}, set(), {}, set()
        for stage in stages:
            for b in stage:
                self.add_module(b.name, b.module)
                if b.norm is not None:
                    self._norm_names[b.name] = b.norm_name or f"{b.name}_norm"
                    self.add_module(self._norm_names[b.name], b.norm)
                if b.gate:
                    self.register_parameter(f"{b.name}_gate", nn.Parameter(torch.zeros(1)))
                    self._gated.add(b.name)
                self._calls[b.name] = _branch_call(b.module, b.call)
                if _decodes(b.module, self._calls[b.name]):
                    self._decoding.add(b.name)
        self.hc_names = list(hyper_connections) if hyper_connections else None
        for name in self.hc_names or ():
            self.add_module(name, HyperConnection(hc_mult))
        self.injection = injection
        if injection is not None:
            self.register_parameter(injection[0], nn.Parameter(torch.zeros(1)))
        self.post_name = None
        if post is not None:
            self.post_name = post[0]
            self.add_module(post[0], post[1])
            self._calls[post[0]] = _branch_call(post[1])
        self.dropout = float(dropout)

    def forward(self, x: torch.Tensor, ctx: BlockContext, state: dict | None = None) -> tuple[torch.Tensor, dict]:
        state = state or {}
        new_state = {}
        for si, names in enumerate(self.stages):
            hc = getattr(self, self.hc_names[si]) if self.hc_names else None
            h = hc.pre(x) if hc is not None else x
            if si == 0 and self.injection is not None and self.injection[1] in ctx.shared:
                h = h + torch.tanh(getattr(self, self.injection[0])) * ctx.shared[self.injection[1]]
            out = None
            for name in names:
                inp = getattr(self, self._norm_names[name])(h) if name in self._norm_names else h
                module, branch_state = getattr(self, name), state.get(name)
                if ctx.decoding and branch_state is None and name in self._decoding:
                    # the first decoding call starts the branch's own cache
                    branch_state = module.empty_cache(inp.shape[0], dtype=ctx.cache_dtype, device=inp.device)
                y, new_state[name] = self._calls[name](module, inp, ctx, branch_state)
                y = F.dropout(y, p=self.dropout, training=self.training)
                if name in self._gated:
                    y = torch.tanh(getattr(self, f"{name}_gate")) * y
                out = y if out is None else out + y
            x = hc.post(x, out) if hc is not None else h + out
        if self.post_name is not None:
            x, _ = self._calls[self.post_name](getattr(self, self.post_name), x, ctx, None)
        return x, new_state


def layer_plan(num_layers: int, loop_count: int = 1, mode: str = "full",
               middle_layers: int | None = None) -> list[tuple[int, int | None]]:
    """Execution order of a (looped) stack as (layer, pass) pairs; pass is None outside
    a looped region. "full": the whole stack ``loop_count`` times; "middle_split": a
    prefix once, the middle ``middle_layers`` (default half) ``loop_count`` times, the
    suffix once. The list position is the layer call's cache slot."""
    if loop_count <= 1 or mode == "full":
        n = max(1, loop_count)
        return [(layer, p if n > 1 else None) for p in range(n) for layer in range(num_layers)]
    if mode != "middle_split":
        raise ConfigError(f"`loop_mode` must be 'full' or 'middle_split', got {mode!r}")
    width = middle_layers if middle_layers is not None else num_layers // 2
    if width <= 0 or num_layers % width:
        raise ConfigError(f"`loop_middle_layers`={width} must be positive and divide num_layers={num_layers}")
    start = (num_layers - width) // 2
    end = start + width
    return ([(layer, None) for layer in range(start)]
            + [(layer, p) for p in range(loop_count) for layer in range(start, end)]
            + [(layer, None) for layer in range(end, num_layers)])


@dataclass(eq=False)
class DecoderCache(DecodingCache):
    """Decoding state of a decoder model (:class:`DecoderModel`, :class:`CausalLM`, the
    stream and elastic decoders): tokens seen, one cache per plan slot (each block's own
    protocol cache, started from its ``empty_cache`` on the first call), the input
    stage's cache, and where the layers' caches live. Start one with the model's
    ``empty_cache(batch)``; this class is public as a type (``isinstance``,
    annotations), not as a way to start decoding. Pass back what the model returns (a
    new object: the one passed in is unchanged). ``reset()`` empties it for a new
    generation.

    ``batch`` and ``device`` are those of the calls it continues; ``dtype`` is the
    dtype its layers' caches start in, None (the default) letting each layer pick its
    own (its parameters', or autocast's where its ``empty_cache`` says so)."""

    length: int = 0
    slots: tuple | None = None
    input_state: Any = None
    signature: tuple | None = None
    batch: int | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None

    @property
    def config(self) -> dict:
        return {"signature": self.signature}

    def reset(self) -> None:
        self.length, self.slots, self.input_state, self.signature = 0, None, None, None

    def check(self, signature: tuple, input_ids: torch.Tensor) -> None:
        """Named errors unless this cache continues a call of this model (``signature``)
        on ``input_ids``' batch and device."""
        if self.signature is not None and self.signature != signature:
            raise ConfigError(f"`cache` belongs to {self.signature}, this call is {signature}")
        if self.batch is not None and self.batch != input_ids.shape[0]:
            raise ShapeError(f"`cache` holds batch size {self.batch}, this call has batch size {input_ids.shape[0]}")
        if self.device is not None and self.device != input_ids.device:
            raise DeviceError(f"`cache` is on {self.device}, this call's input_ids are on {input_ids.device}")

    def advanced(self, tokens: int, slots: Sequence, input_state: Any, signature: tuple,
                 input_ids: torch.Tensor) -> "DecoderCache":
        """The cache after a call of ``tokens`` more tokens (a new object)."""
        return replace(self, length=self.length + tokens, slots=tuple(slots), input_state=input_state,
                       signature=signature, batch=input_ids.shape[0], device=input_ids.device)


def check_decoder_call(model, input_ids, attention_mask, cache, weight: torch.Tensor) -> None:
    """The checks every decoder model makes before a call: token ids, keep mask, device
    (against ``weight``), a cache of this model's ``signature``, the context length."""
    check_tensor("input_ids", input_ids, ndim=2, dtypes=(torch.int64, torch.int32), layout="(batch, seq)")
    check_has_tokens("input_ids", input_ids)
    check_keep_mask("attention_mask", attention_mask, *input_ids.shape)
    check_same_device(input_ids=input_ids, attention_mask=attention_mask, weight=weight)
    if cache is not None:
        if not isinstance(cache, DecoderCache):
            raise TypeError(f"`cache` must be a DecoderCache (from empty_cache) or None, got {type(cache).__name__}")
        cache.check(model.signature, input_ids)
    check_context("input_ids", cache.length if cache is not None else 0, input_ids.shape[1], model.max_positions)


def start_decoder_cache(model: nn.Module, batch: int, dtype: torch.dtype | None,
                        device: torch.device | str | None, signature: tuple | None = None) -> DecoderCache:
    """The empty :class:`DecoderCache` of ``model.empty_cache(batch, dtype=, device=)``:
    on ``device`` (default: the model's parameters'); the layers' caches start on the
    first call, from their own ``empty_cache`` in ``dtype`` (None: each layer's own)."""
    check_positive_int("batch", batch)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise DTypeError(f"`dtype` of a DecoderCache must be a float dtype or None, got {dtype}")
    param = next(model.parameters(), None)
    device = torch.device(device if device is not None else "cpu" if param is None else param.device)
    return DecoderCache(signature=signature, batch=batch, dtype=dtype, device=device)


class DecoderOutput(NamedTuple):
    hidden: torch.Tensor                 # [B, S, H] after the final norm
    cache: DecoderCache | None
    aux_loss: torch.Tensor               # summed aux losses (normalised by plan length / layers)
    refine_states: list | None           # normed intermediate refiner states (deep supervision)
    metrics: dict | None = None          # what branches reported in ctx.metrics (e.g. MoSRAH's MaxVio)


class DecoderModel(nn.Module):
    """Decoder stack: embedding → [input stage] → layers along ``plan`` → [stream mix]
    → [refiner] → norm.

    Args:
        embed_tokens: ``nn.Embedding(V, H)``.
        layers: the distinct layers (:class:`ResidualBlock`).
        norm: final norm.
        plan: (layer, pass) pairs (default: each layer once); see :func:`layer_plan`.
        loop_pass_embed: a zero-init ``[passes, H]`` parameter added at each new pass.
        hc_mult: > 1 expands the stream into that many hyper-connection streams and
            mixes them back with ``hc_out_mix`` (:class:`HCOutputMix`).
        input_stage: ``(name, module)`` reading the embeddings before the layers; an
            :class:`~laminae.primitives.engram.EngramModule` adds its gated read
            (``output``) and shares the raw read (``retrieved``) as ``ctx.shared["ngram"]``,
            which a branch taking ``ngram=`` receives (decoding starts from its
            ``empty_cache``).
        value_embedding: share the token embedding as ``ctx.shared["token_embed"]``.
        refiner: ``(name, module)`` called as ``module(x)`` before the final norm, its
            result read by field (``output``, ``states``: HRM refinement);
            ``deep_supervision`` keeps its states in training.
        shared: model-level parameters handed to every branch that names them in its
            forward (Naylis' bank as ``M_blocks``).
        max_positions: the context (cached + new tokens); longer inputs raise ShapeError
            before any layer runs (None: no limit).

    ``forward(input_ids [B, S], attention_mask=None, cache=None) -> DecoderOutput``;
    ``cache=None`` decodes nothing (``out.cache`` is None); decoding starts from
    ``empty_cache(batch)``.
    """

    def __init__(self, embed_tokens: nn.Embedding, layers: Sequence[ResidualBlock], norm: nn.Module, *,
                 plan: Sequence[tuple[int, int | None]] | None = None, loop_pass_embed: bool = False,
                 hc_mult: int = 1, input_stage: tuple[str, nn.Module] | None = None,
                 value_embedding: bool = False, refiner: tuple[str, nn.Module] | None = None,
                 deep_supervision: bool = False, shared: dict[str, nn.Parameter] | None = None,
                 max_positions: int | None = None) -> None:
        super().__init__()
        if max_positions is not None:
            check_positive_int("max_positions", max_positions)
        self.max_positions = max_positions
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.plan = list(plan) if plan is not None else [(i, None) for i in range(len(layers))]
        if any(not 0 <= layer < len(layers) for layer, _ in self.plan):
            raise ConfigError(f"`plan` refers to layers outside 0..{len(layers) - 1}: {self.plan}")
        passes = max((p for _, p in self.plan if p is not None), default=-1) + 1
        self.loop_pass_embed = (nn.Parameter(torch.zeros(passes, embed_tokens.embedding_dim))
                                if loop_pass_embed and passes > 1 else None)
        self.hc_mult = hc_mult
        self.input_stage = input_stage[0] if input_stage else None
        if input_stage:
            self.add_module(*input_stage)
        self.hc_out_mix = HCOutputMix(hc_mult) if hc_mult > 1 else None
        self.refiner = refiner[0] if refiner else None
        if refiner:
            self.add_module(*refiner)
        self.norm = norm
        self.value_embedding, self.deep_supervision = bool(value_embedding), bool(deep_supervision)
        self.shared_names = list(shared or {})
        for name, param in (shared or {}).items():
            self.register_parameter(name, param)
        # a looped plan calls routers more often than one pass: keep the aux scale comparable
        self.router_scale = len(self.plan) / len(layers)

    @property
    def signature(self) -> tuple:
        return ("decoder", len(self.plan), self.embed_tokens.embedding_dim, self.hc_mult)

    def _check(self, input_ids, attention_mask, cache) -> None:
        check_decoder_call(self, input_ids, attention_mask, cache, self.embed_tokens.weight)

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> DecoderCache:
        """An empty :class:`DecoderCache` for ``batch`` sequences on ``device`` (default:
        the parameters'); each branch's cache starts on the first call from its own
        ``empty_cache``, in ``dtype`` (default None: each branch's own default)."""
        return start_decoder_cache(self, batch, dtype, device, self.signature)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: DecoderCache | None = None) -> DecoderOutput:
        self._check(input_ids, attention_mask, cache)
        B, S = input_ids.shape
        past = cache.length if cache is not None else 0
        positions = torch.arange(past, past + S, device=input_ids.device).unsqueeze(0)
        ctx = BlockContext(positions, attention_mask, {n: getattr(self, n) for n in self.shared_names},
                           decoding=cache is not None, cache_dtype=cache.dtype if cache is not None else None)
        x = self.embed_tokens(input_ids)
        if self.value_embedding:
            ctx.shared["token_embed"] = x
        input_state = None
        if self.input_stage is not None:
            stage = getattr(self, self.input_stage)
            stage_cache = None
            if cache is not None:
                stage_cache = (cache.input_state if cache.input_state is not None
                               else stage.empty_cache(B, dtype=cache.dtype or x.dtype, device=x.device))
            read = stage(x, attention_mask, stage_cache)
            input_state, ctx.shared["ngram"] = read.cache, read.retrieved
            x = x + read.output
        if self.hc_mult > 1:
            x = expand_streams(x, self.hc_mult)
        old_slots = cache.slots if cache is not None and cache.slots else (None,) * len(self.plan)
        new_slots, prev_pass, prefix_sources = [], None, []
        for slot, (layer_idx, pass_idx) in enumerate(self.plan):
            if pass_idx is not None and pass_idx != prev_pass:
                if self.loop_pass_embed is not None:
                    x = x + self.loop_pass_embed[pass_idx]
                # depth sources restart every pass, keeping what an unlooped prefix offered
                if prev_pass is None:
                    prefix_sources = list(ctx.depth_sources)
                ctx.depth_sources = list(prefix_sources)
            prev_pass = pass_idx
            x, state = self.layers[layer_idx](x, ctx, old_slots[slot])
            new_slots.append(state)
        aux = sum(ctx.aux_losses, x.new_zeros((), dtype=torch.float32))
        if self.router_scale > 1.0:
            aux = aux / self.router_scale
        if self.hc_out_mix is not None:
            x = self.hc_out_mix(x)
        refine_states = None
        if self.refiner is not None:
            refined = getattr(self, self.refiner)(x)
            x, states = refined.output, refined.states
            if self.deep_supervision and self.training:
                refine_states = [self.norm(s) for s in states]
        new_cache = None
        if cache is not None:
            new_cache = cache.advanced(S, new_slots, input_state, self.signature, input_ids)
        return DecoderOutput(self.norm(x), new_cache, aux, refine_states, ctx.metrics or None)


class LMOutput(NamedTuple):
    logits: torch.Tensor                 # [B, S, V]
    hidden: torch.Tensor                 # [B, S, H]
    aux_loss: torch.Tensor
    cache: DecoderCache | None
    refine_states: list | None
    metrics: dict | None = None


class CausalLM(nn.Module):
    """``model`` (:class:`DecoderModel`) + ``lm_head`` (bias-free, tied to the embedding
    when ``tie_word_embeddings``). Extra heads a recipe's loss uses (MTP, abstention)
    are added with ``add_module``.

    ``forward(input_ids, attention_mask=None, cache=None) -> LMOutput``; decoding starts
    from ``empty_cache(batch)`` (the decoder's).
    ``logits_fn(hidden)`` applies the LM head (shared by MTP heads)."""

    def __init__(self, model: DecoderModel, vocab_size: int, *, tie_word_embeddings: bool = False,
                 initializer_range: float | None = None) -> None:
        super().__init__()
        self.model = model
        # a model whose input is not an nn.Embedding (a token generator) states its width
        hidden = getattr(model, "hidden_size", None) or model.embed_tokens.embedding_dim
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)
        if initializer_range is not None:
            nn.init.normal_(self.lm_head.weight, std=initializer_range)
        self.tie_word_embeddings = bool(tie_word_embeddings)
        if tie_word_embeddings:
            self.lm_head.weight = model.embed_tokens.weight

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> DecoderCache:
        """The decoder's :meth:`DecoderModel.empty_cache`: the cache decoding starts from."""
        return self.model.empty_cache(batch, dtype=dtype, device=device)

    def logits_fn(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: DecoderCache | None = None) -> LMOutput:
        out = self.model(input_ids, attention_mask, cache)
        return LMOutput(self.lm_head(out.hidden), out.hidden, out.aux_loss, out.cache, out.refine_states,
                        out.metrics)
