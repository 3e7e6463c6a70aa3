import importlib
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from laminae.primitives import DeviceError, DTypeError, ShapeError
from laminae.primitives.mom_read import MoMRead, collect_mom_aux_loss, mom_read_reference
from laminae.triton_ops._parity import parity
from laminae.triton_ops.mom_read import MoMTiles, mom_read, mom_read_fwd, pair_schedule, tour_case

from .._helpers import DEVICE, assert_matches_float64, assert_parity, scales, seeds

mom_mod = importlib.import_module("laminae.triton_ops.mom_read")  # the kernel file, not the function

GRADS = ["q", "k_bank", "v_bank", "top_gates"]
# The smallest tiles tl.dot takes, with BLOCK_M != BLOCK_N both ways round: blocks of
# 17+ slots span several (masked-tail) chunks, blocks read by 17+ pairs several pair
# tiles. The default fp32 tiles (32 x 32) run when ``small`` is False.
SMALL = MoMTiles(block_m=32, block_n=16, fwd_warps=1, dq_warps=1, dkdv_m=16, dkdv_n=32, dkdv_warps=1, merge_t=16)


@contextmanager
def small_tiles(enabled: bool = True):
    original = mom_mod.tiles
    if enabled:
        mom_mod.tiles = lambda head_dim, dtype: SMALL
    try:
        yield
    finally:
        mom_mod.tiles = original


def _inputs(B, S, H, hd, E, bs, tk, scale, seed, dtype=torch.float32, never=()):
    """Routing from random logits (distinct blocks per token; blocks in ``never``
    are selected by no token), gates = softmax of the selected logits."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, E, generator=gen) * 2
    for e in never:
        logits[..., e] = -1e4
    values, idx = logits.topk(tk, dim=-1)
    return {
        "q": (torch.randn(B, S, H, hd, generator=gen) * scale).to(DEVICE, dtype),
        "k_bank": (torch.randn(E * bs, H * hd, generator=gen) * scale).to(DEVICE, dtype),
        "v_bank": (torch.randn(E * bs, H * hd, generator=gen) * scale).to(DEVICE, dtype),
        "top_idx": idx.to(DEVICE),
        "top_gates": torch.softmax(values, -1).to(DEVICE),
        "block_size": bs,
    }


def reference_in_float64(q, k_bank, v_bank, top_idx, top_gates, block_size):
    """The reference evaluated in float64 and cast back: the truth for fp32 parity.

    At large value scales a gate's gradient dL/dg = dL/dlg / g divides a difference
    of nearly equal fp32 numbers by g (a block holding almost all the softmax mass
    has Σ_j dS_j = c_t − W_t·δ with W_t ≈ 1), so the fp32 reference itself can be
    off by more than the fp32 tolerance there; the kernel forms that sum pairwise
    and stays within tolerance of the float64 truth."""
    out = mom_read_reference(q.double(), k_bank.double(), v_bank.double(), top_idx, top_gates.double(),
                             block_size)
    return out.to(q.dtype)


@st.composite
def routing(draw):
    E = draw(st.integers(2, 6))
    return E, draw(st.integers(1, min(3, E)))


@given(B=st.integers(1, 2), S=st.integers(1, 24), H=st.integers(1, 2), et=routing(),
       bs=st.sampled_from([1, 3, 8, 19]), hd=st.sampled_from([8, 16, 32]), scale=scales, seed=seeds,
       small=st.booleans())
def test_kernel_matches_reference_fp32(B, S, H, et, bs, hd, scale, seed, small):
    E, tk = et
    inp = _inputs(B, S, H, hd, E, bs, tk, scale, seed)
    with small_tiles(small):
        assert_parity(mom_read, reference_in_float64, inp, GRADS)


@given(B=st.integers(1, 3), S=st.integers(1, 40), et=routing(), block_m=st.sampled_from([16, 32, 64]), seed=seeds)
def test_pair_schedule_tiles_every_pair_once_within_one_block(B, S, et, block_m, seed):
    E, tk = et
    idx = _inputs(B, S, 1, 8, E, 1, tk, 1.0, seed)["top_idx"]
    order, offsets, table = pair_schedule(idx, E, block_m)
    flat = idx.reshape(-1)
    assert torch.equal(flat[order.long()], flat.sort(stable=True).values)
    offs = offsets.tolist()
    assert offs == [int((flat < e).sum()) for e in range(E + 1)]
    covered = []
    for e, lo, hi in table.tolist():
        if lo == hi:           # a row past the real tile count: its program exits
            continue
        assert offs[e] <= lo < hi == offs[e + 1]
        covered += range(lo, min(lo + block_m, hi))
    assert sorted(covered) == list(range(flat.numel()))
    assert table.shape[0] == min(flat.numel(), -(-flat.numel() // block_m) + E)


def test_float32_reference_parity_at_unit_scale():
    inp = _inputs(2, 13, 2, 16, 5, 3, 3, 1.0, 11)
    assert_parity(mom_read, mom_read_reference, inp, GRADS)


def test_default_tiles_span_several_chunks_and_pair_tiles():
    # bs = 40 > 32 slots per chunk; 40 pairs per block > 32 pairs per tile
    inp = _inputs(1, 40, 1, 24, 2, 40, 2, 1.0, 5)
    assert_parity(mom_read, mom_read_reference, inp, GRADS)


def test_fp16_with_the_gpu_tiles():
    """The 16-bit tiles the GPU launches at hd 64 (64-pair tiles, 64-slot chunks, 8-warp
    dK/dV), run by the interpreter in fp16 (numpy's own 16-bit float): a block of
    70 slots spans a full and a masked chunk, 80 pairs of a block span two tiles."""
    assert mom_mod.tiles(64, torch.float16) == MoMTiles(64, 64, 4, 4, 64, 64, 8, 16)
    inp = _inputs(2, 40, 1, 64, 2, 70, 2, 1.0, 12, dtype=torch.float16)
    assert_parity(mom_read, mom_read_reference, inp, GRADS, dtype=torch.float16)


# Every tile row the CUDA path launches, in its own dtype against the float64 truth.
# The rows come from ``static_cases()`` (a configuration added there runs here), each
# picked by ``fit_chunks(tiles(...))`` as the op picks it: a block of ``cap`` slots gets
# chunks ``cap`` wide. One call launches the row's forward, merge, dq, dK/dV and dq
# merge kernels. Such a block is a single chunk, so ``tiles`` is forced to the row and
# the block grows to two chunks and a ragged third of the row's widest chunk. 130
# tokens, each reading both blocks, give 130 pairs per block (two 64-pair tiles and a
# ragged third) and three merge tiles; the head dim (BLOCK_D − 8) is ragged inside its
# padded width. The pair and dq partials are stored in the input dtype, merged in fp32.
_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _launch_rows():
    rows = set()
    for case in mom_mod.static_cases():
        if "BLOCK_N" in case.constexprs:
            dtype, bd, cap = _DTYPE_NAMES[case.tags["dtype"]], case.constexprs["BLOCK_D"], case.constexprs["BLOCK_N"]
            t = mom_mod.fit_chunks(mom_mod.tiles(bd - 8, dtype), cap, dtype)
            assert cap in (t.block_n, t.dkdv_n), (case.name, case.constexprs, t)
            rows.add((case.tags["dtype"], bd, t))
    return sorted(rows, key=lambda r: (r[0], r[1], r[2].block_n, r[2].dkdv_n))


LAUNCH_ROWS = _launch_rows()


@pytest.mark.parametrize("dtype, bd, row", LAUNCH_ROWS,
                         ids=[f"{d}-d{bd}-n{t.block_n}-{t.dkdv_n}" for d, bd, t in LAUNCH_ROWS])
def test_every_launch_tile_row_matches_float64(dtype, bd, row, monkeypatch):
    dtype, hd = _DTYPE_NAMES[dtype], bd - 8
    assert mom_mod.block_d(hd) == bd
    tokens = 2 * max(row.block_m, row.dkdv_m, row.merge_t) + 2
    bs = 2 * max(row.block_n, row.dkdv_n) + 3
    assert mom_mod.fit_chunks(row, bs, dtype) == row
    inp = _inputs(1, tokens, 2, hd, 2, bs, 2, 1.0, 13, dtype=dtype)
    monkeypatch.setattr(mom_mod, "tiles", lambda head_dim, dt: row)
    assert_matches_float64(mom_read, mom_read_reference, inp, GRADS, dtype=dtype)


def test_single_token_reads_one_pair_per_block():
    inp = _inputs(1, 1, 2, 16, 4, 3, 2, 1.0, 4)
    assert_parity(mom_read, mom_read_reference, inp, GRADS)


def test_gate_below_the_floor_is_clamped_and_gets_zero_gradient():
    inp = _inputs(1, 5, 2, 16, 4, 3, 2, 1.0, 6)
    inp["top_gates"] = inp["top_gates"].clone()
    inp["top_gates"][0, 1] = torch.tensor([1.0, 1e-12])
    result = assert_parity(mom_read, mom_read_reference, inp, GRADS)
    gates = inp["top_gates"].clone().requires_grad_(True)
    out = mom_read(inp["q"], inp["k_bank"], inp["v_bank"], inp["top_idx"], gates, 3)
    out.sum().backward()
    assert gates.grad[0, 1, 1] == 0 and torch.isfinite(gates.grad).all()
    assert result.ok


@pytest.mark.parametrize("small", [False, True])
def test_unselected_slots_are_never_read(small):
    """NaN in every bank row of a block no token selects: output and gradients are
    unchanged, and those rows get exactly zero gradient."""
    E, bs = 5, 4
    inp = _inputs(2, 9, 2, 16, E, bs, 2, 1.0, 7, never=(1, 4))
    assert not bool(((inp["top_idx"] == 1) | (inp["top_idx"] == 4)).any())
    poisoned = dict(inp)
    for name in ("k_bank", "v_bank"):
        t = inp[name].clone()
        t[1 * bs:2 * bs] = float("nan")
        t[4 * bs:5 * bs] = float("nan")
        poisoned[name] = t
    results = []
    for case in (inp, poisoned):
        leaves = {k: (v.clone().requires_grad_(True) if k in GRADS else v) for k, v in case.items()}
        with small_tiles(small):
            out = mom_read(**leaves)
            grads = torch.autograd.grad(out, [leaves[k] for k in GRADS], torch.ones_like(out))
        results.append((out, grads))
    assert torch.isfinite(results[1][0]).all()
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)
    for grad in results[1][1][1:3]:
        assert torch.all(grad[1 * bs:2 * bs] == 0) and torch.all(grad[4 * bs:] == 0)


def test_log_gate_gradient_sums_to_zero_per_token():
    inp = _inputs(2, 7, 2, 16, 5, 3, 3, 1.0, 8)
    lg = torch.log(inp["top_gates"]).requires_grad_(True)
    o, _ = mom_read_fwd(inp["q"], inp["k_bank"], inp["v_bank"], inp["top_idx"], lg, 3)
    (o * torch.randn_like(o)).sum().backward()
    torch.testing.assert_close(lg.grad.sum(-1), torch.zeros(2, 7, device=DEVICE), atol=1e-5, rtol=0)


def test_two_runs_are_bitwise_identical():
    inp = _inputs(1, 6, 2, 16, 4, 4, 2, 1.0, 9)
    runs = []
    for _ in range(2):
        leaves = {k: (v.clone().requires_grad_(True) if k in GRADS else v) for k, v in inp.items()}
        out = mom_read(**leaves)
        runs.append((out, torch.autograd.grad(out, [leaves[k] for k in GRADS], torch.ones_like(out))))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_tour_case_is_within_tolerance():
    case = tour_case(DEVICE)
    result = parity(case.op, case.reference, case.inputs, case.grad_names)
    assert result.ok, result.report()


def test_module_backends_agree_in_training_including_parameter_and_aux_grads():
    results = []
    x0 = torch.randn(2, 9, 32, device=DEVICE)
    for backend in ("reference", "triton"):
        torch.manual_seed(0)
        m = MoMRead(32, 2, 24, 4, 2, 6, initializer_range=0.3, backend=backend).to(DEVICE).train()
        with torch.no_grad():
            m.mom_scale.fill_(0.7)
        bank = torch.nn.Parameter(MoMRead.init_bank(6, 4, 32, std=0.5).to(DEVICE))
        x = x0.clone().requires_grad_(True)
        torch.manual_seed(1)  # the same Gumbel draw for both backends
        y, _ = m(x, M_blocks=bank)
        loss = (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)).sum()
        loss = loss + 0.01 * collect_mom_aux_loss([m])
        grads = torch.autograd.grad(loss, [x, bank, *m.parameters()])
        results.append((y, grads))
    torch.testing.assert_close(results[1][0], results[0][0], atol=2e-5, rtol=2e-4)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_module_decode_with_triton_matches_full_forward():
    torch.manual_seed(3)
    m = MoMRead(32, 2, 24, 4, 2, 6, initializer_range=0.3, backend="triton").to(DEVICE).eval()
    with torch.no_grad():
        m.mom_scale.fill_(1.0)
    bank = torch.randn(6, 4 * 32, device=DEVICE)
    x = torch.randn(2, 12, 32, device=DEVICE)
    with torch.no_grad():
        full, _ = m(x, M_blocks=bank)
        out, state = m(x[:, :4], cache=m.empty_cache(x.shape[0]), M_blocks=bank)
        outs = [out]
        for t in range(4, 12):
            out, state = m(x[:, t:t + 1], M_blocks=bank, cache=state)
            outs.append(out)
        m.backend = "reference"
        reference, _ = m(x, M_blocks=bank)
    torch.testing.assert_close(full, reference, atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-6, rtol=1e-5)


def test_triton_rejects_bad_inputs():
    inp = _inputs(1, 3, 2, 8, 4, 2, 2, 1.0, 0)
    with pytest.raises(DTypeError):
        mom_read(**(inp | {k: inp[k].double() for k in ("q", "k_bank", "v_bank")}))
    with pytest.raises(DTypeError, match="k_bank"):
        mom_read(**(inp | {"k_bank": inp["k_bank"].half()}))
    with pytest.raises(DTypeError, match="top_idx"):
        mom_read(**(inp | {"top_idx": inp["top_idx"].float()}))
    with pytest.raises(ShapeError, match="head_dim"):
        mom_read(**(inp | {"q": torch.randn(1, 3, 1, 144, device=DEVICE),
                           "k_bank": torch.randn(8, 144, device=DEVICE),
                           "v_bank": torch.randn(8, 144, device=DEVICE)}))
    with pytest.raises(ShapeError, match="multiple of block_size"):
        mom_read(**(inp | {"block_size": 3}))
    with pytest.raises(ShapeError, match="top_gates"):
        mom_read(**(inp | {"top_gates": inp["top_gates"][..., :1]}))
    with pytest.raises(DeviceError, match="top_idx"):
        mom_read(**(inp | {"top_idx": inp["top_idx"].to("meta")}))
    # value checks read back to the host: behind validate=True / LAMINAE_DEBUG=1
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        mom_read(**(inp | {"top_idx": inp["top_idx"] + 3}), validate=True)
    with pytest.raises(ValueError, match="distinct"):
        mom_read(**(inp | {"top_idx": inp["top_idx"][..., :1].repeat(1, 1, 2)}), validate=True)


def test_index_value_checks_follow_laminae_debug(monkeypatch):
    inp = _inputs(1, 3, 2, 8, 4, 2, 2, 1.0, 0)
    bad = inp | {"top_idx": inp["top_idx"] + 3}
    monkeypatch.setenv("LAMINAE_DEBUG", "1")
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        mom_read(**bad)
    mom_read(**bad, validate=False)   # out-of-range pairs read no bank row
    monkeypatch.setenv("LAMINAE_DEBUG", "0")
    mom_read(**bad)


def test_opcheck_schema_and_autograd_registration():
    inp = _inputs(2, 5, 2, 16, 4, 3, 2, 1.0, 1)
    args = (inp["q"].requires_grad_(True), inp["k_bank"].requires_grad_(True), inp["v_bank"].requires_grad_(True),
            inp["top_idx"], torch.log(inp["top_gates"]).requires_grad_(True), 3)
    # the fake-tensor and AOT checks would run the interpreter on meta tensors: GPU test below
    torch.library.opcheck(mom_read_fwd, args, test_utils=("test_schema", "test_autograd_registration"))


# ----------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hd", [64, 128])
def test_kernel_matches_reference_low_precision(dtype, hd):
    inp = _inputs(2, 300, 4, hd, 8, 64, 2, 1.0, 0, dtype=dtype)
    assert_parity(mom_read, mom_read_reference, inp, GRADS, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("hd", [16, 64, 128])
def test_kernel_matches_reference_fp32_gpu_default_tiles(hd):
    inp = _inputs(2, 200, 4, hd, 8, 48, 3, 1.0, 1)
    assert_parity(mom_read, mom_read_reference, inp, GRADS)


@pytest.mark.gpu
def test_forward_and_backward_never_sync_with_the_host():
    inp = _inputs(2, 300, 4, 64, 8, 64, 2, 1.0, 4, dtype=torch.bfloat16)
    leaves = {k: (v.clone().requires_grad_(True) if k in GRADS else v) for k, v in inp.items()}
    mom_read(**leaves).float().sum().backward()   # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mom_read(**leaves)
        torch.autograd.grad(out, [leaves[k] for k in GRADS], torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_opcheck_full_gpu():
    inp = _inputs(2, 65, 4, 64, 8, 32, 2, 1.0, 2)
    args = (inp["q"].requires_grad_(True), inp["k_bank"].requires_grad_(True), inp["v_bank"].requires_grad_(True),
            inp["top_idx"], torch.log(inp["top_gates"]).requires_grad_(True), 32)
    torch.library.opcheck(mom_read_fwd, args)


@pytest.mark.gpu
def test_compile_fullgraph_smoke():
    inp = _inputs(2, 128, 8, 64, 8, 64, 2, 1.0, 3, dtype=torch.bfloat16)
    leaves = {k: (v.clone().requires_grad_(True) if k in GRADS else v) for k, v in inp.items()}
    compiled = torch.compile(mom_read, fullgraph=True)
    out = compiled(**leaves)
    out.float().sum().backward()
    torch.testing.assert_close(out, mom_read(**inp))
    m = MoMRead(512, 8, 512, 64, 2, 32, backend="triton").cuda().eval()
    bank = MoMRead.init_bank(8, 64, 512).cuda()
    x = torch.randn(2, 128, 512, device="cuda")
    y, _ = torch.compile(m, fullgraph=True)(x, M_blocks=bank)
    torch.testing.assert_close(y, m(x, M_blocks=bank)[0])
