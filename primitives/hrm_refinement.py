"""HRM iterative refinement of a final hidden state (SpikeWhaleLM v2).

T refinement steps, all anchored to the block's input ``x``:

    h_0 = x
    h_{t+1} = h_t + tanh(gate[t]) · up(silu(down([norm(h_t), x])))      t = 0..T-1

``norm`` is an RMSNorm with a learned weight, ``down`` a bias-free [R, 2D] linear map
of the concatenation, ``up`` a bias-free [D, R] map. ``up`` starts at zero (the block
is the identity at initialisation) and ``gate`` at ``gate_init`` (non-zero, so the
gradient reaches ``up`` from the first step). The per-step states h_1..h_T are
returned for deep supervision.

The block is row-wise: no position mixes with another, so padding cannot leak
and decoding needs no state (run it on each new token's hidden state).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._backend import Backend, check_backend, resolve_backend
from ._errors import ConfigError, DTypeError, ShapeError
from ._validation import (check_has_tokens, check_param_dtype, check_positive_float, check_positive_int,
                          check_same_device, check_tensor, without_autocast)
from .blocks.norms import RMSNorm, rms_norm

__all__ = ["hrm_refinement_reference", "HRMRefinementBlock", "HRMRefinementOutput"]

_ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class HRMRefinementOutput(NamedTuple):
    output: torch.Tensor   # h_T, [..., D] in x's dtype
    states: torch.Tensor   # [T, ..., D]: states[t] = h_{t+1} (deep supervision); states[-1] is output


def hrm_refinement_reference(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    down_weight: torch.Tensor,
    up_weight: torch.Tensor,
    gate: torch.Tensor,
    eps: float = 1e-6,
    *,
    upcast: bool = True,
) -> torch.Tensor:
    """The seed's refinement loop, written with the concatenation as in the seed.

    Args:
        x: ``[..., D]`` hidden states (the anchor and h_0).
        norm_weight: ``[D]`` RMSNorm weight.
        down_weight: ``[R, 2D]``; columns ``[:D]`` act on norm(h), ``[D:]`` on x.
        up_weight: ``[D, R]``.
        gate: ``[T]`` gate logits, one per step (T ≥ 1 = number of steps).
        eps: RMSNorm epsilon.
        upcast: compute in fp32 (fp64 stays fp64) and cast back (the ground truth);
            ``False`` keeps the input dtype (the same-dtype eager baseline).
    Returns:
        ``states``: ``[T, ..., D]`` in x's dtype, ``states[t]`` = h_{t+1}; the block's
        output is ``states[-1]``.
    """
    dtype = x.dtype
    compute = torch.promote_types(dtype, torch.float32) if upcast else dtype
    anchor = x.to(compute)
    w_norm, w_down, w_up = (w.to(compute) for w in (norm_weight, down_weight, up_weight))
    gates = torch.tanh(gate.to(torch.promote_types(gate.dtype, torch.float32)))
    h = anchor
    states = []
    for t in range(gate.shape[0]):
        inp = torch.cat([rms_norm(h, w_norm, eps, upcast=False), anchor], dim=-1)
        update = F.linear(F.silu(F.linear(inp, w_down)), w_up)
        h = h + gates[t].to(update.dtype) * update
        states.append(h.to(dtype))
    return torch.stack(states)


class HRMRefinementBlock(nn.Module):
    """HRM iterative refinement: ``h, states = block(x)``.

    Args:
        hidden_size: D.
        refine_dim: R, width of the bottleneck (seed config ``hrm_refine_dim``).
        steps: T ≥ 1 refinement iterations (``hrm_refine_steps``).
        eps: RMSNorm epsilon (``rms_norm_eps``, 1e-6).
        gate_init: initial value of every ``gate[t]`` (``hrm_gate_init``, 1.0). Must be
            non-zero: ``up`` starts at zero on the same multiplicative path, and a zero
            gate as well would give every parameter a zero gradient forever.
        backend: "auto" | "triton" | "reference".

    Parameters (seed names, so a seed state dict loads with ``strict=True``):
    ``norm.weight`` [D] (ones; the seed's RMSNorm in the input dtype), ``down.weight``
    [R, 2D] (normal, std 0.02), ``up.weight`` [D, R] (zeros), ``gate`` [T] (``gate_init``).

    Shapes: ``x`` is ``[..., D]`` (typically ``[batch, seq, D]``), fp32/bf16/fp16 (fp64
    on the reference backend). Returns :class:`HRMRefinementOutput` ``(output,
    states)``: ``output`` = h_T with x's shape and dtype, ``states`` ``[T, ..., D]`` the
    per-step states h_1..h_T for deep supervision (``states[-1]`` is ``output``; both
    backends compute them anyway, so returning them costs nothing). Under autocast the
    block's math runs with autocast off in x's dtype on both backends (the cast policy).

    Example::

        block = HRMRefinementBlock(1024, refine_dim=256, steps=2)
        h, states = block(hidden)        # hidden: [B, S, 1024]; states: [2, B, S, 1024]
    """

    def __init__(self, hidden_size: int, refine_dim: int, steps: int, eps: float = 1e-6,
                 gate_init: float = 1.0, backend: Backend = "auto") -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("refine_dim", refine_dim)
        check_positive_int("steps", steps)
        check_positive_float("eps", eps)
        check_backend(backend)
        gate_init = float(gate_init)
        if gate_init == 0.0 or gate_init != gate_init or abs(gate_init) == float("inf"):
            raise ConfigError(
                f"`gate_init` must be finite and non-zero (with `up` zero-initialised a zero gate "
                f"freezes the block at the identity), got {gate_init!r}")
        self.hidden_size, self.refine_dim, self.steps, self.eps = hidden_size, refine_dim, steps, eps
        self.backend = backend
        self.norm = RMSNorm(hidden_size, eps, upcast=False)
        self.down = nn.Linear(2 * hidden_size, refine_dim, bias=False)
        self.up = nn.Linear(refine_dim, hidden_size, bias=False)
        self.gate = nn.Parameter(torch.full((steps,), gate_init))
        nn.init.normal_(self.down.weight, std=0.02)
        nn.init.zeros_(self.up.weight)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, refine_dim={self.refine_dim}, steps={self.steps}, "
                f"eps={self.eps}, backend={self.backend!r}")

    def _check(self, x: torch.Tensor) -> None:
        check_tensor("x", x, dtypes=_ACTIVATION_DTYPES)
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ShapeError(f"`x` must have last dim hidden_size={self.hidden_size}, got shape {tuple(x.shape)}")
        check_has_tokens("x", x, None)
        weight = self.down.weight
        check_same_device(x=x, weight=weight)
        check_param_dtype("x", x, weight)

    def forward(self, x: torch.Tensor) -> HRMRefinementOutput:
        self._check(x)
        params = (self.norm.weight, self.down.weight, self.up.weight, self.gate)
        # The math computes in x's dtype with fp32 accumulation on both backends;
        # autocast would otherwise recast the matmuls inside it behind its back.
        with without_autocast(x.device.type):
            if resolve_backend(self.backend, x) == "triton":
                from laminae.triton_ops.hrm_refinement import hrm_refinement

                if x.dtype == torch.float64:
                    raise DTypeError("the Triton HRM refinement supports fp32/bf16/fp16 inputs, got float64; "
                                     "use backend='reference'")
                states = hrm_refinement(x, *params, eps=self.eps)
            else:
                states = hrm_refinement_reference(x, *params, eps=self.eps)
        return HRMRefinementOutput(states[-1], states)
