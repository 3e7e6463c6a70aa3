"""MoM read: Mixture-of-Memory read over a shared, model-level memory bank (Naylis).

One routing decision per token. With ``x`` ``[B, S, D]`` (the ``mom_norm`` output) and
the bank ``M_blocks`` ``[E, bs·D]`` (owned by the model, shared by every layer):

    h_t     = mean(x_0..x_t)                       causal prefix mean, fp32
    z_t     = W_up · tanh(W_down · h_t)            low-rank router logits [E], fp32
    z̃_t     = z_t + noise_scale · Gumbel          training only
    (v, i)  = top-Tk(z̃_t)                          selected blocks, distinct
    g_t     = softmax(v)                           gates over the selected blocks
    q       = x W_qᵀ;  K = M_slots W_kᵀ,  V = M_slots W_vᵀ     (M_slots = M viewed [E·bs, D])
    o       = softmax(q·Kᵀ/√hd + bias) V           bias = log(max(g, 1e-9)) on the slots of a
                                                   selected block, finfo.min elsewhere
    y       = mom_scale · W_o · o                  ``mom_scale`` starts at 0

Load-balance aux loss per layer (training): E · Σ_e frac_e · p̄_e with frac_e the share
of tokens whose noisy top-k picked block e and p̄_e the mean clean router probability.

The reference read builds the seed's dense per-token bias ``[B, S, E·bs]``; the Triton
read (``laminae.triton_ops.mom_read``) touches only the ``Tk·bs`` selected slots.
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._backend import Backend, check_backend, resolve_backend
from ._cache import DecodingCache, check_cache
from ._errors import ConfigError, DTypeError, ShapeError
from ._outputs import BlockOutput
from ._validation import (FLOAT_DTYPES, check_has_tokens, check_keep_mask, check_param_dtype, check_positive_int,
                          check_same_device, check_tensor, match_activation_dtypes, without_autocast, zero_padding)

__all__ = [
    "GATE_FLOOR",
    "mom_prefix_mean",
    "mom_router_logits",
    "mom_route",
    "mom_gate_bias",
    "mom_log_gates",
    "mom_read_reference",
    "mom_load_balance_loss",
    "collect_mom_aux_loss",
    "MoMRouting",
    "MoMAuxStats",
    "MoMReadCache",
    "MoMRead",
]

GATE_FLOOR = 1e-9  # gates are clamped to this before the log (bias log(1e-9) ≈ -20.7)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32/bf16/fp16, fp64 for fp64 (so gradcheck runs in double)."""
    return torch.promote_types(dtype, torch.float32)


# ----------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------


def mom_prefix_mean(x: torch.Tensor, prefix_sum: torch.Tensor | None = None, count: int = 0,
                    attention_mask: torch.Tensor | None = None,
                    prefix_kept: torch.Tensor | None = None) -> torch.Tensor:
    """Causal prefix mean ``h_t = mean(x_0..x_t)`` in fp32 (fp64 for fp64 input).

    ``x`` ``[B, S, D]``. With ``prefix_sum`` ``[B, D]`` (the fp32 sum of the ``count``
    tokens before this chunk) the chunk continues a running mean: decoding. With a
    ``(B, S)`` ``attention_mask`` (keep mask) the mean runs over kept tokens only
    (``prefix_kept`` ``[B]``: kept tokens before this chunk); a position with no kept
    token so far gets 0.
    """
    xc = x.to(_compute_dtype(x.dtype))
    keep = attention_mask
    if keep is not None:
        xc = torch.where(keep.to(x.device).bool()[..., None], xc, torch.zeros((), dtype=xc.dtype, device=x.device))
    cs = torch.cumsum(xc, dim=1)
    if prefix_sum is not None:
        cs = cs + prefix_sum.to(cs.dtype).unsqueeze(1)
    if keep is None and prefix_kept is None:
        denom = torch.arange(count + 1, count + x.shape[1] + 1, device=x.device, dtype=cs.dtype)
        return cs / denom.view(1, -1, 1)
    kept = torch.ones(x.shape[:2], dtype=cs.dtype, device=x.device) if keep is None else keep.to(x.device, cs.dtype)
    before = prefix_kept.to(cs.dtype)[:, None] if prefix_kept is not None else float(count)
    return cs / (before + torch.cumsum(kept, dim=1)).clamp_min(1.0)[..., None]


def mom_router_logits(h: torch.Tensor, router_down_weight: torch.Tensor,
                      router_up_weight: torch.Tensor) -> torch.Tensor:
    """``W_up · tanh(W_down · h)`` with h cast to the router weight dtype, returned in fp32."""
    h = h.to(router_down_weight.dtype)
    z = F.linear(torch.tanh(F.linear(h, router_down_weight)), router_up_weight)
    return z.to(_compute_dtype(z.dtype))


class MoMRouting(NamedTuple):
    probs: torch.Tensor      # [B, S, E] softmax of the clean logits (aux loss)
    top_idx: torch.Tensor    # [B, S, Tk] int64, selected blocks (from the noisy logits), descending
    top_gates: torch.Tensor  # [B, S, Tk] softmax over the selected (noisy) logits


def mom_route(logits: torch.Tensor, top_blocks: int, *, noise_scale: float = 0.0,
              generator: torch.Generator | None = None) -> MoMRouting:
    """Gumbel-noised top-k routing with softmax gates.

    ``noise_scale > 0`` draws ``U ~ Uniform[0, 1)`` with the shape of ``logits`` (the
    same draw as the seed's ``rand_like``) and adds ``noise_scale · (−log(−log(U + 1e-9)
    + 1e-9))``. Probabilities come from the clean logits; gates keep their gradient
    through the selected values (the noise is a constant).
    """
    if noise_scale > 0:
        u = torch.rand(logits.shape, generator=generator, dtype=logits.dtype, device=logits.device)
        gumbel = -torch.log(-torch.log(u + 1e-9) + 1e-9)
        noisy = logits + noise_scale * gumbel
    else:
        noisy = logits
    probs = F.softmax(logits, dim=-1)
    top_values, top_idx = noisy.topk(top_blocks, dim=-1)
    return MoMRouting(probs, top_idx, F.softmax(top_values, dim=-1))


# ----------------------------------------------------------------------------
# Read
# ----------------------------------------------------------------------------


def mom_log_gates(top_gates: torch.Tensor, bias_in_activation_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``log(max(g, 1e-9))`` in fp32 (fp64 for fp64 gates). With
    ``bias_in_activation_dtype`` set to a dtype, the log-gates are rounded to it
    (the seed's eager numerics, where the bias is cast to the query dtype)."""
    lg = torch.log(top_gates.to(_compute_dtype(top_gates.dtype)).clamp_min(GATE_FLOOR))
    if bias_in_activation_dtype is not None:
        lg = lg.to(bias_in_activation_dtype).to(lg.dtype)
    return lg


def mom_gate_bias(top_idx: torch.Tensor, top_gates: torch.Tensor, num_blocks: int, block_size: int,
                  mask_dtype: torch.dtype) -> torch.Tensor:
    """The seed's dense per-token slot bias ``[B, S, E·bs]``.

    Selected block e of a token holds that block's log-gate ``log(max(g, 1e-9))``
    (one-hot × log-gates), every other block ``finfo(mask_dtype).min``; each block
    value is repeated over its ``block_size`` slots. fp32 (fp64 for fp64 gates).
    """
    lg = mom_log_gates(top_gates)
    onehot = F.one_hot(top_idx.long(), num_blocks).to(lg.dtype)          # [B, S, Tk, E]
    block_lg = (onehot * lg.unsqueeze(-1)).sum(dim=-2)                    # [B, S, E]
    selected = onehot.sum(dim=-2) > 0
    masked = torch.full((), torch.finfo(mask_dtype).min, dtype=lg.dtype, device=lg.device)
    block_bias = torch.where(selected, block_lg, masked)
    return block_bias.repeat_interleave(block_size, dim=-1)


def _read_dims(q: torch.Tensor, k_bank: torch.Tensor, block_size: int):
    B, S, H, hd = q.shape
    slots = k_bank.shape[0]
    return B, S, H, hd, slots, slots // block_size


def mom_read_reference(
    q: torch.Tensor,
    k_bank: torch.Tensor,
    v_bank: torch.Tensor,
    top_idx: torch.Tensor,
    top_gates: torch.Tensor,
    block_size: int,
    bias_in_activation_dtype: bool = False,
    *,
    gathered: bool = False,
) -> torch.Tensor:
    """Dense masked read (the seed's eager path), computed in fp32.

    Args:
        q: queries ``[B, S, H, hd]``.
        k_bank, v_bank: bank keys/values ``[E·bs, H·hd]`` (head h at columns h·hd..),
            shared by the whole batch.
        top_idx: ``[B, S, Tk]`` integer, distinct block indices per token.
        top_gates: ``[B, S, Tk]`` gates of the selected blocks.
        block_size: slots per block (bs).
        bias_in_activation_dtype: round the log-gates to ``q``'s dtype first (the
            seed's eager numerics under bf16; spec open point 1). Off: fp32 log-gates.
        gathered: read over the gathered ``Tk·bs`` selected slots of each token
            instead (no dense bias; unselected bank rows are never touched): the same
            result up to fp reassociation; it holds a ``[B, S, Tk, bs, H, hd]`` gather,
            so it is a readable second oracle rather than a memory saver.
    Returns:
        ``o`` ``[B, S, H, hd]`` in ``q``'s dtype.
    """
    B, S, H, hd, slots, E = _read_dims(q, k_bank, block_size)
    compute = _compute_dtype(q.dtype)
    if gathered:
        lg = mom_log_gates(top_gates, q.dtype if bias_in_activation_dtype else None).to(compute)
        idx = top_idx.long()
        k = k_bank.to(compute).view(E, block_size, H, hd)[idx]              # [B, S, Tk, bs, H, hd]
        v = v_bank.to(compute).view(E, block_size, H, hd)[idx]
        scores = torch.einsum("bshd,bstjhd->bshtj", q.to(compute), k) / math.sqrt(hd)
        scores = scores + lg[:, :, None, :, None]
        probs = torch.softmax(scores.flatten(-2), dim=-1).view_as(scores)
        return torch.einsum("bshtj,bstjhd->bshd", probs, v).to(q.dtype)
    bias = mom_gate_bias(top_idx, top_gates, E, block_size, q.dtype)
    if bias_in_activation_dtype:
        bias = bias.to(q.dtype)
    k = k_bank.to(compute).view(slots, H, hd)
    v = v_bank.to(compute).view(slots, H, hd)
    scores = torch.einsum("bshd,lhd->bhsl", q.to(compute), k) / math.sqrt(hd)
    probs = torch.softmax(scores + bias.to(compute).unsqueeze(1), dim=-1)
    return torch.einsum("bhsl,lhd->bshd", probs, v).to(q.dtype)


# ----------------------------------------------------------------------------
# Aux loss
# ----------------------------------------------------------------------------


class MoMAuxStats(NamedTuple):
    aux: torch.Tensor        # E · Σ_e frac_e · p̄_e (differentiable through the probabilities)
    entropy: torch.Tensor    # mean router entropy (detached)
    dead_frac: torch.Tensor  # fraction of blocks no row selected (detached)


def mom_load_balance_loss(router_probs: torch.Tensor, top_idx: torch.Tensor, num_blocks: int) -> MoMAuxStats:
    """The seed's load-balance loss of one layer and its diagnostics.

    ``router_probs`` ``[N, E]`` (clean softmax), ``top_idx`` ``[N, Tk]`` (noisy
    selection), N = B·S rows, all tokens. The selection mask is built by comparison
    (no scatter), so ``frac`` carries no gradient.
    """
    probs = router_probs.float() if router_probs.dtype != torch.float64 else router_probs
    blocks = torch.arange(num_blocks, device=top_idx.device)
    sel_mask = (top_idx.unsqueeze(2) == blocks.view(1, 1, -1)).any(1)   # [N, E]
    frac_selected = sel_mask.to(probs.dtype).mean(dim=0)
    mean_prob = probs.mean(dim=0)
    aux = num_blocks * (frac_selected * mean_prob).sum()
    entropy = -(probs * probs.clamp_min(1e-9).log()).sum(-1).mean()
    dead_frac = (~sel_mask.any(0)).to(probs.dtype).mean()
    return MoMAuxStats(aux, entropy.detach(), dead_frac.detach())


def collect_mom_aux_loss(modules: Iterable[nn.Module], device: torch.device | str | None = None,
                         accum_steps: int | None = None) -> torch.Tensor:
    """Average the load-balance loss over every :class:`MoMRead` in ``modules`` that
    stashed routing stats (training forwards), record ``last_entropy`` /
    ``last_dead_frac`` on each, and clear the stashes (the seed's
    ``_collect_mom_aux_loss``). ``accum_steps`` divides the result (the seed's
    ``mom_aux_normalize``). Returns a 0-dim fp32 tensor (0 when no layer had stats)."""
    if accum_steps is not None:
        check_positive_int("accum_steps", accum_steps)
    aux = torch.zeros((), device=device, dtype=torch.float32)
    count = 0
    for module in modules:
        if not isinstance(module, MoMRead):
            continue
        if module.last_router_probs is None or module.last_top_idx is None:
            continue
        stats = mom_load_balance_loss(module.last_router_probs, module.last_top_idx, module.num_blocks)
        aux = aux + stats.aux
        module.last_entropy, module.last_dead_frac = stats.entropy, stats.dead_frac
        module.last_router_probs = module.last_top_idx = None
        count += 1
    if count > 0:
        aux = aux / count
    if accum_steps is not None:
        aux = aux / accum_steps
    return aux


# ----------------------------------------------------------------------------
# Decoding state
# ----------------------------------------------------------------------------


class MoMReadCache(DecodingCache):
    """What the router of a new token needs (the bank read has no per-token cache):
    ``prefix_sum`` ``[B, D]``, the running sum of the layer inputs seen so far (fp32;
    fp64 for a float64 module), ``length`` their count, and ``kept_count`` ``[B]`` the
    kept tokens among them (None while no padding mask was passed: all kept). Start
    one with :meth:`MoMRead.empty_cache`; a call never changes the cache it was given.

    Example::

        cache = mom.empty_cache(batch)
        out, cache = mom(x_prompt, cache=cache, M_blocks=bank)     # prefill
        out, cache = mom(x_next, cache=cache, M_blocks=bank)       # one token at a time
    """

    def __init__(self, prefix_sum: torch.Tensor, length: int = 0, config: dict | None = None,
                 kept_count: torch.Tensor | None = None) -> None:
        self.prefix_sum, self._length, self.config = prefix_sum, int(length), dict(config or {})
        self.kept_count = kept_count

    @property
    def length(self) -> int:
        return self._length

    @property
    def batch(self) -> int:
        return self.prefix_sum.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.prefix_sum.dtype

    @property
    def device(self) -> torch.device:
        return self.prefix_sum.device

    def reset(self) -> None:
        self.prefix_sum, self._length, self.kept_count = torch.zeros_like(self.prefix_sum), 0, None

    def clone(self) -> "MoMReadCache":
        kept = None if self.kept_count is None else self.kept_count.clone()
        return MoMReadCache(self.prefix_sum.clone(), self._length, self.config, kept)


# ----------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------


class MoMRead(nn.Module):
    """Mixture-of-Memory read of one decoder layer over a shared bank (the seed's ``MoMLayer``).

    Args:
        hidden_size: D (= num_heads · head_dim).
        num_heads: H of the query stream.
        mem_size: bank size in slots; the bank holds E = mem_size / block_size blocks.
        block_size: bs, slots per block (the routing granularity).
        top_blocks: Tk, blocks read per token (1 ≤ Tk ≤ E).
        router_rank: r, bottleneck of the router (D → r → E).
        initializer_range: std of the N(0, σ²) init of every linear (HF Llama's 0.02).
        noise_scale: Gumbel noise scale in training (the trainer anneals it to 0).
        bias_in_activation_dtype: round the log-gates to the activation dtype (seed's
            eager numerics under bf16); default fp32 log-gates (spec open point 1).
        backend: "auto" | "triton" | "reference".

    Parameters (the seed's names, so ``MoMLayer`` checkpoints load strictly):
    ``router_down.weight`` [r, D], ``router_up.weight`` [E, r], ``q_proj/k_proj/v_proj/
    o_proj.weight`` [D, D], ``mom_scale`` [1] (zero: the layer outputs 0 at init).
    The bank ``M_blocks`` [E, bs·D] belongs to the model and is passed to ``forward``
    (init it with :meth:`init_bank`). ``mom_norm`` belongs to the decoder layer.

    Training forwards stash ``last_router_probs`` [B·S, E] and ``last_top_idx``
    [B·S, Tk] for :func:`collect_mom_aux_loss`, which also fills ``last_entropy`` and
    ``last_dead_frac``.

    Example::

        bank = nn.Parameter(MoMRead.init_bank(num_blocks=8, block_size=128, hidden_size=1024))
        mom = MoMRead(1024, 16, mem_size=1024, block_size=128, top_blocks=2, router_rank=32)
        y, _ = mom(mom_norm(x), M_blocks=bank)
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mem_size: int,
        block_size: int,
        top_blocks: int,
        router_rank: int,
        initializer_range: float = 0.02,
        noise_scale: float = 1.0,
        bias_in_activation_dtype: bool = False,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("mem_size", mem_size),
                            ("block_size", block_size), ("top_blocks", top_blocks),
                            ("router_rank", router_rank)):
            check_positive_int(name, value)
        check_backend(backend)
        if hidden_size % num_heads:
            raise ConfigError(f"`hidden_size` ({hidden_size}) must be divisible by `num_heads` ({num_heads})")
        if mem_size % block_size:
            raise ConfigError(f"`mem_size` ({mem_size}) must be a multiple of `block_size` ({block_size})")
        if top_blocks > mem_size // block_size:
            raise ConfigError(f"`top_blocks` ({top_blocks}) exceeds the number of memory blocks "
                              f"({mem_size // block_size} = mem_size {mem_size} // block_size {block_size})")
        if not initializer_range >= 0:
            raise ConfigError(f"`initializer_range` must be >= 0, got {initializer_range!r}")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, hidden_size // num_heads
        self.mem_slots, self.block_size, self.num_blocks = mem_size, block_size, mem_size // block_size
        self.top_blocks, self.router_rank = top_blocks, router_rank
        self.bias_in_activation_dtype = bool(bias_in_activation_dtype)
        self.backend = backend
        self.noise_scale = noise_scale

        self.router_down = nn.Linear(hidden_size, router_rank, bias=False)
        self.router_up = nn.Linear(router_rank, self.num_blocks, bias=False)
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mom_scale = nn.Parameter(torch.zeros(1))
        for lin in (self.router_down, self.router_up, self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=initializer_range)

        self.last_router_probs: torch.Tensor | None = None
        self.last_top_idx: torch.Tensor | None = None
        self.last_entropy: torch.Tensor | None = None
        self.last_dead_frac: torch.Tensor | None = None

    @property
    def noise_scale(self) -> float:
        return self._noise_scale

    @noise_scale.setter
    def noise_scale(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"`noise_scale` must be a number >= 0, got {value!r}")
        self._noise_scale = float(value)

    @staticmethod
    def init_bank(num_blocks: int, block_size: int, hidden_size: int, std: float = 0.02,
                  generator: torch.Generator | None = None) -> torch.Tensor:
        """The model-level bank ``M_blocks`` ``[E, bs·D]`` drawn N(0, std²) (seed: randn · 0.02)."""
        return torch.randn(num_blocks, block_size * hidden_size, generator=generator) * std

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size}, top_blocks={self.top_blocks}, router_rank={self.router_rank}, "
                f"backend={self.backend!r}")

    def _cache_config(self) -> dict:
        return {"hidden_size": self.hidden_size}

    def empty_cache(self, batch: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> MoMReadCache:
        """An empty decoding cache for ``batch`` sequences on ``device`` (default: the
        parameters'). ``dtype`` (default: the parameters') is the activations'; the
        running sum is kept in fp32 (fp64 for float64)."""
        check_positive_int("batch", batch)
        dtype = self.q_proj.weight.dtype if dtype is None else dtype
        if dtype not in FLOAT_DTYPES:
            raise DTypeError(f"`dtype` of a MoMReadCache must be a float dtype, got {dtype}")
        device = self.q_proj.weight.device if device is None else device
        zeros = torch.zeros(batch, self.hidden_size, dtype=_compute_dtype(dtype), device=device)
        return MoMReadCache(zeros, 0, self._cache_config())

    def _check(self, x: torch.Tensor, M_blocks: torch.Tensor | None, cache: MoMReadCache | None) -> None:
        check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES, layout="(batch, seq, hidden)")
        if x.shape[-1] != self.hidden_size:
            raise ShapeError(f"last dim of `x` must be hidden_size={self.hidden_size}, got shape {tuple(x.shape)}")
        check_has_tokens("x", x)
        if M_blocks is None:
            raise ConfigError("`M_blocks` is required: the MoM read cannot run without the shared memory bank")
        check_tensor("M_blocks", M_blocks, shape=(self.num_blocks, self.block_size * self.hidden_size),
                     dtypes=FLOAT_DTYPES, layout="(num_blocks, block_size * hidden_size)")
        check_same_device(x=x, M_blocks=M_blocks, weight=self.q_proj.weight)
        check_param_dtype("x", x, self.q_proj.weight)
        check_param_dtype("M_blocks", M_blocks, self.k_proj.weight)
        if cache is not None:
            check_cache(cache, MoMReadCache, self._cache_config(), batch=x.shape[0],
                        dtype=_compute_dtype(x.dtype), device=x.device, cache_dtype=getattr(cache, "dtype", None),
                        cache_device=getattr(cache, "device", None))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: MoMReadCache | None = None, *, M_blocks: torch.Tensor) -> BlockOutput:
        """``x`` ``[B, S, D]`` (the ``mom_norm`` output), ``attention_mask`` an optional
        ``(B, S)`` keep mask: the router's prefix mean then runs over kept tokens only
        (padding never reaches a kept token; the load-balance statistics still count
        every row), ``M_blocks`` ``[E, bs·D]`` the model's bank (required, by name).
        Returns ``BlockOutput(output [B, S, D], cache)``: ``cache=None`` returns None;
        a cache from :meth:`empty_cache` or an earlier call comes back as a new cache
        that holds these tokens too (the one passed in is unchanged)."""
        self._check(x, M_blocks, cache)
        B, S, D = x.shape
        check_same_device(x=x, attention_mask=attention_mask)
        attention_mask = check_keep_mask("attention_mask", attention_mask, B, S)
        (x,) = zero_padding(attention_mask, x)
        prefix_sum, count = (cache.prefix_sum, cache.length) if cache is not None else (None, 0)
        prefix_kept = cache.kept_count if cache is not None else None
        h = mom_prefix_mean(x, prefix_sum, count, attention_mask, prefix_kept)
        # Router first, before any read computation: the Gumbel draw sits at the same
        # point of the RNG stream as in the seed.
        logits = mom_router_logits(h, self.router_down.weight, self.router_up.weight)
        noise = self.noise_scale if self.training else 0.0
        routing = mom_route(logits, self.top_blocks, noise_scale=noise)
        if self.training:
            self.last_router_probs = routing.probs.reshape(-1, self.num_blocks)
            self.last_top_idx = routing.top_idx.reshape(-1, self.top_blocks)

        q = F.linear(x, self.q_proj.weight).view(B, S, self.num_heads, self.head_dim)
        slots = M_blocks.view(self.mem_slots, D)
        k_bank = F.linear(slots, self.k_proj.weight)
        v_bank = F.linear(slots, self.v_proj.weight)
        q, k_bank, v_bank = match_activation_dtypes(q=q, k_bank=k_bank, v_bank=v_bank)
        if resolve_backend(self.backend, q, k_bank, v_bank) == "triton":
            from laminae.triton_ops.mom_read import mom_read as read
        else:
            read = mom_read_reference
        with without_autocast(x.device.type):
            o = read(q, k_bank, v_bank, routing.top_idx, routing.top_gates, self.block_size,
                     self.bias_in_activation_dtype)
        y = self.mom_scale * F.linear(o.reshape(B, S, D), self.o_proj.weight)
        return BlockOutput(y, None if cache is None else self._advance(cache, x, attention_mask))

    @torch.no_grad()
    def _advance(self, cache: MoMReadCache, x: torch.Tensor, attention_mask: torch.Tensor | None) -> MoMReadCache:
        """``cache`` plus the tokens of ``x`` (padding already zeroed): the last row of
        the prefix mean's cumulative sum, prefix_sum + Σ x."""
        B, S, _ = x.shape
        running = cache.prefix_sum + x.to(cache.dtype).sum(dim=1)
        kept = None
        if attention_mask is not None or cache.kept_count is not None:
            new = (torch.full((B,), float(S), device=x.device) if attention_mask is None
                   else attention_mask.to(x.device, torch.float32).sum(1))
            kept = new + (cache.kept_count if cache.kept_count is not None else float(cache.length))
        return MoMReadCache(running, cache.length + S, self._cache_config(), kept)
