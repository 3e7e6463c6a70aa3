"""Token-choice top-k mixture of SwiGLU experts (DeepSeek/SpikeWhale form).

Per token x (flattened ``T = B·S`` rows):

    z       = router(x)                                        [T, E]
    s       = softmax(z)  or  sqrt(softplus(z) + 1e-8)         scoring
    (w, e)  = top-k(s);  w ← w / (Σw + 1e-8) if normalised;  w ← w · routed_scaling_factor
    hash routing instead (the first layers of a model): e_j = (position_id + j) mod E, w = 1/k
    y       = Σ_j w_j · expert_{e_j}(x)  +  shared(x) / n_shared

Aux loss (routed layers only): ``coef · E · Σ_e f_e · p̄_e`` with f_e the share of
tokens whose top-k holds e and p̄_e the mean softmax(z) (whatever the scoring).

Dispatch is sort-based and loop-free: the (token, slot) pairs are sorted by expert,
each pair gets its rank inside its expert's group, the rows are scattered into a
``[E, T, H]`` buffer (capacity T: a token never picks one expert twice), the experts
run as one batched matmul over stacked weights, and the results are gathered back and
summed per token with ``index_add``. No host synchronisation and no Python loop over
experts; the price is an ``E·T·H`` buffer and E/k times the routed matmul work (static
shapes instead of a host sync), fine at the sizes recipes train on CPU.
(A grouped GEMM — ``torch._grouped_mm`` on Hopper — would take the sorted rows
directly; it is not used here because its CPU path is not reliable in torch 2.13.)
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import ConfigError, ShapeError
from .._validation import check_choice, check_positive_int
from .swiglu import SwiGLU

__all__ = ["GroupedSwiGLU", "MoEOutput", "SparseMoE", "moe_route", "sqrt_softplus"]


def sqrt_softplus(z: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(F.softplus(z) + 1e-8)


class GroupedSwiGLU(nn.Module):
    """E SwiGLU experts with stacked weights: ``gate_proj``/``up_proj`` [E, I, H],
    ``down_proj`` [E, H, I] (row e is expert e's ``nn.Linear`` weight).

    ``forward(x [E, C, H]) -> [E, C, H]``: expert e applied to row block e."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 initializer_range: float = 0.02) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_proj = nn.Parameter(torch.randn(num_experts, intermediate_size, hidden_size) * initializer_range)
        self.up_proj = nn.Parameter(torch.randn(num_experts, intermediate_size, hidden_size) * initializer_range)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden_size, intermediate_size) * initializer_range)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, " \
               f"intermediate_size={self.intermediate_size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.bmm(x, self.gate_proj.transpose(1, 2))
        u = torch.bmm(x, self.up_proj.transpose(1, 2))
        return torch.bmm(F.silu(g) * u, self.down_proj.transpose(1, 2))


class MoEOutput(NamedTuple):
    output: torch.Tensor          # [B, S, H]
    aux_loss: torch.Tensor | None  # scalar (coef included), None for hash-routed layers


def moe_route(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", normalize: bool = True,
              scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k], experts [T, k])`` from router logits ``[T, E]``."""
    scores = sqrt_softplus(router_logits) if scoring == "sqrtsoftplus" else F.softmax(router_logits, dim=-1)
    top_scores, top_idx = torch.topk(scores, top_k, dim=-1)
    if normalize:
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-8)
    return top_scores * scaling, top_idx


def dispatch(x: torch.Tensor, experts: GroupedSwiGLU, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``Σ_j weights[t, j] · expert_{idx[t, j]}(x[t])`` for ``x`` [T, H] (sort-based, loop-free)."""
    T, H = x.shape
    E, K = experts.num_experts, idx.shape[1]
    flat_expert = idx.reshape(-1)
    flat_token = torch.arange(T, device=x.device).repeat_interleave(K)
    order = torch.argsort(flat_expert, stable=True)
    sorted_expert, sorted_token = flat_expert[order], flat_token[order]
    counts = torch.bincount(flat_expert, minlength=E)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(T * K, device=x.device) - starts[sorted_expert]       # slot inside the expert
    slots = sorted_expert * T + rank
    buffer = x.new_zeros(E * T, H).index_copy(0, slots, x[sorted_token])
    out = experts(buffer.view(E, T, H)).view(E * T, H)[slots]
    out = out * weights.reshape(-1, 1)[order].to(out.dtype)
    return x.new_zeros(T, H, dtype=out.dtype).index_add(0, sorted_token, out)


class SparseMoE(nn.Module):
    """Token-choice top-k MoE FFN with optional shared experts and hash routing.

    Args:
        hidden_size: H.
        intermediate_size: I, width of one expert.
        num_experts: E routed experts.
        top_k: experts per token.
        num_shared_experts: fused into one SwiGLU of width I·n_shared (output / n_shared
            when n_shared > 1); 0 = none.
        scoring: "softmax" or "sqrtsoftplus".
        normalize_top_k: renormalise the top-k scores to sum to 1 (+1e-8).
        routed_scaling_factor: multiplies the routed weights.
        hash_routing: route by position id ((p mod E) + j) mod E with weights 1/k; the
            router is kept (checkpoint compatibility) but frozen and unused.
        aux_loss_coef: coefficient of the load-balancing loss.
        initializer_range: N(0, σ²) init of the experts.

    Parameters: ``router.weight`` [E, H]; ``experts`` (:class:`GroupedSwiGLU`);
    ``shared_expert`` (:class:`SwiGLU`) when shared experts are on.

    ``forward(x [B, S, H], *, position_ids [B|1, S] | None) -> MoEOutput(output, aux_loss)``.
    Only hash routing reads ``position_ids``; without them it uses the flat token index
    (the seed's fallback). Position-wise: no mask, no cache.

    Example::

        moe = SparseMoE(512, 256, num_experts=8, top_k=2, num_shared_experts=1)
        y, aux = moe(x)
        y, _ = SparseMoE(512, 256, 8, 2, hash_routing=True)(x, position_ids=torch.arange(x.shape[1])[None])
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 num_shared_experts: int = 0, scoring: str = "softmax", normalize_top_k: bool = True,
                 routed_scaling_factor: float = 1.0, hash_routing: bool = False, aux_loss_coef: float = 0.0,
                 initializer_range: float = 0.02) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                            ("num_experts", num_experts), ("top_k", top_k)):
            check_positive_int(name, value)
        check_choice("scoring", scoring, ("softmax", "sqrtsoftplus"))
        if top_k > num_experts:
            raise ConfigError(f"`top_k` ({top_k}) exceeds `num_experts` ({num_experts})")
        if isinstance(num_shared_experts, bool) or not isinstance(num_shared_experts, int) or num_shared_experts < 0:
            raise ConfigError(f"`num_shared_experts` must be an int >= 0, got {num_shared_experts!r}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.num_shared_experts, self.scoring, self.normalize_top_k = num_shared_experts, scoring, bool(normalize_top_k)
        self.routed_scaling_factor, self.hash_routing = float(routed_scaling_factor), bool(hash_routing)
        self.aux_loss_coef = float(aux_loss_coef)
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        if self.hash_routing:
            self.router.weight.requires_grad_(False)
        self.experts = GroupedSwiGLU(num_experts, hidden_size, intermediate_size, initializer_range)
        self.shared_expert = (SwiGLU(hidden_size, intermediate_size * num_shared_experts,
                                     output_divisor=max(num_shared_experts, 1))
                              if num_shared_experts else None)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, shared={self.num_shared_experts}, "
                f"scoring={self.scoring!r}, hash_routing={self.hash_routing}")

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None) -> MoEOutput:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ShapeError(f"`x` must be (batch, seq, {self.hidden_size}), got {tuple(x.shape)}")
        B, S, H = x.shape
        if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[1] != S
                                         or position_ids.shape[0] not in (1, B)):
            raise ShapeError(f"`position_ids` must be (batch or 1, seq) = ({B} or 1, {S}), got "
                             f"{tuple(position_ids.shape)}")
        T, E, K = B * S, self.num_experts, self.top_k
        flat = x.reshape(T, H)
        aux = None
        if self.hash_routing:
            base = (position_ids.expand(B, S).reshape(T, 1) if position_ids is not None
                    else torch.arange(T, device=x.device).unsqueeze(1)) % E
            idx = (base.long() + torch.arange(K, device=x.device)) % E
            weights = torch.full((T, K), 1.0 / K, device=x.device, dtype=flat.dtype)
        else:
            logits = self.router(flat)
            weights, idx = moe_route(logits, K, self.scoring, self.normalize_top_k, self.routed_scaling_factor)
            chosen = torch.zeros_like(logits).scatter(1, idx, 1.0)
            aux = E * (chosen.mean(0) * F.softmax(logits, dim=-1).mean(0)).sum() * self.aux_loss_coef
        y = dispatch(flat, self.experts, weights, idx)
        if self.shared_expert is not None:
            y = y + self.shared_expert(flat)
        return MoEOutput(y.view(B, S, H), aux)
