"""Every launch configuration a GPU user gets (the 16-bit tiles, their code paths), run in
its own dtype on the interpreter against the float64 reference.

The runs are derived from each kernel's ``static_cases()`` and select their tiles through
the launch's own selection function, so a configuration added to a kernel runs here or
``make test --launch-coverage`` names it (tests/_launch_coverage.py). Shapes span two
tiles in every tiled dimension with a ragged last tile. Tolerances: ``_check``."""
import pytest
import torch

from laminae.triton_ops._parity import _run
from laminae.triton_ops.testing import FLOAT64_ABS_RMS

from .._helpers import DEVICE, FLOAT64_REL_RMSE, assert_matches_float64

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The tolerances, per dtype: relative RMSE to the float64 truth (FLOAT64_REL_RMSE: fp32
# 2e-5, fp16 5e-4, bf16 4e-3), or, in 16 bits, up to SAME_DTYPE_FACTOR times the distance
# from the truth of the reference run with every floating input in that dtype: a
# recurrence or a cancelling sum (HRM's gate gradient, shared_matrix's dσ) rounded in 16
# bits is past a fixed bound in the reference as well. A tile or mask bug is O(1).
SAME_DTYPE_FACTOR = 3


def _check(op, reference, inputs, grads, dtype, *, names=None, floors=None):
    """``op`` against the float64 reference, output and every gradient, by relative RMSE.

    ``names``: the outputs' names in messages (default out0, out1, ...). ``floors``: per
    gradient ("dx"), a function of the upstream gradients giving the float64 magnitude of
    the terms that gradient sums with cancellation (‖Σ|term|‖ rather than ‖Σ term‖): its
    bound is then also the relative RMSE of that magnitude, since the sum rounds like its
    terms in any dtype."""
    floors = floors or {}
    if dtype == torch.float32 and not floors:
        assert_matches_float64(op, reference, inputs, grads, dtype=dtype)
        return
    out_a, grad_a, up = _run(op, inputs, grads, None, 0, None)
    out_b, grad_b, _ = _run(reference, inputs, grads, up, 0, torch.float64)
    if dtype == torch.float32:
        out_c, grad_c = [None] * len(out_a), {}
    else:   # the reference with every floating input in the dtype
        cast = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in inputs.items()}
        out_c, grad_c, _ = _run(reference, cast, grads, up, 0, None)
    names = names or [f"out{i}" for i in range(len(out_a))]
    pairs = [(n, a, b, c) for n, a, b, c in zip(names, out_a, out_b, out_c)
             if isinstance(a, torch.Tensor) and a.is_floating_point()]
    pairs += [(f"d{k}", grad_a.get(k), grad_b.get(k), grad_c.get(k)) for k in grads]
    rel = FLOAT64_REL_RMSE[dtype]
    failures = []
    for name, a, b, c in pairs:
        if a is None or b is None:
            if a is not b:
                failures.append(f"{name}: one side has no gradient")
            continue
        a, b = a.detach().double(), b.detach().double()
        err, ref = float(torch.linalg.vector_norm(a - b)), float(torch.linalg.vector_norm(b))
        bound = rel * ref + FLOAT64_ABS_RMS * b.numel() ** 0.5
        note = ""
        if c is not None:
            same = float(torch.linalg.vector_norm(c.detach().double() - b))
            bound = max(bound, SAME_DTYPE_FACTOR * same)
            note = f"; the reference in {dtype}: {same / max(ref, 1e-30):.3e}"
        if name in floors:
            bound = max(bound, rel * float(torch.linalg.vector_norm(floors[name](up))))
        if not err <= bound:
            failures.append(f"{name}: ‖a−b‖ = {err:.3e} > {bound:.3e} (relative RMSE {err / max(ref, 1e-30):.3e}"
                            f"{note})")
    assert not failures, "op differs from the float64 truth:\n" + "\n".join(failures)


def _ids(runs):
    return ["-".join(str(p) for p in run) for run in runs]


# ----------------------------------------------------------------------------
# shared_matrix: (activations, weights) x tile x split
# ----------------------------------------------------------------------------

def _shared_matrix_runs():
    from laminae.triton_ops.shared_matrix import static_cases

    return sorted({(c.tags["x"], c.tags["weights"], c.tags["tile"], c.constexprs["SPLIT"])
                   for c in static_cases() if c.name == "shared_matrix_fwd"})


SHARED_MATRIX_RUNS = _shared_matrix_runs()


@pytest.mark.parametrize("x, weights, tile, split", SHARED_MATRIX_RUNS, ids=_ids(SHARED_MATRIX_RUNS))
def test_shared_matrix_every_tile_against_float64(x, weights, tile, split):
    """Forward, dx and dW (the weight gradient with and without a delta) at each tile."""
    from laminae.primitives.shared_matrix import shared_matrix_reference
    from laminae.triton_ops.shared_matrix import DW_TILES, SMALL_M, TILES, _dtype_class, _tile, shared_matrix

    dtype, pdtype = _DTYPES[x], _DTYPES[weights]
    block_m, block_n, block_k = TILES[_dtype_class(dtype)][tile][:3]
    block_r, block_c = DW_TILES[_dtype_class(dtype)][:2]
    # tokens pick the tile (a decode-sized batch stays within one BLOCK_M); rows and
    # columns span two output tiles of fwd, dx and dW, ragged, and several K steps
    m = SMALL_M if tile == "small_m" else block_m + 3
    assert _tile(m, dtype)[:3] == (block_m, block_n, block_k)
    rows, cols = max(block_n, block_r, block_k) + 5, max(block_n, block_c, block_k) + 3
    gen = torch.Generator().manual_seed(3)
    inp = {"x": torch.randn(m, cols, generator=gen).to(DEVICE, dtype),
           "weight": (torch.randn(rows + 2, cols + 4, generator=gen) * cols ** -0.5).to(DEVICE, pdtype),
           "scale": torch.tensor([0.8], device=DEVICE, dtype=pdtype),
           "rows": rows, "cols": cols, "ratio": 3.0 if split else 1.0, "output_divisor": 2.0}
    if split:
        inp["delta"] = torch.randn(rows + 2, cols + 4, generator=gen).to(DEVICE, pdtype)
    grads = [k for k in ("x", "weight", "delta", "scale") if k in inp]
    _check(shared_matrix, shared_matrix_reference, inp, grads, dtype)


# ----------------------------------------------------------------------------
# LAuReL: dtype x (learned weights, low-rank term) x rank tile
# ----------------------------------------------------------------------------

def _laurel_runs():
    from laminae.triton_ops.laurel import static_cases

    return sorted({(c.tags["dtype"], c.constexprs["HAS_RW"], c.constexprs["HAS_LR"], c.constexprs["BLOCK_R"])
                   for c in static_cases() if c.name == "laurel_fwd" and (c.constexprs["HAS_LR"] or
                                                                         c.constexprs["BLOCK_R"] == 16)})


LAUREL_RUNS = _laurel_runs()


@pytest.mark.parametrize("dtype, rw, lr, block_r", LAUREL_RUNS, ids=_ids(LAUREL_RUNS))
def test_laurel_every_configuration_against_float64(dtype, rw, lr, block_r):
    from laminae.primitives.laurel import laurel_lr_init, laurel_reference
    from laminae.triton_ops.laurel import BLOCK_D, BLOCK_M, _block_r, laurel

    # a rank inside the 16 tile, or two rank steps of the widest tile (ragged)
    rank = block_r - 3 if block_r < 32 else block_r + 5
    assert not lr or _block_r(rank) == block_r
    rows, d = BLOCK_M + 3, BLOCK_D + 2
    gen = torch.Generator().manual_seed(5)
    inp = {"sublayer_output": torch.randn(rows, d, generator=gen).to(DEVICE, _DTYPES[dtype]),
           "x": torch.randn(rows, d, generator=gen).to(DEVICE, _DTYPES[dtype])}
    if rw:
        inp["alpha_logit"], inp["beta_logit"] = torch.tensor(0.7, device=DEVICE), torch.tensor(-0.4, device=DEVICE)
    if lr:
        inp["lr_A"] = (laurel_lr_init(d, rank) + 0.1 * torch.randn(d, rank, generator=gen)).to(DEVICE)
        inp["lr_B"] = (0.2 * torch.randn(rank, d, generator=gen)).to(DEVICE)
    _check(laurel, laurel_reference, inp, list(inp), _DTYPES[dtype])


# ----------------------------------------------------------------------------
# XSA: dtype x normalized, with a GQA group and a ragged head dim
# ----------------------------------------------------------------------------

XSA_RUNS = sorted({(c.tags["dtype"], c.constexprs["NORMALIZED"])
                   for c in __import__("laminae.triton_ops.xsa", fromlist=["static_cases"]).static_cases()})


@pytest.mark.parametrize("dtype, normalized", XSA_RUNS, ids=_ids(XSA_RUNS))
def test_xsa_every_configuration_against_float64(dtype, normalized):
    from laminae.primitives.xsa import xsa_reference
    from laminae.triton_ops.xsa import _blocks, xsa

    heads, kv_heads, dim = 4, 2, 24
    block_r = _blocks(heads // kv_heads, dim)[0]
    gen = torch.Generator().manual_seed(6)
    rows = 2 * block_r + 1   # (batch x seq x kv heads) rows: two row tiles and a ragged one
    seq = -(-rows // kv_heads)
    inp = {"y": torch.randn(1, seq, heads, dim, generator=gen).to(DEVICE, _DTYPES[dtype]),
           "v": torch.randn(1, seq, kv_heads, dim, generator=gen).to(DEVICE, _DTYPES[dtype]),
           "mode": "normalized" if normalized else "squared_norm"}
    _check(xsa, xsa_reference, inp, ["y", "v"], _DTYPES[dtype])


# ----------------------------------------------------------------------------
# HRM refinement: each dtype runs every row kernel (with and without update and norm)
# ----------------------------------------------------------------------------

HRM_DTYPES = sorted({c.tags["dtype"] for c in
                     __import__("laminae.triton_ops.hrm_refinement", fromlist=["static_cases"]).static_cases()})


@pytest.mark.parametrize("dtype", HRM_DTYPES)
def test_hrm_refinement_every_dtype_against_float64(dtype):
    from laminae.primitives.hrm_refinement import hrm_refinement_reference
    from laminae.triton_ops.hrm_refinement import hrm_refinement

    rows, d, refine, steps = 5, 20, 6, 3
    gen = torch.Generator().manual_seed(7)
    inp = {"x": torch.randn(rows, d, generator=gen).to(DEVICE, _DTYPES[dtype]),
           "norm_weight": (1 + 0.3 * torch.randn(d, generator=gen)).to(DEVICE),
           "down_weight": (torch.randn(refine, 2 * d, generator=gen) / d ** 0.5).to(DEVICE),
           "up_weight": (torch.randn(d, refine, generator=gen) / refine ** 0.5).to(DEVICE),
           "gate": torch.randn(steps, generator=gen).to(DEVICE)}
    _check(hrm_refinement, hrm_refinement_reference, inp, list(inp), _DTYPES[dtype])


# ----------------------------------------------------------------------------
# SiameseNorm: dtype x the flag sets the modules launch, a row kernel and a chunked one
# ----------------------------------------------------------------------------

def _siamese_runs():
    from laminae.triton_ops.siamese_norm import BWD_MAX_ROW_BLOCK, static_cases

    flags = {}
    for c in static_cases():
        if c.name == "siamese_fwd":
            flags[(c.tags["dtype"], c.tags["flags"])] = {k: v for k, v in c.constexprs.items() if k != "BLOCK_D"}
    # a row in one block, and one wider than BWD_MAX_ROW_BLOCK (the chunked backward)
    return [(dt, label, f, d) for (dt, label), f in sorted(flags.items()) for d in (40, BWD_MAX_ROW_BLOCK + 5)]


SIAMESE_RUNS = _siamese_runs()


@pytest.mark.parametrize("dtype, label, flags, d", SIAMESE_RUNS, ids=[f"{r[0]}-{r[1]}-{r[3]}" for r in SIAMESE_RUNS])
def test_siamese_norm_every_configuration_against_float64(dtype, label, flags, d):
    from laminae.primitives.siamese_norm import siamese_boundary_reference
    from laminae.triton_ops.siamese_norm import siamese_boundary

    gen = torch.Generator().manual_seed(8)

    def act(scale=1.0):
        return (torch.randn(3, d, generator=gen) * scale).to(DEVICE, _DTYPES[dtype])

    def weight():
        return (1.0 + 0.3 * torch.randn(d, generator=gen)).to(DEVICE)

    inp = {"x": act(), "y": act(3.0), "c_inv": 0.5}
    for flag, name, make in (("HAS_UPD", "update", act), ("HAS_SCALE", "x_scale", weight),
                             ("HAS_XNORM", "x_norm_weight", weight), ("HAS_YNORM", "y_norm_weight", weight),
                             ("HAS_INNORM", "in_norm_weight", weight)):
        if flags[flag]:
            inp[name] = make()
    # the launcher stores x and y only when they change, and h only when asked for
    inp["return_streams"] = flags["STORE_X"] or flags["STORE_Y"]
    inp["return_h"] = flags["STORE_H"]
    grads = [k for k, v in inp.items() if isinstance(v, torch.Tensor)]
    _check(siamese_boundary, siamese_boundary_reference, inp, grads, _DTYPES[dtype])


# ----------------------------------------------------------------------------
# LUCID: every tile row without a mask and with a unit diagonal, and decoding unmasked
# (test_lucid_attention.py::test_every_launch_configuration_against_float64 runs each
# tile row masked, computed diagonal)
# ----------------------------------------------------------------------------

def _lucid_runs():
    from laminae.triton_ops.lucid_attention import static_cases

    return sorted({(c.tags["dtype"], c.constexprs["BLOCK_D"], c.constexprs["HAS_MASK"], c.constexprs["UNIT_DIAG"])
                   for c in static_cases() if c.name == "lucid_prep"
                   and not (c.constexprs["HAS_MASK"] and not c.constexprs["UNIT_DIAG"])})


LUCID_RUNS = _lucid_runs()


@pytest.mark.parametrize("dtype, bd, masked, unit", LUCID_RUNS, ids=_ids(LUCID_RUNS))
def test_lucid_every_mask_and_diagonal_against_float64(dtype, bd, masked, unit):
    import contextlib
    import importlib

    from laminae.primitives.lucid_attention import lucid_extend, lucid_key_norm, lucid_precondition_reference
    from laminae.triton_ops.lucid_attention import lucid_precondition, lucid_precondition_extend

    from .test_lucid_attention import FLOAT64_TOLERANCE, _inputs, assert_float64_truth, gpu_tf32

    lucid_ops = importlib.import_module("laminae.triton_ops.lucid_attention")
    dtype = _DTYPES[dtype]
    t = lucid_ops.tiles(bd, dtype)
    n = t.block + 7   # two key blocks, the last ragged
    inp = _inputs(1, 1, n, 2, 2, bd, masked, 1.0, bd, dtype, correlated=0.3)
    del inp["q"]

    def op(**kw):
        return lucid_precondition(**kw, unit_diagonal=unit)

    def reference(**kw):
        return lucid_precondition_reference(**kw, unit_diagonal=unit)

    with gpu_tf32() if dtype != torch.float32 else contextlib.nullcontext():
        assert_float64_truth(op, reference, inp, ["k", "v"], dtype)
        if masked or unit:
            return
        keys, values = inp["k"], inp["v"]
        v_prime = lucid_precondition_reference(keys.double(), values.double())
        ones = torch.ones(keys.shape[:2], dtype=torch.bool, device=DEVICE)
        k_hat = lucid_key_norm(keys.double())
        for new in (1, lucid_ops.DECODE_ROWS + 3):   # the 16-row cache panel, then block-row panels
            c = n - new
            got = lucid_precondition_extend(keys[:, :c], v_prime[:, :c].float(), keys[:, c:], values[:, c:])
            want = lucid_extend(k_hat[:, :c], v_prime[:, :c], ones[:, :c], k_hat[:, c:], values[:, c:].double(),
                                ones[:, c:])
            err = float(torch.linalg.vector_norm(got.double() - want) / torch.linalg.vector_norm(want))
            assert err <= FLOAT64_TOLERANCE[dtype][0], f"decoding {new} keys after {c}: rel RMSE {err:.2e}"
