"""Leviathan generator kernels: the spline chain (LayerNorm → sigmoid → basis → φ →
log-product) fused, with B and φ kept in registers.

torch      distinct ids (sync-free, bounded), digits, codebook gather-sum, the per-mode
           projection y0ᵀ = W·zᵀ ([h, d, U], so a seed dimension is a contiguous row of
           tokens), the output matmul [U, h·r]·[h·r, D], every weight-gradient matmul.
forward    _fwd_kernel, grid (U/BLOCK_N, h, r/BLOCK_R): LayerNorm statistics in two
           passes, then a loop over the d seed dimensions: z̃ for the token block, the
           dense normalised basis [BLOCK_N, κ] (3 non-zeros a row), φ = B·(1 + wd[j])
           as one tl.dot, running Σ log|φ| and sign parity. Writes M [U, h·r] (fp32)
           and the row statistics (mean, rstd) [h, U].
backward   _bwd_spline_kernel, grid (h, d): one program owns one (mode, seed dim) and
           walks every token block, so d wd[l, j] = Σ_n Bᵀ·dφ, dγ and dβ are reduced in
           registers in a fixed order: deterministic, no atomics, no partial buffers.
           It recomputes z̃, B and φ and writes dx̂ [h, d, U].
           _bwd_norm_kernel, grid (U/BLOCK_N, h): the LayerNorm backward over d → dy0.
"""
from __future__ import annotations

from typing import Iterator

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from laminae.primitives._errors import ConfigError, DTypeError
from laminae.primitives._token_ids import ids_in_range, nan_rows, safe_ids
from laminae.primitives.leviathan import TRITON_MAX_KNOTS, TRITON_MAX_RANK, leviathan_digits, leviathan_id_bound

from ._common import StaticCase, empty, empty_like

__all__ = ["leviathan", "leviathan_spline"]

BLOCK_N = 32        # tokens per tile (the K of the d wd tl.dot in backward)
BLOCK_D = 64        # seed dims per chunk of the LayerNorm passes
NUM_WARPS = 4


@triton.jit
def _basis(zt, grid, knot_ok, scale):
    """Normalised quadratic B-spline basis [BLOCK_N, BLOCK_K] and what its backward needs."""
    diff = zt[:, None] - grid[None, :]
    delta = tl.abs(diff) * scale
    w = tl.where(delta < 0.5, 0.75 - delta * delta, tl.where(delta < 1.5, 0.5 * (1.5 - delta) * (1.5 - delta), 0.0))
    w = tl.where(knot_ok[None, :], w, 0.0)
    z = tl.maximum(tl.sum(w, axis=1), 1e-12)
    return w, z, diff, delta


@triton.jit
def _z_tilde(y, mean, rstd, gam, bet):
    xhat = (y - mean) * rstd
    zt = tl.sigmoid((xhat * gam + bet) * 0.5)
    return xhat, tl.minimum(tl.maximum(zt, 0.0), 1.0)


@triton.jit
def _fwd_kernel(y0t_ptr, gamma_ptr, beta_ptr, wd_ptr, grid_ptr, count_ptr, m_ptr, mean_ptr, rstd_ptr,
                N, D, KNOTS, R, H, scale,
                BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    mode = tl.program_id(1)
    pid_r = tl.program_id(2)
    n_valid = tl.load(count_ptr).to(tl.int32)
    start = pid_n * BLOCK_N
    rows = start + tl.arange(0, BLOCK_N)
    row_ok = rows < n_valid
    y_base = y0t_ptr + mode.to(tl.int64) * D * N
    # LayerNorm statistics, two passes over d in chunks (population variance, as the reference)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in range(0, D, BLOCK_D):
        jj = j0 + tl.arange(0, BLOCK_D)
        m2 = (jj < D)[:, None] & row_ok[None, :]
        y = tl.load(y_base + jj[:, None].to(tl.int64) * N + rows[None, :], mask=m2, other=0.0).to(tl.float32)
        acc += tl.sum(y, axis=0)
    mean = acc / D
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in range(0, D, BLOCK_D):
        jj = j0 + tl.arange(0, BLOCK_D)
        m2 = (jj < D)[:, None] & row_ok[None, :]
        y = tl.load(y_base + jj[:, None].to(tl.int64) * N + rows[None, :], mask=m2, other=0.0).to(tl.float32)
        c = tl.where(m2, y - mean[None, :], 0.0)
        acc += tl.sum(c * c, axis=0)
    rstd = 1.0 / tl.sqrt(acc / D + 1e-5)

    knots = tl.arange(0, BLOCK_K)
    knot_ok = knots < KNOTS
    grid = tl.load(grid_ptr + knots, mask=knot_ok, other=0.0)
    qq = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    q_ok = qq < R
    s_mask = knot_ok[:, None] & q_ok[None, :]
    log_mag = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    negatives = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.int32)
    # blocks past the distinct-id count skip the spline loop and store zeros
    d_end = tl.where(start < n_valid, D, 0)
    for j in range(0, d_end):
        y = tl.load(y_base + j * N + rows, mask=row_ok, other=0.0).to(tl.float32)
        gam = tl.load(gamma_ptr + mode * D + j).to(tl.float32)
        bet = tl.load(beta_ptr + mode * D + j).to(tl.float32)
        _, zt = _z_tilde(y, mean, rstd, gam, bet)
        w, z, _, _ = _basis(zt, grid, knot_ok, scale)
        basis = w / z[:, None]
        s_ptr = wd_ptr + ((mode * D + j).to(tl.int64) * KNOTS + knots[:, None]) * R + qq[None, :]
        coeff = tl.where(s_mask, 1.0 + tl.load(s_ptr, mask=s_mask, other=0.0).to(tl.float32), 0.0)
        phi = tl.dot(basis, coeff, input_precision="ieee")
        log_mag += tl.log(tl.abs(phi) + 1e-9)
        negatives += (phi < 0).to(tl.int32)
    m = tl.where((negatives % 2) == 1, -1.0, 1.0) * tl.exp(log_mag)
    m = tl.where(row_ok[:, None], m, 0.0)
    rows64 = rows.to(tl.int64)
    tl.store(m_ptr + rows64[:, None] * (H * R) + mode * R + qq[None, :], m,
             mask=(rows < N)[:, None] & q_ok[None, :])
    if pid_r == 0:
        stat = mode.to(tl.int64) * N + rows
        tl.store(mean_ptr + stat, tl.where(row_ok, mean, 0.0), mask=rows < N)
        tl.store(rstd_ptr + stat, tl.where(row_ok, rstd, 0.0), mask=rows < N)


@triton.jit
def _bwd_spline_kernel(y0t_ptr, gamma_ptr, beta_ptr, wd_ptr, grid_ptr, count_ptr, m_ptr, dm_ptr, mean_ptr, rstd_ptr,
                       dxhat_ptr, dwd_ptr, dgamma_ptr, dbeta_ptr,
                       N, D, KNOTS, R, H, scale,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    mode = tl.program_id(0)
    j = tl.program_id(1)
    n_valid = tl.load(count_ptr).to(tl.int32)
    knots = tl.arange(0, BLOCK_K)
    knot_ok = knots < KNOTS
    grid = tl.load(grid_ptr + knots, mask=knot_ok, other=0.0)
    qq = tl.arange(0, BLOCK_R)
    q_ok = qq < R
    s_mask = knot_ok[:, None] & q_ok[None, :]
    md = (mode * D + j).to(tl.int64)
    s_off = (md * KNOTS + knots[:, None]) * R + qq[None, :]
    coeff = tl.where(s_mask, 1.0 + tl.load(wd_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32), 0.0)
    gam = tl.load(gamma_ptr + md).to(tl.float32)
    bet = tl.load(beta_ptr + md).to(tl.float32)
    d_coeff = tl.zeros([BLOCK_K, BLOCK_R], dtype=tl.float32)
    d_gam = tl.zeros([BLOCK_N], dtype=tl.float32)
    d_bet = tl.zeros([BLOCK_N], dtype=tl.float32)
    y_row = y0t_ptr + md * N
    for start in range(0, n_valid, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        row_ok = rows < n_valid
        stat = mode.to(tl.int64) * N + rows
        y = tl.load(y_row + rows, mask=row_ok, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + stat, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + stat, mask=row_ok, other=0.0)
        xhat, zt = _z_tilde(y, mean, rstd, gam, bet)
        w, z, diff, delta = _basis(zt, grid, knot_ok, scale)
        basis = w / z[:, None]
        phi = tl.dot(basis, coeff, input_precision="ieee")
        mo = rows.to(tl.int64)[:, None] * (H * R) + mode * R + qq[None, :]
        mm = row_ok[:, None] & q_ok[None, :]
        a = tl.load(dm_ptr + mo, mask=mm, other=0.0) * tl.load(m_ptr + mo, mask=mm, other=0.0)
        # d/dφ of log(|φ| + eps), times dM·M; the parity is a constant (sign(0) = 0 as in autograd)
        d_phi = tl.where(phi > 0, a, tl.where(phi < 0, -a, 0.0)) / (tl.abs(phi) + 1e-9)
        d_coeff += tl.dot(tl.trans(basis), d_phi, input_precision="ieee")
        d_basis = tl.dot(d_phi, tl.trans(coeff), input_precision="ieee")
        # through B = w / Z
        d_w = (d_basis - tl.sum(basis * d_basis, axis=1)[:, None]) / z[:, None]
        dw_ddelta = tl.where(delta < 0.5, -2.0 * delta, tl.where(delta < 1.5, delta - 1.5, 0.0))
        sgn = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
        d_zt = tl.sum(tl.where(knot_ok[None, :], d_w * dw_ddelta * sgn, 0.0), axis=1) * scale
        d_y = tl.where(row_ok, d_zt * 0.5 * zt * (1.0 - zt), 0.0)
        d_gam += d_y * xhat
        d_bet += d_y
        tl.store(dxhat_ptr + md * N + rows, d_y * gam, mask=row_ok)
    tl.store(dwd_ptr + s_off, d_coeff, mask=s_mask)
    tl.store(dgamma_ptr + md, tl.sum(d_gam, axis=0))
    tl.store(dbeta_ptr + md, tl.sum(d_bet, axis=0))


@triton.jit
def _bwd_norm_kernel(y0t_ptr, dxhat_ptr, mean_ptr, rstd_ptr, count_ptr, dy0t_ptr, N, D,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    mode = tl.program_id(1)
    n_valid = tl.load(count_ptr).to(tl.int32)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_valid
    stat = mode.to(tl.int64) * N + rows
    mean = tl.load(mean_ptr + stat, mask=row_ok, other=0.0)
    rstd = tl.load(rstd_ptr + stat, mask=row_ok, other=0.0)
    base = mode.to(tl.int64) * D * N
    s1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in range(0, D, BLOCK_D):
        jj = j0 + tl.arange(0, BLOCK_D)
        m2 = (jj < D)[:, None] & row_ok[None, :]
        off = base + jj[:, None].to(tl.int64) * N + rows[None, :]
        xhat = (tl.load(y0t_ptr + off, mask=m2, other=0.0).to(tl.float32) - mean[None, :]) * rstd[None, :]
        dx = tl.load(dxhat_ptr + off, mask=m2, other=0.0)
        s1 += tl.sum(dx, axis=0)
        s2 += tl.sum(tl.where(m2, dx * xhat, 0.0), axis=0)
    s1 = s1 / D
    s2 = s2 / D
    for j0 in range(0, D, BLOCK_D):
        jj = j0 + tl.arange(0, BLOCK_D)
        m2 = (jj < D)[:, None] & row_ok[None, :]
        off = base + jj[:, None].to(tl.int64) * N + rows[None, :]
        xhat = (tl.load(y0t_ptr + off, mask=m2, other=0.0).to(tl.float32) - mean[None, :]) * rstd[None, :]
        dx = tl.load(dxhat_ptr + off, mask=m2, other=0.0)
        dy0 = tl.where(m2, rstd[None, :] * (dx - s1[None, :] - xhat * s2[None, :]), 0.0)
        tl.store(dy0t_ptr + off, dy0.to(dy0t_ptr.dtype.element_ty), mask=(jj < D)[:, None] & (rows < N)[None, :])


def _block_k(num_knots: int) -> int:
    return max(16, triton.next_power_of_2(num_knots))


def _block_r_fwd(rank: int) -> int:
    return min(64, max(16, triton.next_power_of_2(rank)))


def _block_r_bwd(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def _fwd_warps(block_k: int, block_r: int) -> int:
    return 8 if block_k * block_r >= 2048 else NUM_WARPS


def _bwd_config(block_k: int, block_r: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): the [κ, r] coefficient tile and its gradient stay
    resident across the token loop, so large tiles take more warps, fewer tokens per step
    and, at κ·r = 32·128, no load pipelining (measured with the sm_90 static check: no spills)."""
    tile = block_k * block_r
    return (16 if tile >= 2048 else BLOCK_N), (8 if tile >= 1024 else NUM_WARPS), (1 if tile >= 4096 else 2)


@triton_op("laminae::leviathan_spline", mutates_args=())
def leviathan_spline(
    y0t: torch.Tensor, head_norm_weight: torch.Tensor, head_norm_bias: torch.Tensor,
    head_spline_delta: torch.Tensor, knot_grid: torch.Tensor, count: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Spline chain of every mode for the first ``count`` columns of ``y0t``.

    y0t ``[h, d, U]`` (projection output, fp32); head_norm_* ``[h, d]``;
    head_spline_delta ``[h, d, κ, r]``; knot_grid ``[κ]`` fp32; count ``[1]`` int (valid
    columns, read on the device). Returns M ``[U, h·r]`` fp32 (zero past ``count``) and
    the LayerNorm mean and rstd ``[h, U]`` fp32.
    """
    h, d, n = y0t.shape
    knots, rank = head_spline_delta.shape[2], head_spline_delta.shape[3]
    m = empty((n, h * rank), dtype=torch.float32, device=y0t.device)
    mean = empty((h, n), dtype=torch.float32, device=y0t.device)
    rstd = empty((h, n), dtype=torch.float32, device=y0t.device)
    block_r = _block_r_fwd(rank)
    if n:
        wrap_triton(_fwd_kernel)[(triton.cdiv(n, BLOCK_N), h, triton.cdiv(rank, block_r))](
            y0t, head_norm_weight, head_norm_bias, head_spline_delta, knot_grid, count, m, mean, rstd,
            n, d, knots, rank, h, float(knots - 1), BLOCK_N=BLOCK_N, BLOCK_R=block_r,
            BLOCK_K=_block_k(knots), BLOCK_D=BLOCK_D, num_warps=_fwd_warps(_block_k(knots), block_r),
        )
    return m, mean, rstd


@triton_op("laminae::leviathan_spline_bwd", mutates_args=())
def _leviathan_spline_bwd(
    dm: torch.Tensor, m: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, y0t: torch.Tensor,
    head_norm_weight: torch.Tensor, head_norm_bias: torch.Tensor, head_spline_delta: torch.Tensor,
    knot_grid: torch.Tensor, count: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    h, d, n = y0t.shape
    knots, rank = head_spline_delta.shape[2], head_spline_delta.shape[3]
    dev = y0t.device
    dxhat = empty((h, d, n), dtype=torch.float32, device=dev)
    dwd = empty((h, d, knots, rank), dtype=torch.float32, device=dev)
    dgamma = empty((h, d), dtype=torch.float32, device=dev)
    dbeta = empty((h, d), dtype=torch.float32, device=dev)
    dy0t = empty_like(y0t)
    block_k, block_r = _block_k(knots), _block_r_bwd(rank)
    block_n, warps, stages = _bwd_config(block_k, block_r)
    wrap_triton(_bwd_spline_kernel)[(h, d)](
        y0t, head_norm_weight, head_norm_bias, head_spline_delta, knot_grid, count, m, dm, mean, rstd,
        dxhat, dwd, dgamma, dbeta, n, d, knots, rank, h, float(knots - 1),
        BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    if n:
        wrap_triton(_bwd_norm_kernel)[(triton.cdiv(n, BLOCK_N), h)](
            y0t, dxhat, mean, rstd, count, dy0t, n, d, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, num_warps=NUM_WARPS,
        )
    dtype = head_spline_delta.dtype
    return dy0t, dgamma.to(dtype), dbeta.to(dtype), dwd.to(dtype)


def _setup_context(ctx, inputs, output):
    y0t, gamma, beta, wd, grid, count = inputs
    m, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(y0t, gamma, beta, wd, grid, count, m, mean, rstd)


def _backward(ctx, dm, _dmean, _drstd):
    y0t, gamma, beta, wd, grid, count, m, mean, rstd = ctx.saved_tensors
    dm = torch.zeros_like(m) if dm is None else dm.float().contiguous()
    dy0t, dgamma, dbeta, dwd = _leviathan_spline_bwd(dm, m, mean, rstd, y0t, gamma, beta, wd, grid, count)
    return dy0t, dgamma, dbeta, dwd, None, None


leviathan_spline.register_autograd(_backward, setup_context=_setup_context)


def distinct_ids(flat_ids: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct ids without a host sync: a buffer of static size ``bound`` (≥ the number
    of distinct ids), the slot of every token, and the distinct count as a device tensor.

    Slots past the count hold id 0 (a valid id, so every row stays finite); the kernels
    read the count on the device and skip those slots.
    """
    sorted_ids, order = torch.sort(flat_ids)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot_sorted = torch.cumsum(first, 0) - 1
    slot = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted)
    # every token of a slot writes the same id, so the duplicate writes agree
    uniq = torch.zeros(bound, dtype=flat_ids.dtype, device=flat_ids.device).scatter_(0, slot_sorted, sorted_ids)
    return uniq, slot, (slot_sorted[-1:] + 1).to(torch.int32)


def leviathan(
    input_ids: torch.Tensor,
    codebooks: torch.Tensor,
    head_proj_weight: torch.Tensor,
    head_norm_weight: torch.Tensor,
    head_norm_bias: torch.Tensor,
    head_spline_delta: torch.Tensor,
    head_out_weight: torch.Tensor,
    knot_grid: torch.Tensor | None = None,
    *,
    vocab_size: int | None = None,
    unique_ids: bool = True,
) -> torch.Tensor:
    """Triton Leviathan generator with the signature of
    :func:`laminae.primitives.leviathan.leviathan_reference`: an id outside
    ``[0, vocab_size)`` (default b^k) gives a NaN row, without reading the ids on the host.

    ``unique_ids=True`` evaluates each distinct id of the call once (sync-free; see
    :func:`distinct_ids`), ``False`` evaluates every token. Parameters fp32/bf16/fp16;
    returns ``[*input_ids.shape, D]`` in their dtype.
    """
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise DTypeError(f"`input_ids` must have an integer dtype, got {input_ids.dtype}")
    dtype = codebooks.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise DTypeError(f"Triton Leviathan supports fp32/bf16/fp16 parameters, got {dtype}")
    num_coords, base, seed_dim = codebooks.shape
    num_modes, _, num_knots, rank = head_spline_delta.shape
    hidden = head_out_weight.shape[-1]
    if num_knots > TRITON_MAX_KNOTS or rank > TRITON_MAX_RANK:
        raise ConfigError(f"Triton Leviathan supports num_knots <= {TRITON_MAX_KNOTS} and rank <= "
                          f"{TRITON_MAX_RANK}, got num_knots={num_knots}, rank={rank}")
    shape = input_ids.shape
    flat = input_ids.reshape(-1).long()
    n = flat.numel()
    vocab_size = leviathan_id_bound(vocab_size, base, num_coords)
    # out-of-range ids are evaluated as id 0 (keeping the distinct-id bound) and their rows set to NaN
    valid = ids_in_range(flat, vocab_size)
    flat = safe_ids(flat, valid)
    if knot_grid is None:
        knot_grid = torch.linspace(0.0, 1.0, num_knots, device=codebooks.device)
    grid = knot_grid.to(torch.float32).contiguous()
    if unique_ids and n > 1:
        rows, slot, count = distinct_ids(flat, min(n, vocab_size))
    else:
        rows, slot, count = flat, None, torch.full((1,), n, dtype=torch.int32, device=flat.device)
    coords = leviathan_digits(rows, base, num_coords)
    # The seed and its projection stay fp32 (the spec's allowed deviation, and what NeoLLM's
    # own kernel does): rounding y0 to bf16 moves M by 0.3 % at init (measured), an error
    # the product over d factors accumulates. The d×d projection is small next to the spline.
    z = codebooks[0, coords[:, 0]].float()
    for i in range(1, num_coords):
        z = z + codebooks[i, coords[:, i]].float()
    y0t = torch.matmul(head_proj_weight.float(), z.t()).contiguous()                   # [h, d, U] fp32
    m, _, _ = leviathan_spline(y0t, head_norm_weight.contiguous(), head_norm_bias.contiguous(),
                               head_spline_delta.contiguous(), grid, count)
    table = m.to(dtype) @ head_out_weight.reshape(num_modes * rank, hidden)          # [U, D], fp32 accumulation
    out = table if slot is None else table[slot]
    return nan_rows(out, valid).reshape(*shape, hidden)


def static_cases() -> Iterator[StaticCase]:
    for dt in ("fp32", "bf16", "fp16"):
        p = f"*{dt}"
        for block_k in (16, 32):
            for block_r in (16, 32, 64):
                yield StaticCase(
                    "leviathan_fwd", _fwd_kernel,
                    dict(y0t_ptr="*fp32", gamma_ptr=p, beta_ptr=p, wd_ptr=p, grid_ptr="*fp32", count_ptr="*i32",
                         m_ptr="*fp32", mean_ptr="*fp32", rstd_ptr="*fp32", N="i32", D="i32", KNOTS="i32",
                         R="i32", H="i32", scale="fp32"),
                    dict(BLOCK_N=BLOCK_N, BLOCK_R=block_r, BLOCK_K=block_k,
                         BLOCK_D=BLOCK_D), _fwd_warps(block_k, block_r), tags={"dtype": dt})
            for block_r in (16, 32, 64, 128):
                block_n, warps, stages = _bwd_config(block_k, block_r)
                yield StaticCase(
                    "leviathan_bwd_spline", _bwd_spline_kernel,
                    dict(y0t_ptr="*fp32", gamma_ptr=p, beta_ptr=p, wd_ptr=p, grid_ptr="*fp32", count_ptr="*i32",
                         m_ptr="*fp32", dm_ptr="*fp32", mean_ptr="*fp32", rstd_ptr="*fp32", dxhat_ptr="*fp32",
                         dwd_ptr="*fp32", dgamma_ptr="*fp32", dbeta_ptr="*fp32", N="i32", D="i32", KNOTS="i32",
                         R="i32", H="i32", scale="fp32"),
                    dict(BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_K=block_k), warps, stages,
                    tags={"dtype": dt})
    yield StaticCase(
        "leviathan_bwd_norm", _bwd_norm_kernel,
        dict(y0t_ptr="*fp32", dxhat_ptr="*fp32", mean_ptr="*fp32", rstd_ptr="*fp32", count_ptr="*i32",
             dy0t_ptr="*fp32", N="i32", D="i32"),
        dict(BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D), NUM_WARPS, tags={"dtype": "fp32"})


def tour_case(device: torch.device):
    from laminae.primitives.leviathan import LeviathanGenerator, leviathan_reference

    from .tour import TourCase

    torch.manual_seed(0)
    gen = LeviathanGenerator(vocab_size=1000, hidden_size=96, seed_dim=40, num_modes=3, num_knots=16, rank=24)
    with torch.no_grad():
        gen.head_norm_bias.normal_(0.0, 0.5)
    params = dict(zip(["codebooks", "head_proj_weight", "head_norm_weight", "head_norm_bias", "head_spline_delta",
                       "head_out_weight"], [p.detach().to(device) for p in gen._params()]))
    ids = torch.randint(0, 1000, (2, 37), generator=torch.Generator().manual_seed(1)).to(device)
    inputs = {"input_ids": ids, **params, "knot_grid": gen.knot_grid.to(device)}
    return TourCase("leviathan (V=1000, d=40, h=3, κ=16, r=24)", leviathan, leviathan_reference, inputs, list(params))
