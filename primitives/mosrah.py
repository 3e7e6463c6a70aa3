"""MoSRAH: mixture of sparse routed attention heads (the sparse path of SHRAM).

Each token picks ``K`` of ``L`` expert attention heads; every head attends causally
over only the tokens routed to it, with its own ``d → u`` projections, and the
token's output is the routing-weighted sum of its ``K`` head outputs projected back
to ``d``. Notation: ``B`` batch, ``N`` tokens, ``d`` width, ``L`` expert heads,
``K`` heads per token, ``u`` head dim.

Router ("topk_bias")::

    G = x·W_rᵀ (fp32)      R = softmax(G)      I = top-K of softmax(G + b)
    P_k = R[I_k] / Σ_k' R[I_k']                (the bias only chooses, never weighs)
    f_l = #{live copies routed to l} / (K·n_live)
    LB = Σ_l |f_l − 1/L|,   ∂LB/∂b_l := sign(f_l − 1/L)   (custom backward, b only)
    MaxVio = L·max_l (f_l − 1/L)                          (detached)

Bottlenecked ensemble attention (per head ``l``, over the tokens routed to it, in
token order)::

    q, k, v = x·W_Q[l], x·W_K[l], x·W_V[l]        q̃, k̃ = RoPE_YaRN(q, k; position)
    z_n = Σ_{m ≤ n, m routed to l, m live} softmax_m(A·q̃_n·k̃_m / √u) v_m
    h_s(x)_n = Σ_k P_{n,k} · z_{n,k}·W_O[I_{n,k}]

Positions: ``main_sequence`` uses the token's own position id; ``semantic_sequence``
uses its slot index in the head's packed sequence (plus the head's cached count).
YaRN: ``s = C_target / C_train`` rescales the low frequencies and sets
``A = (0.1·ln s + 1)²``; ``s = 1`` is plain RoPE (evaluated through the same blend,
exactly as the public implementation does).

The reference packs tokens into the public implementation's padded ``[B, L, T, ·]``
layout (``T`` = the largest head load; a stable sort keeps token order inside a
head, which is what makes the slot-order mask causal). The Triton path uses an
unpadded varlen layout instead (``triton_ops/mosrah.py``).

Parameter names follow the public SHRAM implementation, so its checkpoints load:
``router.routing_projection.weight`` [L, d], ``router.expert_bias`` [L],
``bea.q_proj``/``k_proj``/``v_proj`` [L, d, u], ``bea.o_proj`` [L, u, d].
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ._backend import Backend, check_backend, resolve_backend
from ._cache import MIN_CAPACITY, AppendBuffer, DecodingCache, check_cache
from ._errors import ConfigError, DTypeError, ShapeError
from ._validation import (FLOAT_DTYPES, check_choice, check_has_tokens, check_keep_mask, check_param_dtype,
                          check_positive_int, check_same_device, check_tensor, debug_checks_enabled, dense_keep_mask,
                          without_autocast)
from .blocks.rotary import RotaryEmbedding, YarnRope, rotary_embedding, yarn_rope

__all__ = [
    "ROPE_MODES",
    "CACHE_HORIZONS",
    "Routing",
    "mosrah_route",
    "load_balance_loss",
    "ExpertPacking",
    "pack_experts",
    "unpack_experts",
    "bea_packed_reference",
    "mosrah_reference",
    "MoSRAHRouter",
    "BottleneckedEnsembleAttention",
    "MoSRAHCache",
    "MoSRAHOutput",
    "MoSRAH",
]

ROPE_MODES = ("main_sequence", "semantic_sequence")
# Cached decoding: which cache rows a live query of a chunk may see (errata E1).
CACHE_HORIZONS = ("live_rank", "raw_slot")


# ----------------------------------------------------------------------------
# Router and load balance
# ----------------------------------------------------------------------------


class _LoadBalanceLoss(torch.autograd.Function):
    """LB = Σ|f − 1/L| whose gradient goes to the expert bias only, as sign(f − 1/L)
    (auxiliary-loss-free balancing driven through the optimizer). ``f`` carries no
    gradient; with no live token the loss and the gradient are 0 (errata E2)."""

    @staticmethod
    def forward(ctx, expert_bias, freq, any_live):
        excess = freq - 1.0 / freq.shape[-1]
        ctx.save_for_backward(excess, any_live)
        loss = excess.abs().sum()
        return torch.where(any_live, loss, torch.zeros_like(loss)).to(expert_bias.dtype)

    @staticmethod
    def backward(ctx, grad):
        excess, any_live = ctx.saved_tensors
        dbias = torch.where(any_live, grad * torch.sign(excess), torch.zeros_like(excess))
        return dbias, None, None


def load_balance_loss(expert_bias: torch.Tensor, freq: torch.Tensor, any_live: torch.Tensor) -> torch.Tensor:
    return _LoadBalanceLoss.apply(expert_bias, freq, any_live)


class Routing(NamedTuple):
    indices: torch.Tensor       # [B, N, K] int64 selected heads, by descending biased probability
    weights: torch.Tensor       # [B, N, K] renormalised clean probabilities P (fp32, fp64 for fp64 x)
    load_balance_loss: torch.Tensor  # 0-dim, gradient to expert_bias only
    max_vio: torch.Tensor       # 0-dim, detached, in the routing precision


def sanitize_padding(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Non-finite entries of dead tokens (``attention_mask`` ``[B, N]`` bool False) become
    0 (finite padding is kept, so dead tokens route exactly as in the public
    implementation): nothing downstream, not even a gradient 0·NaN, can then see them."""
    dead = ~attention_mask[..., None] & ~torch.isfinite(x)
    return torch.where(dead, torch.zeros((), dtype=x.dtype, device=x.device), x)


def mosrah_route(x: torch.Tensor, routing_weight: torch.Tensor, expert_bias: torch.Tensor, top_k: int,
                 attention_mask: torch.Tensor | None = None) -> Routing:
    """The "topk_bias" router on ``x`` ``[B, N, d]`` (fp32 logits, errata E5 selection).

    Logits, routing frequencies, the load-balance loss and MaxVio are computed in
    ``promote_types(x.dtype, float32)``: float64 inputs stay float64 throughout."""
    B, N, _ = x.shape
    L = routing_weight.shape[0]
    live = dense_keep_mask(attention_mask, B, N, x.device)
    compute = torch.promote_types(x.dtype, torch.float32)
    logits = x.to(compute) @ routing_weight.to(compute).t()
    probs = torch.softmax(logits, dim=-1)
    with torch.no_grad():
        biased = torch.softmax(logits + expert_bias.to(compute), dim=-1)
        indices = torch.topk(biased, top_k, dim=-1, sorted=True).indices
    chosen = probs.gather(-1, indices)
    weights = chosen / chosen.sum(-1, keepdim=True)
    with torch.no_grad():
        assigned = torch.zeros(B, N, L, dtype=compute, device=x.device).scatter_(-1, indices, 1.0)
        per_head = torch.where(live[..., None], assigned, 0.0).sum((0, 1))
        n_live = live.sum()
        any_live = n_live > 0
        freq = torch.where(any_live, per_head / (top_k * n_live.clamp_min(1)), 0.0)
        max_vio = torch.where(any_live, L * (freq - 1.0 / L).max(), 0.0)
    lb = load_balance_loss(expert_bias, freq, any_live)
    return Routing(indices, weights, lb, max_vio)


# ----------------------------------------------------------------------------
# Expert packing (reference layout)
# ----------------------------------------------------------------------------


class ExpertPacking(NamedTuple):
    order: torch.Tensor         # [B, N·K] stable argsort of the flattened head choices (Π)
    inverse: torch.Tensor       # [B, N·K] Π⁻¹
    token: torch.Tensor         # [B, N·K] source token of each copy, expert-major
    counts: torch.Tensor        # [B, L] copies per head
    occupied: torch.Tensor      # [B, L, T] bool, slot t < counts (left-justified)
    slot: torch.Tensor          # [B, N·K] flat index l·T + t of each copy, expert-major (as ``token``)


def pack_experts(indices: torch.Tensor, num_heads: int, slots: int | None = None) -> ExpertPacking:
    """Token-choice → expert-choice: a stable sort of the head choices ``[B, N, K]``
    (stability keeps each head's tokens in increasing order). ``T`` is the largest
    head load (one host sync) unless ``slots`` (≥ that load, e.g. N) is given; under
    ``torch.compile`` it is N, so the graph has static shapes. Copies move by index
    (``slot``), never by boolean indexing, whose size depends on the data."""
    B, N, K = indices.shape
    flat = indices.reshape(B, N * K)
    order = torch.argsort(flat, dim=-1, stable=True)
    inverse = torch.argsort(order, dim=-1)
    token = torch.arange(N, device=indices.device).repeat_interleave(K).expand(B, -1).gather(-1, order)
    counts = torch.zeros(B, num_heads, dtype=torch.long, device=indices.device)
    counts.scatter_add_(1, flat, torch.ones_like(flat))
    if slots is None:
        slots = N if torch.compiler.is_compiling() else int(counts.max())
    occupied = torch.arange(slots, device=indices.device)[None, None, :] < counts[..., None]
    head = flat.gather(-1, order)
    first = (torch.cumsum(counts, dim=-1) - counts).gather(-1, head)     # the head's first copy in sorted order
    slot = head * slots + torch.arange(N * K, device=indices.device) - first
    return ExpertPacking(order, inverse, token, counts, occupied, slot)


def _along(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``index`` ``[B, M]`` expanded over the trailing dims of ``like`` ``[B, *, ...]``."""
    return index.reshape(index.shape + (1,) * (like.dim() - 2)).expand(index.shape + like.shape[2:])


def pack_rows(values: torch.Tensor, packing: ExpertPacking, fill=0) -> torch.Tensor:
    """Gather ``values`` ``[B, N, ...]`` into ``[B, L, T, ...]`` (``fill`` in empty slots)."""
    B, L, T = packing.occupied.shape
    rows = values.gather(1, _along(packing.token, values))
    out = torch.full((B, L * T) + values.shape[2:], fill, dtype=values.dtype, device=values.device)
    return out.scatter(1, _along(packing.slot, rows), rows).reshape((B, L, T) + values.shape[2:])


def unpack_experts(packed: torch.Tensor, packing: ExpertPacking, top_k: int) -> torch.Tensor:
    """``[B, L, T, ...]`` → ``[B, N, K, ...]``: the copy of token n in its k-th head."""
    B, L, T = packed.shape[:3]
    flat = packed.reshape((B, L * T) + packed.shape[3:])
    rows = flat.gather(1, _along(packing.slot.gather(1, packing.inverse), flat))
    return rows.reshape((B, -1, top_k) + packed.shape[3:])


# ----------------------------------------------------------------------------
# BEA on the packed layout
# ----------------------------------------------------------------------------


def _masked_softmax_attention(q, k, v, allowed, scale):
    """softmax(scale·q·kᵀ) v over allowed keys; rows with none give 0 (no NaN leaks)."""
    scores = torch.einsum("bltu,blsu->blts", q, k) * scale
    scores = torch.where(allowed, scores, float("-inf"))
    any_allowed = allowed.any(-1, keepdim=True)
    scores = torch.where(any_allowed, scores, 0.0)
    p = torch.where(allowed, torch.softmax(scores, dim=-1), 0.0)
    v = torch.where(allowed.any(-2)[..., None], v, 0.0)
    return torch.einsum("blts,blsu->bltu", p, v)


def bea_packed_reference(x_packed: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                         q_proj: torch.Tensor, k_proj: torch.Tensor, v_proj: torch.Tensor, o_proj: torch.Tensor,
                         inv_freq: torch.Tensor, attention_scale: float, *, upcast: bool = True) -> torch.Tensor:
    """BEA over packed heads: ``x_packed`` ``[B, L, T, d]``, ``position_ids`` ``[B, L, T]``
    (integers, per head), ``attention_mask`` ``[B, L, T]`` bool (live copies) → ``y``
    ``[B, L, T, d]`` (0 where not live). Causal by slot; a live query sees live keys at
    slots ≤ its own."""
    dtype = x_packed.dtype
    compute = torch.promote_types(dtype, torch.float32) if upcast else dtype
    xp = x_packed.to(compute)
    q = torch.einsum("bltd,ldu->bltu", xp, q_proj.to(compute))
    k = torch.einsum("bltd,ldu->bltu", xp, k_proj.to(compute))
    v = torch.einsum("bltd,ldu->bltu", xp, v_proj.to(compute))
    q, k = rotary_embedding(q, position_ids, inv_freq), rotary_embedding(k, position_ids, inv_freq)
    live = attention_mask
    T = x_packed.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=x_packed.device).tril()
    allowed = causal & live[..., :, None] & live[..., None, :]
    z = _masked_softmax_attention(q, k, v, allowed, attention_scale)
    return torch.einsum("bltu,lud->bltd", z, o_proj.to(compute)).to(dtype)


def bea_positions(rope_mode: str, position_ids: torch.Tensor, packing: ExpertPacking,
                  offset: torch.Tensor | None = None) -> torch.Tensor:
    """BEA position of every slot ``[B, L, T]``: the token's position id, or its slot
    index (dead copies included) plus the head's cached count ``offset`` ``[B, L]``."""
    if rope_mode == "main_sequence":
        return pack_rows(position_ids, packing)
    T = packing.occupied.shape[-1]
    slot = torch.arange(T, device=position_ids.device).expand_as(packing.occupied)
    return slot if offset is None else slot + offset[..., None]


def mosrah_reference(x: torch.Tensor, routing_weight: torch.Tensor, expert_bias: torch.Tensor,
                     q_proj: torch.Tensor, k_proj: torch.Tensor, v_proj: torch.Tensor, o_proj: torch.Tensor,
                     position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                     top_k: int, inv_freq: torch.Tensor, attention_scale: float,
                     rope_mode: str = "main_sequence", upcast: bool = True,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoSRAH sparse path, uncached, in the public implementation's padded layout.

    Args:
        x: ``[B, N, d]`` (already normalised by the caller).
        routing_weight: ``[L, d]`` W_r;  expert_bias: ``[L]`` b.
        q_proj, k_proj, v_proj: ``[L, d, u]``;  o_proj: ``[L, u, d]``.
        position_ids: ``[B, N]`` integer positions (main_sequence RoPE).
        attention_mask: optional ``(B, N)`` keep mask (True/1 = live token).
        top_k: K;  inv_freq, attention_scale: from :func:`yarn_rope`.
        rope_mode: "main_sequence" | "semantic_sequence".
        upcast: fp32 attention math (the truth) or the input dtype (baseline, fp64).
    Returns:
        ``(h_s [B, N, d] in x's dtype (0 at dead tokens), load_balance_loss, max_vio)``.
    """
    B, N, _ = x.shape
    L = q_proj.shape[0]
    live = dense_keep_mask(attention_mask, B, N, x.device)
    x = sanitize_padding(x, live)
    routing = mosrah_route(x, routing_weight, expert_bias, top_k, live)
    packing = pack_experts(routing.indices, L)
    positions = bea_positions(rope_mode, position_ids, packing)
    live_packed = pack_rows(live, packing, fill=False) & packing.occupied
    y = bea_packed_reference(pack_rows(x, packing), positions, live_packed, q_proj, k_proj, v_proj, o_proj,
                             inv_freq, attention_scale, upcast=upcast)
    per_copy = unpack_experts(y, packing, top_k)                      # [B, N, K, d]
    compute = torch.promote_types(x.dtype, torch.float32) if upcast else x.dtype
    out = torch.einsum("bnk,bnkd->bnd", routing.weights.to(compute), per_copy.to(compute))
    out = torch.where(live[..., None], out, 0.0).to(x.dtype)
    return out, routing.load_balance_loss, routing.max_vio


# ----------------------------------------------------------------------------
# Decoding cache
# ----------------------------------------------------------------------------


class MoSRAHCache(DecodingCache):
    """Per-(batch, head) post-RoPE keys and raw values of the live copies routed to each
    head, in the shared copy-on-branch storage (:class:`~laminae.primitives._cache.AppendBuffer`).

    ``keys``/``values`` ``[B, length, L, u]``: head ``l`` of row ``b`` holds its
    ``counts[b, l]`` rows first, in token order; the rows after them hold nothing a
    query reads. ``length`` counts the positions seen (each chunk of N tokens adds N
    rows, enough for any head's share), ``live_tokens`` ``[B]`` the live ones (default
    position ids continue from it). Appending returns a new cache and leaves this one
    valid: several next steps from one cache (beam search) are each right. Capacity
    doubles when full, so appends are amortised O(1) and need no host sync. Start from
    :meth:`MoSRAH.empty_cache`; ``owner`` identifies the layer that made it.
    """

    def __init__(self, buffers: AppendBuffer, counts: torch.Tensor, live_tokens: torch.Tensor,
                 config: dict, owner: object) -> None:
        self.buffers, self.counts, self.live_tokens = buffers, counts, live_tokens
        self.config, self.owner = config, owner

    @property
    def length(self) -> int:
        """Positions seen (the protocol's token count)."""
        return self.buffers.length

    @property
    def keys(self) -> torch.Tensor:
        """``[B, length, L, u]`` post-RoPE keys; rows ≥ ``counts`` of a head hold nothing."""
        return self.buffers.get("keys")

    @property
    def values(self) -> torch.Tensor:
        return self.buffers.get("values")

    @property
    def batch(self) -> int:
        return self.counts.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.buffers._storage.tensors["keys"].dtype

    @property
    def device(self) -> torch.device:
        return self.counts.device

    @property
    def num_heads(self) -> int:
        return self.config["num_mosrah_heads"]

    @property
    def head_dim(self) -> int:
        return self.config["head_dim"]

    @property
    def capacity(self) -> int:
        """Positions the current storage holds before it grows (it doubles when full)."""
        return self.buffers.capacity

    def reset(self) -> None:
        """Forget everything (explicit, in place); the next append branches off."""
        self.buffers = AppendBuffer(self.buffers._storage, 0)
        self.counts = torch.zeros_like(self.counts)
        self.live_tokens = torch.zeros_like(self.live_tokens)

    def clone(self) -> "MoSRAHCache":
        """An independent copy (same owner, fresh buffers)."""
        return MoSRAHCache(self.buffers.clone(), self.counts.clone(), self.live_tokens.clone(), dict(self.config),
                           self.owner)

    def select(self, batch_index: torch.Tensor) -> "MoSRAHCache":
        """A new cache holding rows ``batch_index`` (beam reordering), all state together."""
        buffers = AppendBuffer.wrap(keys=self.keys.index_select(0, batch_index),
                                    values=self.values.index_select(0, batch_index))
        return MoSRAHCache(buffers, self.counts.index_select(0, batch_index),
                           self.live_tokens.index_select(0, batch_index), dict(self.config), self.owner)

    def append(self, keys: torch.Tensor, values: torch.Tensor, write: torch.Tensor,
               live: torch.Tensor) -> "MoSRAHCache":
        """A cache that also holds a chunk's live copies: ``keys``/``values`` ``[B, L, N, u]``
        per head in slot order, ``write`` ``[B, L, N]`` the live ones, ``live`` ``[B, N]``
        the chunk's keep mask. Head ``l``'s live copies go to its rows ``counts[b, l]``,
        ``counts[b, l] + 1``, … in slot order, its other slots to the rows right after
        them (past the new count: never read), so no two slots share a row."""
        w = write.long()
        live_rank = torch.cumsum(w, -1) - w
        other_rank = torch.cumsum(1 - w, -1) - (1 - w)
        rows = self.counts[..., None] + torch.where(write, live_rank, w.sum(-1, keepdim=True) + other_rank)
        buffers = self.buffers.scatter(live.shape[1], rows.transpose(1, 2), keys=keys.transpose(1, 2),
                                       values=values.transpose(1, 2))
        return MoSRAHCache(buffers, self.counts + w.sum(-1), self.live_tokens + live.sum(1), self.config, self.owner)


# ----------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------


class MoSRAHOutput(NamedTuple):
    """What :class:`MoSRAH` returns: ``output, cache`` first, as every decoding block."""

    output: torch.Tensor             # [B, N, d] sparse-path output h_s (0 at dead tokens)
    cache: MoSRAHCache | None        # the advanced cache when one was passed, else None (not decoding)
    load_balance_loss: torch.Tensor  # 0-dim; its gradient reaches only router.expert_bias
    max_vio: torch.Tensor            # 0-dim, detached monitoring scalar


class MoSRAHRouter(nn.Module):
    """The "topk_bias" router: ``routing_projection`` (``nn.Linear(d, L, bias=False)``,
    init N(0, 0.02²)) and ``expert_bias`` ``[L]`` (zeros). ``forward(x [B, N, d],
    attention_mask=None) -> Routing`` (indices, weights ``[B, N, K]``, LB, MaxVio)."""

    def __init__(self, embedding_width: int, num_heads: int, top_k: int) -> None:
        super().__init__()
        self.num_heads, self.top_k = num_heads, top_k
        self.routing_projection = nn.Linear(embedding_width, num_heads, bias=False)
        self.expert_bias = nn.Parameter(torch.zeros(num_heads))
        nn.init.normal_(self.routing_projection.weight, std=0.02)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, top_k={self.top_k}"

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Routing:
        return mosrah_route(x, self.routing_projection.weight, self.expert_bias, self.top_k, attention_mask)


class BottleneckedEnsembleAttention(nn.Module):
    """Per-head projections of BEA: ``q_proj``/``k_proj``/``v_proj`` ``[L, d, u]`` and
    ``o_proj`` ``[L, u, d]``, plus the YaRN rotary embedding ``rotary`` (fp32
    frequencies, not in the state dict) and its score scale ``attention_scale``.

    ``init="per_matrix"`` (default): Xavier-uniform per head matrix, bound √(6/(d+u));
    ``"whole_bank"``: Xavier on each 3-D bank, as the public implementation's first
    release (bounds √(6/(u(d+L))) and √(6/(d(u+L)))). ``forward(x_packed [B, L, T, d],
    attention_mask [B, L, T] = None, *, position_ids [B, L, T]) -> [B, L, T, d]`` runs
    the packed reference (``attention_mask``: the live copies; None = every slot)."""

    def __init__(self, embedding_width: int, num_heads: int, head_dim: int, rope: YarnRope,
                 init: str = "per_matrix") -> None:
        super().__init__()
        d, L, u = embedding_width, num_heads, head_dim
        self.q_proj = nn.Parameter(torch.empty(L, d, u))
        self.k_proj = nn.Parameter(torch.empty(L, d, u))
        self.v_proj = nn.Parameter(torch.empty(L, d, u))
        self.o_proj = nn.Parameter(torch.empty(L, u, d))
        self.rotary = RotaryEmbedding(head_dim, inv_freq=rope.inv_freq)
        self.attention_scale = rope.attention_scale
        with torch.no_grad():
            for bank in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
                if init == "whole_bank":
                    nn.init.xavier_uniform_(bank)
                else:
                    for matrix in bank:
                        nn.init.xavier_uniform_(matrix)

    @property
    def inv_freq(self) -> torch.Tensor:
        """``[u/2]`` fp32 YaRN frequencies θ′ (the rotary embedding's)."""
        return self.rotary.inv_freq

    def forward(self, x_packed: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                position_ids: torch.Tensor) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones(x_packed.shape[:3], dtype=torch.bool, device=x_packed.device)
        return bea_packed_reference(x_packed, position_ids, attention_mask, self.q_proj, self.k_proj, self.v_proj,
                                    self.o_proj, self.inv_freq, self.attention_scale)


class MoSRAH(nn.Module):
    """MoSRAH sparse routed attention heads (the SHRAM layer's ``sparse_attention``).

    Args (the SHRAM configuration's names and defaults):
        embedding_width: d.
        num_mosrah_heads: L expert heads.
        num_selected_heads: K heads per token (1 ≤ K ≤ L).
        head_dim: u (even).
        rope_mode: "main_sequence" (token positions) | "semantic_sequence" (slot index).
        mosrah_rope_theta: RoPE base.
        training_sequence_length, inference_sequence_length: YaRN ``s = C_target/C_train``
            (``None`` = no extension). Positions must stay below ``inference_sequence_length``.
        alpha, beta: YaRN ramp bounds (β > α).
        cache_horizon: "live_rank" (default; causal also when a cached chunk mixes dead
            and live tokens) | "raw_slot" (the public implementation's rule, which lets a
            live query see later tokens of its chunk when dead copies precede it).
        init: "per_matrix" | "whole_bank" BEA initialisation.
        backend: "auto" | "triton" | "reference".

    ``forward(x, attention_mask=None, cache=None, *, position_ids=None) -> MoSRAHOutput``:
    ``x`` ``[B, N, d]`` (normalised), ``attention_mask`` ``(B, N)`` keep mask,
    ``position_ids`` ``[B, N]`` integers (default: live-token count − 1, continuing a
    cache). Returns ``MoSRAHOutput(output [B, N, d], cache, load_balance_loss [],
    max_vio [])``. ``cache=None`` is a training (uncached) call and returns
    ``cache=None``: the per-head rotated keys and values a cache holds are storage the
    uncached kernels never build, so decoding starts from :meth:`empty_cache` instead
    (docs/protocol.md). Cached calls (prefill and decode steps) route, project and
    append in PyTorch; on the Triton backend their attention over the cache is a
    Triton kernel when no gradient is recorded (``torch.no_grad()``/inference mode),
    the PyTorch path otherwise. The router, the projections and the attention run with
    autocast off, in ``promote(x.dtype, float32)`` on the reference path (fp32
    routing logits) and in ``x``'s dtype around the Triton kernels.

    Example::

        mosrah = MoSRAH(512, num_mosrah_heads=16, num_selected_heads=4, head_dim=16)
        out, _, lb, max_vio = mosrah(x, attention_mask=keep)
        loss = task_loss(out) + 0.01 * lb              # lb trains router.expert_bias only

        out, cache, *_ = mosrah(x_prompt, cache=mosrah.empty_cache(batch))
        out, cache, *_ = mosrah(x_next, cache=cache)   # one token: [B, 1, d]
    """

    def __init__(self, embedding_width: int = 512, num_mosrah_heads: int = 16, num_selected_heads: int = 16,
                 head_dim: int = 16, rope_mode: str = "main_sequence", mosrah_rope_theta: float = 10000.0,
                 training_sequence_length: int = 1024, inference_sequence_length: int | None = None,
                 alpha: float = 1.0, beta: float = 32.0, cache_horizon: str = "live_rank",
                 init: str = "per_matrix", backend: Backend = "auto") -> None:
        super().__init__()
        for name, value in (("embedding_width", embedding_width), ("num_mosrah_heads", num_mosrah_heads),
                            ("num_selected_heads", num_selected_heads), ("head_dim", head_dim),
                            ("training_sequence_length", training_sequence_length)):
            check_positive_int(name, value)
        inference_sequence_length = inference_sequence_length or training_sequence_length
        check_positive_int("inference_sequence_length", inference_sequence_length)
        if num_selected_heads > num_mosrah_heads:
            raise ConfigError(f"`num_selected_heads` must be ≤ num_mosrah_heads={num_mosrah_heads}, "
                              f"got {num_selected_heads}")
        if head_dim % 2:
            raise ConfigError(f"`head_dim` must be even (RoPE rotates pairs), got {head_dim}")
        check_choice("rope_mode", rope_mode, ROPE_MODES)
        check_choice("cache_horizon", cache_horizon, CACHE_HORIZONS)
        check_choice("init", init, ("per_matrix", "whole_bank"))
        if not mosrah_rope_theta > 0:
            raise ConfigError(f"`mosrah_rope_theta` must be positive, got {mosrah_rope_theta!r}")
        if not beta > alpha:
            raise ConfigError(f"`beta` must exceed alpha={alpha} (the YaRN ramp divides by β − α), got {beta!r}")
        check_backend(backend)
        self.embedding_width, self.num_heads, self.top_k = embedding_width, num_mosrah_heads, num_selected_heads
        self.head_dim, self.rope_mode, self.cache_horizon = head_dim, rope_mode, cache_horizon
        self.training_sequence_length = training_sequence_length
        self.inference_sequence_length = inference_sequence_length
        self.backend = backend
        rope = yarn_rope(head_dim, mosrah_rope_theta, training_sequence_length, inference_sequence_length,
                         alpha, beta)
        self.router = MoSRAHRouter(embedding_width, num_mosrah_heads, num_selected_heads)
        self.bea = BottleneckedEnsembleAttention(embedding_width, num_mosrah_heads, head_dim, rope, init)
        self._cache_owner = object()

    def extra_repr(self) -> str:
        return (f"embedding_width={self.embedding_width}, num_mosrah_heads={self.num_heads}, "
                f"num_selected_heads={self.top_k}, head_dim={self.head_dim}, rope_mode={self.rope_mode!r}, "
                f"yarn_scale={self.inference_sequence_length / self.training_sequence_length:g}, "
                f"backend={self.backend!r}")

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> MoSRAHCache:
        """An empty decoding cache for this layer: per-head rows for a few positions (the
        storage doubles when full), stored in ``dtype`` (default: the parameters'; a
        lower precision rounds the cached keys and values) on ``device`` (default: the
        parameters')."""
        check_positive_int("batch", batch)
        weight = self.bea.q_proj
        dtype = weight.dtype if dtype is None else dtype
        if dtype not in FLOAT_DTYPES:
            raise DTypeError(f"`dtype` of a MoSRAH cache must be a float dtype, got {dtype}")
        device = weight.device if device is None else torch.device(device)
        tail = (self.num_heads, self.head_dim)
        buffers = AppendBuffer.preallocate(MIN_CAPACITY, {"keys": (tail, dtype), "values": (tail, dtype)}, batch,
                                           device)
        return MoSRAHCache(buffers, torch.zeros(batch, self.num_heads, dtype=torch.long, device=device),
                           torch.zeros(batch, dtype=torch.long, device=device),
                           {"num_mosrah_heads": self.num_heads, "head_dim": self.head_dim}, self._cache_owner)

    def _params(self) -> tuple[torch.Tensor, ...]:
        return (self.router.routing_projection.weight, self.router.expert_bias,
                self.bea.q_proj, self.bea.k_proj, self.bea.v_proj, self.bea.o_proj)

    # -- validation ---------------------------------------------------------

    def _check_inputs(self, x, position_ids, attention_mask, cache) -> None:
        check_tensor("x", x, ndim=3, layout="[batch, seq, embedding_width]")
        B, N, d = x.shape
        if d != self.embedding_width:
            raise ShapeError(f"`x` last dim must be embedding_width={self.embedding_width}, got {d}")
        check_has_tokens("x", x)
        weight = self.bea.q_proj
        check_same_device(x=x, parameters=weight, position_ids=position_ids, attention_mask=attention_mask)
        check_param_dtype("x", x, weight)
        check_keep_mask("attention_mask", attention_mask, B, N)
        if cache is not None:
            self._check_cache(cache, x)
        if position_ids is not None:
            check_tensor("position_ids", position_ids, shape=(B, N), dtypes=(torch.int64, torch.int32),
                         layout="[batch, seq] integer positions")
        seen = 0 if cache is None else cache.length
        if self.rope_mode == "semantic_sequence" and seen + N > self.inference_sequence_length:
            raise ConfigError(f"{seen + N} tokens exceed inference_sequence_length="
                              f"{self.inference_sequence_length} (the YaRN limit)")

    def _check_positions(self, position_ids: torch.Tensor, given: bool, attention_mask: torch.Tensor | None,
                         cache: MoSRAHCache | None) -> None:
        """Range of the positions. The default ones stay below the positions seen plus N,
        known on the host; without a cache and a mask they are exactly 0 … N−1. Any
        other check reads the positions back (a device sync), so it runs only with
        ``LAMINAE_DEBUG=1``, never while compiling."""
        if torch.compiler.is_compiling():
            return
        if not given:
            seen = 0 if cache is None else cache.length
            if self.rope_mode == "semantic_sequence" or seen + position_ids.shape[1] <= self.inference_sequence_length:
                return
            if cache is None and attention_mask is None:
                raise ConfigError(
                    f"`position_ids` must be < inference_sequence_length={self.inference_sequence_length} "
                    f"(the YaRN limit), got {position_ids.shape[1] - 1}")
        if not debug_checks_enabled():
            return
        if given and cache is None and bool((position_ids[:, 0] != 0).any()):
            raise ConfigError("`position_ids[:, 0]` must be 0 without a cache (a continuation needs "
                              f"the cache of the earlier tokens), got {position_ids[:, 0].tolist()}")
        if bool((position_ids < 0).any()):
            raise ConfigError("`position_ids` must be ≥ 0, got a negative position")
        if self.rope_mode == "main_sequence" and int(position_ids.max()) >= self.inference_sequence_length:
            raise ConfigError(
                f"`position_ids` must be < inference_sequence_length={self.inference_sequence_length} "
                f"(the YaRN limit), got {int(position_ids.max())}")

    def _check_cache(self, cache, x) -> None:
        check_cache(cache, MoSRAHCache, {"num_mosrah_heads": self.num_heads, "head_dim": self.head_dim},
                    batch=x.shape[0], device=x.device, cache_batch=cache.batch, cache_device=cache.device)
        if cache.owner is not self._cache_owner:
            raise ConfigError("`cache` was made by another MoSRAH layer (use this layer's empty_cache())")

    # -- forward ------------------------------------------------------------

    def _default_positions(self, live: torch.Tensor, cache: MoSRAHCache | None) -> torch.Tensor:
        """Live-token count − 1 (0 on leading dead tokens), continuing the cache's count."""
        count = torch.cumsum(live.long(), dim=1)
        if cache is not None:
            count = count + cache.live_tokens[:, None]
        return (count - 1).clamp_min(0)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: MoSRAHCache | None = None,
                *, position_ids: torch.Tensor | None = None) -> MoSRAHOutput:
        if cache is not None and not isinstance(cache, MoSRAHCache):
            raise TypeError(f"`cache` must be a MoSRAHCache (from MoSRAH.empty_cache) or None, "
                            f"got {type(cache).__name__}")
        self._check_inputs(x, position_ids, attention_mask, cache)
        B, N, _ = x.shape
        live = dense_keep_mask(attention_mask, B, N, x.device)
        given = position_ids is not None
        if not given:
            position_ids = self._default_positions(live, cache)
        self._check_positions(position_ids, given, attention_mask, cache)
        params = self._params()
        triton = resolve_backend(self.backend, x, *params) == "triton"
        with without_autocast(x.device.type):
            if cache is not None:
                return self._cached_forward(x, position_ids, live, cache, triton)
            kwargs = dict(top_k=self.top_k, inv_freq=self.bea.inv_freq, attention_scale=self.bea.attention_scale,
                          rope_mode=self.rope_mode)
            if triton:
                from laminae.triton_ops.mosrah import mosrah

                out, lb, vio = mosrah(x, *params, position_ids, live, **kwargs)
            else:
                out, lb, vio = mosrah_reference(x, *params, position_ids, live, **kwargs)
        return MoSRAHOutput(out, None, lb, vio)

    def _cached_forward(self, x: torch.Tensor, position_ids: torch.Tensor, live: torch.Tensor,
                        cache: MoSRAHCache, triton: bool = False) -> MoSRAHOutput:
        """Route the chunk, append its live copies' keys and values, attend over the cache.

        Rows: the live copies of a head are appended in slot order at ``count_before``,
        ``count_before + 1``, …; a live query sees rows up to ``count_before`` + its live
        rank in the chunk (``"raw_slot"``: + its slot index, bounded by the new count).
        ``triton``: the attention over the cache runs the Triton kernel when no gradient
        is recorded (it has no backward); otherwise PyTorch."""
        B, N, _ = x.shape
        x = sanitize_padding(x, live)
        routing = self.router(x, live)
        packing = pack_experts(routing.indices, self.num_heads, slots=N)
        before = cache.counts
        live_packed = pack_rows(live, packing, fill=False) & packing.occupied
        live_rank = torch.cumsum(live_packed.long(), dim=-1) - live_packed.long()
        positions = bea_positions(self.rope_mode, position_ids, packing, offset=before)
        compute = torch.promote_types(x.dtype, torch.float32)
        xp = pack_rows(x, packing).to(compute)
        bea = self.bea
        q = bea.rotary(torch.einsum("bltd,ldu->bltu", xp, bea.q_proj.to(compute)), positions)
        k = bea.rotary(torch.einsum("bltd,ldu->bltu", xp, bea.k_proj.to(compute)), positions)
        v = torch.einsum("bltd,ldu->bltu", xp, bea.v_proj.to(compute))
        rows = before[..., None] + live_rank
        new_cache = cache.append(k, v, live_packed, live)
        after = new_cache.counts
        if self.cache_horizon == "live_rank":
            horizon = rows
        else:
            horizon = before[..., None] + torch.arange(N, device=x.device)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *self._params()))
        if triton and not grad and compute == torch.float32:
            from laminae.triton_ops.mosrah import mosrah_cached_attention

            # query t of head l sees rows j < limit: j ≤ its horizon and j < the new count
            limit = torch.where(live_packed, torch.minimum(horizon + 1, after[..., None]), 0)
            z = mosrah_cached_attention(q, new_cache.keys, new_cache.values, limit, bea.attention_scale)
        else:
            j = torch.arange(new_cache.length, device=x.device)
            allowed = ((j <= horizon[..., None]) & (j < after[..., None, None]) & live_packed[..., None])
            keys, values = (t.transpose(1, 2).to(compute) for t in (new_cache.keys, new_cache.values))
            z = _masked_softmax_attention(q, keys, values, allowed, bea.attention_scale)
        y = torch.einsum("bltu,lud->bltd", z, bea.o_proj.to(compute))
        per_copy = unpack_experts(y, packing, self.top_k)
        out = torch.einsum("bnk,bnkd->bnd", routing.weights.to(compute), per_copy)
        out = torch.where(live[..., None], out, 0.0).to(x.dtype)
        return MoSRAHOutput(out, new_cache, routing.load_balance_loss, routing.max_vio)
