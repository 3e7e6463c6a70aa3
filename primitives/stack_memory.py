"""StackMemory: a differentiable hidden-state stack (Zhang et al., *StackTrans*, NeurIPS 2025).

Per token and memory head a stack ``St`` ``[S, d_s]`` (slot 0 = top) and a soft
occupancy mask ``M`` ``[S]`` are updated by a soft push / pop / no-op and then read:

    a  = softmax(W_A·h / τ)                       (push, pop, no-op), τ = √(D/H)
    p  = (W_down·h)_head                          push candidate [d_s]
    St'[i] = a_push·St[i−1] + a_pop·St[i+1] + a_noop·St[i]      St[−1] := p, St[S] := 0
    M'[i]  = a_push·M[i−1]  + a_pop·M[i+1]  + a_noop·M[i]       M[−1]  := 1, M[S]  := 0
    R  = Σ_s softmax_s(w_g·(St'_s ⊙ M'_s)) · St'_s            ("soft", paper Eq. 4)
         or softmax_s(w_g·St'_s − 10⁹·(1 − M'_s))              ("released" code)
    out = h + g · W_up·concat_heads(R)
    H(a) = −Σ_o a_o log a_o                       entropy regulariser term

``mode="depth"`` (default, the paper's training form and the released code): the
stack of each token is updated once per decoder layer from that token's own input,
all tokens in parallel; the state ``[B, T, H, S, d_s]`` starts at zero before the
first layer and is carried from layer to layer in a :class:`StackMemoryState`.
``mode="temporal"``: the literal per-token recurrence inside one layer (causal,
zero state at t = 0), with a :class:`StackMemoryCache` for incremental decoding.

Padding tokens (``attention_mask`` 0) act as no-ops: a = (0, 0, 1), entropy 0,
output = input, and their contents never reach kept tokens.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ._backend import Backend, check_backend, resolve_backend
from ._cache import DecodingCache, check_cache
from ._errors import ConfigError, DeviceError, DTypeError, ShapeError
from ._validation import (FLOAT_DTYPES, check_choice, check_has_tokens, check_keep_mask, check_param_dtype,
                          check_positive_int, check_same_device, check_tensor, without_autocast)

__all__ = [
    "stack_actions_reference", "stack_update_reference", "stack_read_reference", "stack_step_reference",
    "stack_scan_reference", "stack_memory_reference", "StackMemory", "StackMemoryState", "StackMemoryCache",
    "StackMemoryOutput", "MODES", "READ_MODES",
]

MODES = ("depth", "temporal")
READ_MODES = ("soft", "released")
# The released code's additive penalty on unoccupied slots (read_mode="released").
RELEASED_PENALTY = 1e9


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The stack's dtype for activations of ``dtype``: fp32 (fp64 for fp64)."""
    return torch.promote_types(dtype, torch.float32)


# ----------------------------------------------------------------------------
# Reference math, one stack step
# ----------------------------------------------------------------------------


def stack_actions_reference(logits: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """(push, pop, no-op) probabilities and their entropy from temperature-scaled logits.

    ``logits`` ``[..., 3]``; ``attention_mask`` ``[...]`` (the keep mask over the
    leading dims, bool or 0/1) or None. Returns ``actions`` ``[..., 3]`` and
    ``entropy`` ``[...]`` (nats). Dropped tokens get the pure no-op (0, 0, 1) and
    entropy 0; ``torch.where`` keeps their values out.
    """
    log_a = torch.log_softmax(logits, dim=-1)
    actions = torch.softmax(logits, dim=-1)
    entropy = -(actions * log_a).sum(-1)
    if attention_mask is not None:
        kept = attention_mask.bool()
        noop = torch.tensor([0.0, 0.0, 1.0], dtype=logits.dtype, device=logits.device)
        actions = torch.where(kept[..., None], actions, noop)
        entropy = torch.where(kept, entropy, torch.zeros_like(entropy))
    return actions, entropy


def stack_update_reference(stack: torch.Tensor, stack_mask: torch.Tensor, actions: torch.Tensor,
                           push: torch.Tensor):
    """Soft push/pop/no-op of ``stack`` ``[..., S, d]`` and ``stack_mask`` ``[..., S]``
    with ``actions`` ``[..., 3]`` and push candidate ``push`` ``[..., d]``. On push the
    bottom slot overflows; on pop a zero enters at the bottom."""
    a_push, a_pop, a_noop = (actions[..., i, None] for i in range(3))
    above = torch.cat([push.unsqueeze(-2), stack[..., :-1, :]], dim=-2)           # St[i−1], p on top
    below = torch.cat([stack[..., 1:, :], torch.zeros_like(stack[..., :1, :])], dim=-2)
    new_stack = a_push[..., None] * above + a_pop[..., None] * below + a_noop[..., None] * stack
    mask_above = torch.cat([torch.ones_like(stack_mask[..., :1]), stack_mask[..., :-1]], dim=-1)
    mask_below = torch.cat([stack_mask[..., 1:], torch.zeros_like(stack_mask[..., :1])], dim=-1)
    new_mask = a_push * mask_above + a_pop * mask_below + a_noop * stack_mask
    return new_stack, new_mask


def stack_read_reference(stack: torch.Tensor, stack_mask: torch.Tensor, gate: torch.Tensor,
                         read_mode: str = "soft") -> torch.Tensor:
    """Global read ``[..., d]`` of ``stack`` ``[..., S, d]`` with query ``gate`` ``[d]``."""
    gate_score = (stack * gate).sum(-1)                                          # w_g·St_s
    if read_mode == "soft":
        score = gate_score * stack_mask                                          # w_g·(St_s ⊙ M_s)
    else:
        score = gate_score - RELEASED_PENALTY * (1 - stack_mask)
    weights = torch.softmax(score, dim=-1)
    return (weights[..., None] * stack).sum(-2)


def stack_step_reference(
    logits: torch.Tensor,
    push: torch.Tensor,
    stack: torch.Tensor,
    stack_mask: torch.Tensor,
    gate: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    read_mode: str = "soft",
):
    """One depth step for every token and head in parallel.

    Args:
        logits: ``[B, T, H, 3]`` action logits, already divided by τ.
        push: ``[B, T, H, d]`` push candidates.
        stack: ``[B, T, H, S, d]``, stack_mask ``[B, T, H, S]``: the state entering the layer.
        gate: ``[d]`` read query.
        attention_mask: ``[B, T]`` keep mask or None.
    Returns:
        ``(read [B, T, H, d], new_stack, new_mask, entropy [B, T, H])``.
    """
    actions, entropy = stack_actions_reference(logits, None if attention_mask is None
                                               else attention_mask[..., None].expand(logits.shape[:-1]))
    new_stack, new_mask = stack_update_reference(stack, stack_mask, actions, push)
    return stack_read_reference(new_stack, new_mask, gate, read_mode), new_stack, new_mask, entropy


def stack_scan_reference(
    logits: torch.Tensor,
    push: torch.Tensor,
    gate: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    initial_stack: torch.Tensor | None = None,
    initial_mask: torch.Tensor | None = None,
    *,
    num_slots: int | None = None,
    read_mode: str = "soft",
):
    """The temporal recurrence: token t updates the stack left by token t−1.

    Args:
        logits ``[B, T, H, 3]`` (divided by τ), push ``[B, T, H, d]``, gate ``[d]``,
        attention_mask ``[B, T]`` or None, initial_stack ``[B, H, S, d]`` and
        initial_mask ``[B, H, S]`` (zeros when None; then ``num_slots`` gives S).
    Returns:
        ``(read [B, T, H, d], entropy [B, T, H], final_stack [B, H, S, d], final_mask [B, H, S])``.
    """
    B, T, H, d = push.shape
    if initial_stack is None:
        initial_stack = push.new_zeros(B, H, num_slots, d)
        initial_mask = push.new_zeros(B, H, num_slots)
    keep = None if attention_mask is None else attention_mask[..., None].expand(B, T, H)
    actions, entropy = stack_actions_reference(logits, keep)
    stack, mask, reads = initial_stack, initial_mask, []
    for t in range(T):
        stack, mask = stack_update_reference(stack, mask, actions[:, t], push[:, t])
        reads.append(stack_read_reference(stack, mask, gate, read_mode))
    return torch.stack(reads, dim=1), entropy, stack, mask


# ----------------------------------------------------------------------------
# Reference math, one whole layer
# ----------------------------------------------------------------------------


def stack_memory_projections(x: torch.Tensor, action_weight, down_weight, action_bias, down_bias,
                             num_heads: int, attention_mask: torch.Tensor | None):
    """Temperature-scaled action logits ``[B, T, H, 3]`` and push candidates
    ``[B, T, H, d]`` from ``x`` ``[B, T, D]``, in ``x``'s dtype. One concatenated
    matmul (the kernel boundary of the spec). Dropped tokens are zeroed first, so
    non-finite padding cannot leak into weight gradients (0·NaN)."""
    if attention_mask is not None:
        x = torch.where(attention_mask.bool()[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))
    tau = math.sqrt(x.shape[-1] / num_heads)
    weight = torch.cat([action_weight / tau, down_weight]).to(x.dtype)
    bias = None
    if action_bias is not None or down_bias is not None:
        ab = action_weight.new_zeros(action_weight.shape[0]) if action_bias is None else action_bias
        db = down_weight.new_zeros(down_weight.shape[0]) if down_bias is None else down_bias
        bias = torch.cat([ab / tau, db]).to(x.dtype)
    proj = F.linear(x, weight, bias)
    n_act = action_weight.shape[0]
    logits = rearrange(proj[..., :n_act], "b t (h o) -> b t h o", h=num_heads, o=3)   # head-major rows
    push = rearrange(proj[..., n_act:], "b t (h d) -> b t h d", h=num_heads)
    return logits, push


def stack_memory_output(x: torch.Tensor, read: torch.Tensor, up_weight, up_bias, res_weight,
                        attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``x + g·W_up·concat_heads(read)``; dropped tokens pass through unchanged."""
    delta = F.linear(rearrange(read, "b t h d -> b t (h d)").to(x.dtype), up_weight.to(x.dtype),
                     None if up_bias is None else up_bias.to(x.dtype))
    out = x + res_weight.to(x.dtype) * delta
    if attention_mask is not None:
        out = torch.where(attention_mask.bool()[..., None], out, x)
    return out


def stack_memory_reference(
    x: torch.Tensor,
    action_weight: torch.Tensor,
    down_weight: torch.Tensor,
    up_weight: torch.Tensor,
    gate: torch.Tensor,
    res_weight: torch.Tensor,
    stack: torch.Tensor | None = None,
    stack_mask: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    action_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    *,
    num_heads: int,
    num_slots: int,
    mode: str = "depth",
    read_mode: str = "soft",
    upcast: bool = True,
):
    """One StackMemory layer.

    Args:
        x: ``[B, T, D]`` the layer's stack input.
        action_weight ``[3H, D]`` (row 3·head + o is action o of that head),
        down_weight ``[H·d, D]``, up_weight ``[D, H·d]``, gate ``[d]``, res_weight ``[]``;
        optional biases ``[3H]``, ``[H·d]``, ``[D]``.
        stack, stack_mask: the incoming state, ``[B, T, H, S, d]`` / ``[B, T, H, S]`` in
            depth mode, ``[B, H, S, d]`` / ``[B, H, S]`` (the state before token 0) in
            temporal mode; zeros when None.
        attention_mask: ``[B, T]`` keep mask or None.
        upcast: compute in fp32 (fp64 for fp64) and cast back (the truth); False keeps
            ``x``'s dtype (the same-dtype baseline).
    Returns:
        ``(out [B, T, D] in x.dtype, new_stack, new_mask, entropy [B, T, H])``; in
        temporal mode the new state is the one after the last token.
    """
    dtype = x.dtype
    cx = x.to(torch.promote_types(x.dtype, torch.float32)) if upcast else x   # fp64 stays fp64
    cast = (lambda t: None if t is None else t.to(cx.dtype))
    logits, push = stack_memory_projections(cx, cast(action_weight), cast(down_weight), cast(action_bias),
                                            cast(down_bias), num_heads, attention_mask)
    if mode == "depth":
        if stack is None:
            B, T, H, d = push.shape
            stack, stack_mask = push.new_zeros(B, T, H, num_slots, d), push.new_zeros(B, T, H, num_slots)
        read, new_stack, new_mask, entropy = stack_step_reference(
            logits, push, cast(stack), cast(stack_mask), cast(gate), attention_mask, read_mode=read_mode)
    else:
        read, entropy, new_stack, new_mask = stack_scan_reference(
            logits, push, cast(gate), attention_mask, cast(stack), cast(stack_mask), num_slots=num_slots,
            read_mode=read_mode)
    out = stack_memory_output(cx, read, cast(up_weight), cast(up_bias), cast(res_weight), attention_mask)
    return out.to(dtype), new_stack, new_mask, entropy


# ----------------------------------------------------------------------------
# State carried from layer to layer, and the temporal decoding cache
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StackMemoryState:
    """What one StackMemory layer hands to the next.

    ``stack`` ``[B, T, H, S, d]`` and ``stack_mask`` ``[B, T, H, S]`` (fp32; None in
    temporal mode, where each layer's stack lives in its own cache), plus the running
    sum of action entropies over kept tokens and heads and how many terms it holds
    (both 0-dim tensors, so no host sync). ``config`` = (mode, H, S, d) of the layers
    that produced it. Immutable: every layer returns a new state.
    """

    config: tuple
    stack: torch.Tensor | None
    stack_mask: torch.Tensor | None
    entropy_sum: torch.Tensor
    entropy_count: torch.Tensor
    num_layers: int = 0

    def entropy_mean(self) -> torch.Tensor:
        """Mean action entropy over kept tokens × heads × layers (nats)."""
        return self.entropy_sum / self.entropy_count.clamp_min(1)


class StackMemoryCache(DecodingCache):
    """Temporal-mode decoding cache of one layer: the stack after the last token seen.

    ``stack`` ``[B, H, S, d]``, ``stack_mask`` ``[B, H, S]`` (the slots' soft
    occupancy; fp32, fp64 for a float64 module), ``length`` tokens seen; ``config``
    the building module's (mode, heads, slots, head_dim). Start one with
    :meth:`StackMemory.empty_cache`. The state has a fixed size, so a step costs O(1)
    whatever the length. A forward never changes the cache it is given; it returns a
    new one, so two continuations of one cache (beam search) are independent.
    """

    def __init__(self, config, stack: torch.Tensor, stack_mask: torch.Tensor, length: int = 0) -> None:
        self.config = dict(config)
        self.stack, self.stack_mask, self._length = stack, stack_mask, length

    @property
    def length(self) -> int:
        return self._length

    @property
    def batch(self) -> int:
        return self.stack.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.stack.dtype

    @property
    def device(self) -> torch.device:
        return self.stack.device

    def reset(self) -> None:
        """Back to the empty stack (new tensors: caches sharing the old ones keep them)."""
        self.stack = torch.zeros_like(self.stack)
        self.stack_mask = torch.zeros_like(self.stack_mask)
        self._length = 0

    def clone(self) -> "StackMemoryCache":
        return StackMemoryCache(self.config, self.stack.clone(), self.stack_mask.clone(), self._length)


class StackMemoryOutput(NamedTuple):
    """What :class:`StackMemory` returns: ``output, cache`` first, as every decoding block."""

    output: torch.Tensor                 # [B, T, D] the augmented branch input, x's dtype
    cache: StackMemoryCache | None       # temporal mode: the stack after the last token; depth mode: None
    state: StackMemoryState              # for the next layer (depth stack, entropy sums)


# ----------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------

_warned_sizes: set = set()


class StackMemory(nn.Module):
    """StackMemory for one decoder layer (NeoLLM ``use_stack_memory``).

    Args (the NeoLLM configuration keys and signature defaults):
        hidden_size: D.
        stack_d_model: H·d, the low-rank stack width (default 24, d = 6).
        num_mem_heads: H, must divide ``stack_d_model`` (default 4).
        stack_slots: S (default 16).
        stack_memory_cache_size: kept for configuration parity with the released code,
            whose cache never affects outputs; unused.
        stack_entropy_loss_weight: λ_St ≥ 0 for :meth:`aux_loss` (default 1e-3).
        mode: "depth" (default) or "temporal".
        read_mode: "soft" (paper Eq. 4, default) or "released" (the −10⁹·(1 − M) read).
        bias: biases on ``action_head``, ``down_proj`` and ``up_proj`` (zero init),
            as in the released code with ``include_bias``; default False.
        backend: "auto" | "triton" | "reference".

    Parameters: ``action_head`` Linear(D → 3H), ``down_proj`` Linear(D → H·d),
    ``up_proj`` Linear(H·d → D), all N(0, 0.02²); ``gate`` [d] N(0, 0.02²);
    ``res_weight`` [] = 1. Count without bias 2·D·H·d + 3H·D + d + 1.

    ``forward(x, attention_mask=None, cache=None, *, state=None) -> StackMemoryOutput(output, cache, state)``:
    ``x`` ``[B, T, D]`` fp32/bf16/fp16 (the parameters' dtype, or any under autocast),
    the attention-branch input (the residual stream is left to the caller);
    ``attention_mask`` an optional ``(B, T)`` keep mask; ``cache`` (temporal mode only)
    a :class:`StackMemoryCache` from :meth:`empty_cache` or a previous call; ``state``
    the previous layer's :class:`StackMemoryState` (None before the first layer).
    Returns ``output`` ``[B, T, D]`` in x's dtype; ``cache`` (None for ``cache=None``;
    otherwise the stack after this call's last token, a fixed ``[B, H, S, d]``; depth
    mode takes no cache: tokens share no state); ``state`` for the next layer.

    Example::

        layers = [StackMemory(512) for _ in range(12)]
        state = None
        for layer, block in zip(layers, blocks):
            h_aug, _, state = layer(norm(h), attention_mask, state=state)
            h = h + block(h_aug)
        loss = lm_loss + layers[0].aux_loss(state)
    """

    def __init__(
        self,
        hidden_size: int,
        stack_d_model: int = 24,
        num_mem_heads: int = 4,
        stack_slots: int = 16,
        stack_memory_cache_size: int = 2048,
        stack_entropy_loss_weight: float = 1e-3,
        mode: str = "depth",
        read_mode: str = "soft",
        bias: bool = False,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("stack_d_model", stack_d_model),
                            ("num_mem_heads", num_mem_heads), ("stack_slots", stack_slots),
                            ("stack_memory_cache_size", stack_memory_cache_size)):
            check_positive_int(name, value)
        if stack_d_model % num_mem_heads:
            raise ConfigError(f"`stack_d_model` must be divisible by `num_mem_heads`, got "
                              f"stack_d_model={stack_d_model}, num_mem_heads={num_mem_heads}")
        lam = stack_entropy_loss_weight
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
            raise ConfigError(f"`stack_entropy_loss_weight` must be finite and >= 0, got {lam!r}")
        check_choice("mode", mode, MODES)
        check_choice("read_mode", read_mode, READ_MODES)
        check_backend(backend)
        self.hidden_size, self.stack_d_model, self.num_mem_heads = hidden_size, stack_d_model, num_mem_heads
        self.stack_slots, self.stack_memory_cache_size = stack_slots, stack_memory_cache_size
        self.stack_entropy_loss_weight = float(lam)
        self.head_dim = stack_d_model // num_mem_heads
        self.mode, self.read_mode, self.backend = mode, read_mode, backend
        self.action_head = nn.Linear(hidden_size, 3 * num_mem_heads, bias=bias)
        self.down_proj = nn.Linear(hidden_size, stack_d_model, bias=bias)
        self.up_proj = nn.Linear(stack_d_model, hidden_size, bias=bias)
        self.gate = nn.Parameter(torch.empty(self.head_dim))
        self.res_weight = nn.Parameter(torch.ones(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in (self.action_head.weight, self.down_proj.weight, self.up_proj.weight, self.gate):
            nn.init.normal_(p, mean=0.0, std=0.02)
        for layer in (self.action_head, self.down_proj, self.up_proj):
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)
        with torch.no_grad():
            self.res_weight.fill_(1.0)

    @property
    def config(self) -> tuple:
        return (self.mode, self.num_mem_heads, self.stack_slots, self.head_dim)

    @property
    def cache_config(self) -> dict:
        return dict(zip(("mode", "num_mem_heads", "stack_slots", "head_dim"), self.config))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, stack_d_model={self.stack_d_model}, "
                f"num_mem_heads={self.num_mem_heads}, stack_slots={self.stack_slots}, mode={self.mode!r}, "
                f"read_mode={self.read_mode!r}, stack_entropy_loss_weight={self.stack_entropy_loss_weight}, "
                f"backend={self.backend!r}")

    def aux_loss(self, state: StackMemoryState) -> torch.Tensor:
        """λ_St · mean entropy over kept tokens × heads × layers (add it to the LM loss)."""
        return self.stack_entropy_loss_weight * state.entropy_mean()

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> StackMemoryCache:
        """An empty temporal-mode cache for ``batch`` sequences on ``device`` (default:
        the parameters'). ``dtype`` (default: the parameters') is the activations'; the
        stack is kept in fp32 (fp64 for float64), as the recurrence computes."""
        if self.mode != "temporal":
            raise ConfigError("`empty_cache` is for mode='temporal'; in depth mode tokens share no state, "
                              "so a new token runs its own depth recurrence with cache=None")
        check_positive_int("batch", batch)
        dtype = self.gate.dtype if dtype is None else dtype
        if dtype not in FLOAT_DTYPES:
            raise DTypeError(f"`dtype` of a StackMemoryCache must be a float dtype, got {dtype}")
        device = self.gate.device if device is None else device
        H, S, d = self.num_mem_heads, self.stack_slots, self.head_dim
        state_dtype = _state_dtype(dtype)
        return StackMemoryCache(self.cache_config, torch.zeros(batch, H, S, d, dtype=state_dtype, device=device),
                                torch.zeros(batch, H, S, dtype=state_dtype, device=device))

    # -- validation -----------------------------------------------------------

    def _check(self, x, attention_mask, cache, state) -> None:
        check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES, layout="[batch, seq, hidden]")
        B, T, D = x.shape
        if D != self.hidden_size:
            raise ShapeError(f"last dim of `x` must be hidden_size={self.hidden_size}, got shape {tuple(x.shape)}")
        check_has_tokens("x", x)
        check_same_device(x=x, weight=self.action_head.weight)
        check_param_dtype("x", x, self.action_head.weight)
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"`attention_mask` must be a torch.Tensor or None, got {type(attention_mask).__name__}")
        check_keep_mask("attention_mask", attention_mask, B, T)
        check_same_device(x=x, attention_mask=attention_mask)
        if state is not None:
            self._check_state(state, B, T, x.device)
        if cache is not None:
            self._check_cache(cache, x)

    def _check_state(self, state, B, T, device) -> None:
        if not isinstance(state, StackMemoryState):
            raise TypeError(f"`state` must be a StackMemoryState or None, got {type(state).__name__}")
        if state.config != self.config:
            raise ConfigError(f"`state` comes from another StackMemory configuration: expected (mode, heads, "
                              f"slots, head_dim) = {self.config}, got {state.config}")
        if state.stack is not None:
            want = (B, T, self.num_mem_heads, self.stack_slots, self.head_dim)
            if tuple(state.stack.shape) != want or tuple(state.stack_mask.shape) != want[:-1]:
                raise ShapeError(f"`state.stack` must be [batch, seq, heads, slots, head_dim] = {want} and "
                                 f"`state.stack_mask` {want[:-1]}, got {tuple(state.stack.shape)} and "
                                 f"{tuple(state.stack_mask.shape)}")
            if state.stack.dtype != torch.float32 and state.stack.dtype != torch.float64:
                raise DTypeError(f"`state.stack` must be float32 (or float64), got {state.stack.dtype}")
            if state.stack.device != device:
                raise DeviceError(f"`state.stack` is on {state.stack.device} but `x` is on {device}")

    def _check_cache(self, cache, x) -> None:
        if self.mode != "temporal":
            raise ConfigError("`cache` is for mode='temporal'; depth mode keeps no cross-token state")
        check_cache(cache, StackMemoryCache, self.cache_config, batch=x.shape[0], dtype=_state_dtype(x.dtype),
                    device=x.device, cache_dtype=getattr(cache, "dtype", None),
                    cache_device=getattr(cache, "device", None))

    # -- forward --------------------------------------------------------------

    def _params(self):
        bias = (lambda layer: layer.bias)
        return (self.action_head.weight, self.down_proj.weight, self.up_proj.weight, self.gate, self.res_weight,
                bias(self.action_head), bias(self.down_proj), bias(self.up_proj))

    def _function(self, x):
        if resolve_backend(self.backend, x) == "triton":
            from laminae.triton_ops.stack_memory import stack_memory, supports

            if self.backend == "triton" or supports(self.stack_slots, self.head_dim, self.mode):
                return stack_memory
            key = (self.stack_slots, self.head_dim, self.mode)
            if key not in _warned_sizes:
                _warned_sizes.add(key)
                warnings.warn(f"laminae: StackMemory(stack_slots={key[0]}, head_dim={key[1]}, mode={key[2]!r}) is "
                              "beyond the Triton tile limit; backend='auto' runs the reference", stacklevel=3)
        return stack_memory_reference

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: StackMemoryCache | None = None,
        *,
        state: StackMemoryState | None = None,
    ) -> StackMemoryOutput:
        self._check(x, attention_mask, cache, state)
        B, T, _ = x.shape
        attention_mask = check_keep_mask("attention_mask", attention_mask, B, T)
        fn = self._function(x)
        w_a, w_down, w_up, gate, g, b_a, b_down, b_up = self._params()
        if self.mode == "depth":
            stack = None if state is None else state.stack
            stack_mask = None if state is None else state.stack_mask
        else:
            stack = None if cache is None else cache.stack
            stack_mask = None if cache is None else cache.stack_mask
        # The state, softmaxes and read are fp32 by design; autocast must not recast them.
        with without_autocast(x.device.type):
            out, new_stack, new_mask, entropy = fn(
                x, w_a, w_down, w_up, gate, g, stack, stack_mask, attention_mask, b_a, b_down, b_up,
                num_heads=self.num_mem_heads, num_slots=self.stack_slots, mode=self.mode, read_mode=self.read_mode)
        count = entropy.new_tensor(float(B * T * self.num_mem_heads)) if attention_mask is None else \
            attention_mask.to(entropy.dtype).sum() * self.num_mem_heads
        prev_sum = 0 if state is None else state.entropy_sum
        prev_count = 0 if state is None else state.entropy_count
        new_state = StackMemoryState(
            self.config,
            new_stack if self.mode == "depth" else None,
            new_mask if self.mode == "depth" else None,
            prev_sum + entropy.sum(), prev_count + count, (0 if state is None else state.num_layers) + 1)
        new_cache = None
        if cache is not None:
            # detached: decoding is inference (differentiate through state with the functional op)
            new_cache = StackMemoryCache(self.cache_config, new_stack.detach(), new_mask.detach(), cache.length + T)
        return StackMemoryOutput(out, new_cache, new_state)
