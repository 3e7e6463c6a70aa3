"""HRM refinement kernels: the row-wise work between the matmuls, fused.

The down weight is split into its two halves, W_n = down[:, :D] (acts on norm(h))
and W_a = down[:, D:] (acts on the anchor x), so the [N, 2D] concatenation is never
built and the anchor half a = x·W_aᵀ is computed once for all T steps. Per step:

    row kernel      h_t = h_{t-1} + c_{t-1}·u_{t-1}; ρ_t = rsqrt(mean(h_t²)+eps);
                    n_t = h_t·ρ_t·w                      (update and norm: one pass)
    cuBLAS          z_t = a + n_t·W_nᵀ                   (addmm)
    act kernel      s_t = silu(z_t)
    cuBLAS          u_t = s_t·W_upᵀ
with c = tanh(gate). A last row kernel applies the final update without a norm.
Saved for backward: the states (the op's output anyway), ρ [T, N] fp32, z [T, N, R].

Backward, t = T-1 … 0, with δ the fp32 gradient flowing into h_{t+1}:

    cuBLAS          q = δ·W_up                          [N, R]
    act-bwd kernel  dz = c·q·silu'(z); Σ s⊙q per program (→ dgate = (1-c²)·Σ s⊙q,
                    no need for u); da += dz; writes c·s and ρ·dz for the weight grads
    cuBLAS          dn = dz·W_n
    row-bwd kernel  δ ← δ + ρ·(w⊙dn − ĥ·mean(ĥ⊙w⊙dn)) + g_t,   ĥ = h_t·ρ
                    (RMSNorm backward, residual and the state's own upstream gradient
                    in one pass; dw partial sums per program, no atomics)
δ_t (in the activation dtype), c·s_t and ρ·dz_t are written into [T, N, ·] stacks, so
each weight gradient is one GEMM over K = T·N after the loop: dW_up = [δ_t]ᵀ·[c·s_t],
dW_n = (ρ·dz_0)ᵀ·x + [ρ·dz_t]ᵀ_{t≥1}·states[:T-1] (x is not copied in front of the
states). Per step that is 5 launches instead of 11 and no allocation; the forward
writes z_t into its slot of z and reuses one buffer each for n_t, s_t and u_t.
Finally dx = δ + da·W_a, dW_a = daᵀ·x, dW_n ⊙= w (the norm weight factors out of
n = ĥ⊙w, so dW_n never needs n itself).

Why the matmuls stay cuBLAS: they are thin GEMMs (K or N = R, typically 64–512)
over all N rows, where cuBLAS runs near peak; everything else is one read and one
write per row, done here. Rows wider than ``MAX_HIDDEN`` are rejected: a program
holds a whole row in registers.
"""
from __future__ import annotations

from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import ConfigError, DTypeError, ShapeError

from ._common import StaticCase, contiguous, empty, num_programs_for_rows

__all__ = ["hrm_refinement", "hrm_refinement_fwd", "MAX_HIDDEN"]

MAX_HIDDEN = 8192
ACT_BLOCK = 1024
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def block_d_for(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def row_warps(block_d: int) -> int:
    if block_d <= 1024:
        return 4
    if block_d <= 4096:
        return 8
    return 16


def row_bwd_warps(block_d: int) -> int:
    # the backward holds about six live row vectors; spread wide rows over more threads
    if block_d <= 512:
        return 4
    if block_d <= 2048:
        return 8
    if block_d <= 4096:
        return 16
    return 32


@triton.jit
def _hrm_row_fwd_kernel(h_prev_ptr, u_ptr, c_ptr, w_ptr, h_ptr, n_ptr, rstd_ptr, D, step, eps,
                        HAS_UPDATE: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    offs = row * D + cols
    h = tl.load(h_prev_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_UPDATE:
        c = tl.load(c_ptr + step)
        h += c * tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(n_ptr + offs, (h * rstd * w).to(n_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _silu_fwd_kernel(z_ptr, s_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(s_ptr + offs, (z * tl.sigmoid(z)).to(s_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_bwd_kernel(q_ptr, z_ptr, rstd_ptr, c_ptr, dz_ptr, dzr_ptr, cs_ptr, da_ptr, part_ptr,
                     numel, R, step, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    c = tl.load(c_ptr + step)
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + offs // R, mask=mask, other=0.0)
    sig = tl.sigmoid(z)
    s = z * sig
    dz = c * q * sig * (1.0 + z * (1.0 - sig))
    tl.store(part_ptr + pid, tl.sum(s * q, axis=0))
    tl.store(dz_ptr + offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
    tl.store(dzr_ptr + offs, (dz * rstd).to(dzr_ptr.dtype.element_ty), mask=mask)
    tl.store(cs_ptr + offs, (c * s).to(cs_ptr.dtype.element_ty), mask=mask)
    # da accumulates dz over the steps; each element belongs to one program
    da = tl.load(da_ptr + offs, mask=mask, other=0.0)
    tl.store(da_ptr + offs, da + dz, mask=mask)


@triton.jit
def _hrm_row_bwd_kernel(dn_ptr, h_ptr, rstd_ptr, w_ptr, g_ptr, delta_ptr, dw_part_ptr, N, D,
                        HAS_GRAD: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    row = pid.to(tl.int64)
    for _ in range(pid, N, n_progs):
        offs = row * D + cols
        rstd = tl.load(rstd_ptr + row)
        h_hat = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32) * rstd
        dn = tl.load(dn_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        wdn = w * dn
        mean = tl.sum(h_hat * wdn, axis=0) / D
        delta = tl.load(delta_ptr + offs, mask=mask, other=0.0) + rstd * (wdn - h_hat * mean)
        if HAS_GRAD:
            delta += tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(delta_ptr + offs, delta, mask=mask)
        dw += dn * h_hat
        row += n_progs
    # this program's own partial row accumulates over the steps: deterministic
    part = dw_part_ptr + pid.to(tl.int64) * D + cols
    tl.store(part, tl.load(part, mask=mask, other=0.0) + dw, mask=mask)


def _split_down(down_weight: torch.Tensor, d: int, dtype: torch.dtype):
    return down_weight[:, :d].to(dtype), down_weight[:, d:].to(dtype)


def _launch_row_fwd(h_prev, u, c, w, h, n, rstd, step: int, eps: float, *, update: bool, norm: bool):
    rows, d = h_prev.shape
    block_d = block_d_for(d)
    wrap_triton(_hrm_row_fwd_kernel)[(rows,)](
        h_prev, u, c, w, h, n, rstd, d, step, eps,
        HAS_UPDATE=update, HAS_NORM=norm, BLOCK_D=block_d, num_warps=row_warps(block_d),
    )


@triton_op("laminae::hrm_refinement_fwd", mutates_args=())
def hrm_refinement_fwd(
    x: torch.Tensor, norm_weight: torch.Tensor, down_weight: torch.Tensor, up_weight: torch.Tensor,
    gate: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [N, D] → (states [T, N, D], rstd [T, N] fp32, z [T, N, R])."""
    rows, d = x.shape
    steps, dtype = gate.shape[0], x.dtype
    w_n, w_a = _split_down(down_weight, d, dtype)
    w_up = up_weight.to(dtype)
    c = torch.tanh(gate.float())
    norm_weight = norm_weight.float()
    refine = w_n.shape[0]
    anchor_proj = x @ w_a.t()
    states = empty((steps, rows, d), dtype=dtype, device=x.device)
    rstd = empty((steps, rows), dtype=torch.float32, device=x.device)
    z = empty((steps, rows, refine), dtype=dtype, device=x.device)
    # one buffer each for n_t, s_t and u_t, reused by every step; z_t lands in its slot of z
    normed = empty((rows, d), dtype=dtype, device=x.device)
    s = empty((rows, refine), dtype=dtype, device=x.device)
    u = empty((rows, d), dtype=dtype, device=x.device)
    act_grid = (triton.cdiv(rows * refine, ACT_BLOCK),)
    for t in range(steps):
        h_prev = x if t <= 1 else states[t - 2]
        if t == 0:
            _launch_row_fwd(x, x, c, norm_weight, x, normed, rstd[0], 0, eps, update=False, norm=True)
        else:
            _launch_row_fwd(h_prev, u, c, norm_weight, states[t - 1], normed, rstd[t], t - 1, eps,
                            update=True, norm=True)
        torch.addmm(anchor_proj, normed, w_n.t(), out=z[t])
        wrap_triton(_silu_fwd_kernel)[act_grid](z[t], s, rows * refine, BLOCK=ACT_BLOCK)
        torch.mm(s, w_up.t(), out=u)
    last_prev = x if steps == 1 else states[steps - 2]
    _launch_row_fwd(last_prev, u, c, norm_weight, states[steps - 1], normed, rstd[0], steps - 1, eps,
                    update=True, norm=False)
    return states, rstd, z


@triton_op("laminae::hrm_refinement_bwd", mutates_args=())
def _hrm_refinement_bwd(
    g_states: torch.Tensor, x: torch.Tensor, states: torch.Tensor, rstd: torch.Tensor, z: torch.Tensor,
    norm_weight: torch.Tensor, down_weight: torch.Tensor, up_weight: torch.Tensor, gate: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    steps, rows, d = states.shape
    refine = z.shape[-1]
    dtype, dev = x.dtype, x.device
    w_n, w_a = _split_down(down_weight, d, dtype)
    w_up = up_weight.to(dtype)
    c = torch.tanh(gate.float())
    w_norm = norm_weight.float()
    block_d = block_d_for(d)
    n_progs = num_programs_for_rows(rows, dev)
    act_progs = triton.cdiv(rows * refine, ACT_BLOCK)

    delta = g_states[steps - 1].to(torch.float32, copy=True)
    da = torch.zeros((rows, refine), dtype=torch.float32, device=dev)
    dw_part = torch.zeros((n_progs, d), dtype=torch.float32, device=dev)
    gate_part = empty((steps, act_progs), dtype=torch.float32, device=dev)
    # The weight gradients' operands per step, stacked so each gradient is one GEMM over
    # K = T·N at the end: δ_t in the activation dtype with c·s_t (dW_up), ρ·dz_t (dW_n).
    delta_lp = empty((steps, rows, d), dtype=dtype, device=dev)
    cs = empty((steps, rows, refine), dtype=dtype, device=dev)
    dzr = empty((steps, rows, refine), dtype=dtype, device=dev)
    # reused by every step
    q = empty((rows, refine), dtype=dtype, device=dev)
    dz = empty((rows, refine), dtype=dtype, device=dev)
    dn = empty((rows, d), dtype=dtype, device=dev)
    for t in range(steps - 1, -1, -1):
        h_t = x if t == 0 else states[t - 1]
        delta_lp[t].copy_(delta)
        torch.mm(delta_lp[t], w_up, out=q)
        wrap_triton(_silu_bwd_kernel)[(act_progs,)](
            q, z[t], rstd[t], c, dz, dzr[t], cs[t], da, gate_part[t], rows * refine, refine, t, BLOCK=ACT_BLOCK)
        torch.mm(dz, w_n, out=dn)
        has_grad = t > 0
        wrap_triton(_hrm_row_bwd_kernel)[(n_progs,)](
            dn, h_t, rstd[t], w_norm, g_states[t - 1] if has_grad else dn, delta, dw_part, rows, d,
            HAS_GRAD=has_grad, BLOCK_D=block_d, num_warps=row_bwd_warps(block_d))
    d_up = delta_lp.view(-1, d).t() @ cs.view(-1, refine)
    # h_0 = x and h_t = states[t-1]: the states are one [T-1, N, D] block already, so x
    # takes its own GEMM rather than a copy of every state into a stacked operand
    d_wn = (dzr[0].t() @ x).float()
    if steps > 1:
        d_wn += (dzr[1:].reshape(-1, refine).t() @ states[:-1].reshape(-1, d)).float()
    da_lp = da.to(dtype)
    dx = (delta + (da_lp @ w_a).float()).to(dtype)
    d_wa = (da_lp.t() @ x).float()
    d_down = torch.cat([d_wn * w_norm, d_wa], dim=1).to(down_weight.dtype)
    d_gate = ((1.0 - c * c) * gate_part.sum(1)).to(gate.dtype)
    return dx, dw_part.sum(0).to(norm_weight.dtype), d_down, d_up.to(up_weight.dtype), d_gate


def _setup_context(ctx, inputs, output):
    x, norm_weight, down_weight, up_weight, gate, _eps = inputs
    states, rstd, z = output
    ctx.mark_non_differentiable(rstd, z)
    ctx.save_for_backward(x, states, rstd, z, norm_weight, down_weight, up_weight, gate)


def _backward(ctx, g_states, _drstd, _dz):
    x, states, rstd, z, norm_weight, down_weight, up_weight, gate = ctx.saved_tensors
    grads = _hrm_refinement_bwd(g_states.contiguous(), x, states, rstd, z, norm_weight, down_weight, up_weight, gate)
    return (*grads, None)


hrm_refinement_fwd.register_autograd(_backward, setup_context=_setup_context)


def hrm_refinement(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    down_weight: torch.Tensor,
    up_weight: torch.Tensor,
    gate: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Triton HRM refinement with the signature of
    :func:`laminae.primitives.hrm_refinement.hrm_refinement_reference`.

    ``x`` [..., D] fp32/bf16/fp16 (D ≤ ``MAX_HIDDEN``); ``norm_weight`` [D];
    ``down_weight`` [R, 2D]; ``up_weight`` [D, R]; ``gate`` [T]. Returns the states
    ``[T, ..., D]`` in x's dtype (``states[-1]`` is the block output).
    """
    if x.dtype not in _KERNEL_DTYPES:
        raise DTypeError(f"Triton HRM refinement supports fp32/bf16/fp16 inputs, got {x.dtype}")
    d = x.shape[-1]
    if d > MAX_HIDDEN:
        raise ConfigError(f"Triton HRM refinement holds a row in registers: hidden size must be "
                          f"<= {MAX_HIDDEN}, got {d}")
    if gate.dim() != 1 or gate.shape[0] < 1:
        raise ShapeError(f"`gate` must have shape [steps] with steps >= 1, got {tuple(gate.shape)}")
    shape = x.shape
    x2, norm_weight, down_weight, up_weight = contiguous(x.reshape(-1, d), norm_weight, down_weight, up_weight)
    states, _, _ = hrm_refinement_fwd(x2, norm_weight, down_weight, up_weight, gate, float(eps))
    return states.view(gate.shape[0], *shape)


# Pointers every launch passes 16-byte aligned (fresh allocations, contiguous inputs,
# parameters), which Triton specialises as 16-divisible. Not listed: the per-step views
# ``states[t]``, ``rstd[t]``, ``z[t]``, ``gate_part[t]``, ``g_states[t]``, ``dzr[t]`` and ``cs[t]``, whose
# offsets are multiples of the row count (aligned only for some N).
FWD_ALIGNED = ("u_ptr", "c_ptr", "w_ptr", "n_ptr")
BWD_ALIGNED = ("dn_ptr", "w_ptr", "delta_ptr", "dw_part_ptr")
SILU_FWD_ALIGNED = ("s_ptr",)
SILU_BWD_ALIGNED = ("q_ptr", "c_ptr", "dz_ptr", "da_ptr")
# When N·R is a multiple of 8 (every model size: R is 64–512) each step's slot of the
# [T, N, R] stacks z, ρ·dz and c·s starts 16-byte aligned as well, which Triton
# specialises at launch: the binary the common case runs.
SILU_FWD_SLOTS = ("z_ptr",)
SILU_BWD_SLOTS = ("z_ptr", "dzr_ptr", "cs_ptr")


# At model widths (a row tile of 1024 and more) D is a multiple of 16 in the common case,
# which Triton specialises too, and then a step of a stacked [T, N, D] tensor starts
# 16-byte aligned as well. Without it only the weight row's loads vectorise: the fp32
# backward at BLOCK_D 8192 then converts layouts and spills at 32 warps' 64 registers.
WIDE = 1024
FWD_WIDE = ("D", "h_prev_ptr", "h_ptr")
BWD_WIDE = ("D", "h_ptr", "g_ptr")


def static_cases() -> Iterator[StaticCase]:
    block_ds = [2**k for k in range(4, 14)]  # 16 … 8192
    fwd_flags = {"update+norm": (True, True), "norm": (False, True), "update": (True, False)}
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        fwd_sig = dict(h_prev_ptr=p, u_ptr=p, c_ptr="*fp32", w_ptr="*fp32", h_ptr=p, n_ptr=p, rstd_ptr="*fp32",
                       D="i32", step="i32", eps="fp32")
        bwd_sig = dict(dn_ptr=p, h_ptr=p, rstd_ptr="*fp32", w_ptr="*fp32", g_ptr=p, delta_ptr="*fp32",
                       dw_part_ptr="*fp32", N="i32", D="i32")
        for block_d in block_ds:
            for label, (update, norm) in fwd_flags.items():
                yield StaticCase("hrm_row_fwd", _hrm_row_fwd_kernel, fwd_sig,
                                 dict(HAS_UPDATE=update, HAS_NORM=norm, BLOCK_D=block_d), row_warps(block_d),
                                 tags={"dtype": dt, "flags": label},
                                 divisible=FWD_ALIGNED + (FWD_WIDE if block_d >= WIDE else ()))
            for has_grad in (True, False):
                yield StaticCase("hrm_row_bwd", _hrm_row_bwd_kernel, bwd_sig,
                                 dict(HAS_GRAD=has_grad, BLOCK_D=block_d), row_bwd_warps(block_d),
                                 tags={"dtype": dt}, divisible=BWD_ALIGNED + (BWD_WIDE if block_d >= WIDE else ()))
        for slots in (False, True):
            tags = {"dtype": dt} | ({"slots": "aligned"} if slots else {})
            yield StaticCase("hrm_silu_fwd", _silu_fwd_kernel, dict(z_ptr=p, s_ptr=p, numel="i32"),
                             dict(BLOCK=ACT_BLOCK), 4, tags=tags,
                             divisible=SILU_FWD_ALIGNED + (SILU_FWD_SLOTS if slots else ()))
            yield StaticCase("hrm_silu_bwd", _silu_bwd_kernel,
                             dict(q_ptr=p, z_ptr=p, rstd_ptr="*fp32", c_ptr="*fp32", dz_ptr=p, dzr_ptr=p, cs_ptr=p,
                                  da_ptr="*fp32", part_ptr="*fp32", numel="i32", R="i32", step="i32"),
                             dict(BLOCK=ACT_BLOCK), 4, tags=tags,
                             divisible=SILU_BWD_ALIGNED + (SILU_BWD_SLOTS if slots else ()))


def tour_case(device: torch.device):
    from laminae.primitives.hrm_refinement import hrm_refinement_reference

    from .tour import TourCase

    gen = torch.Generator().manual_seed(0)
    rows, d, refine, steps = 2 * 64, 256, 64, 3
    inputs = {
        "x": torch.randn(rows, d, generator=gen).to(device),
        "norm_weight": (1 + 0.1 * torch.randn(d, generator=gen)).to(device),
        "down_weight": (0.05 * torch.randn(refine, 2 * d, generator=gen)).to(device),
        "up_weight": (0.05 * torch.randn(d, refine, generator=gen)).to(device),
        "gate": torch.randn(steps, generator=gen).to(device),
    }
    return TourCase("hrm_refinement (T=3, R=64)", hrm_refinement, hrm_refinement_reference, inputs, list(inputs))
