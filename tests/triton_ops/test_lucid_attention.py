import contextlib
import importlib
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from laminae.primitives import ConfigError, DTypeError, ShapeError
from laminae.primitives.lucid_attention import (
    LucidAttention,
    lucid_attention_reference,
    lucid_extend,
    lucid_key_norm,
    lucid_matrix,
    lucid_precondition_reference,
)
from laminae.triton_ops._parity import FLOAT64_ABS_RMS, _run, parity
from laminae.triton_ops.lucid_attention import lucid_attention, lucid_precondition, lucid_precondition_extend

from .._decoding import prefill_then_decode
from .._helpers import DEVICE, assert_matches_float64, assert_parity, scales, seeds

lucid_ops = importlib.import_module("laminae.triton_ops.lucid_attention")  # the kernel file, not the function

LOW = (torch.bfloat16, torch.float16)

# Relative RMSE against the reference run in float64, per dtype: (outputs, gradients).
# bf16/fp16: the products take 16-bit operands (the panels L·V′, dS·k̂, dV·V′ᵀ) and the
# results are rounded to the input dtype; measured with correlated keys (L far from the
# identity) at most 8e-3/2.6e-2 (bf16) and 1e-3/2.7e-3 (fp16), with GPU TF32 rounding
# emulated (see ``gpu_tf32``).
FLOAT64_TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 6e-2), torch.float16: (3e-3, 8e-3)}


def assert_float64_truth(op, reference, inputs, grad_names, dtype):
    """‖op − reference(float64)‖ ≤ tol·‖reference‖ + FLOAT64_ABS_RMS·√n per output and
    gradient, tol from FLOAT64_TOLERANCE (the rule of ``parity_float64``, per direction)."""
    fwd, bwd = FLOAT64_TOLERANCE[dtype]
    out_a, grad_a, upstream = _run(op, inputs, grad_names, None, 0, None)
    out_b, grad_b, _ = _run(reference, inputs, grad_names, upstream, 0, torch.float64)
    pairs = [(f"out{i}", a, b, fwd) for i, (a, b) in enumerate(zip(out_a, out_b))]
    pairs += [(f"d{name}", grad_a[name], grad_b[name], bwd) for name in grad_names]
    report = []
    for name, a, b, tol in pairs:
        a, b = a.detach().double(), b.detach().double()
        err, ref = float(torch.linalg.vector_norm(a - b)), float(torch.linalg.vector_norm(b))
        ok = err <= tol * ref + FLOAT64_ABS_RMS * max(1, b.numel()) ** 0.5
        report.append(f"{'ok  ' if ok else 'FAIL'} {name}: rel RMSE {err / max(ref, 1e-30):.2e} (tolerance {tol})")
    assert all(line.startswith("ok") for line in report), f"{dtype}, vs float64:\n" + "\n".join(report)


@contextmanager
def forced_tiles(block: int = 16, block_dv: int = 32, dk_block_n: int = 16, dk_cols: int | None = None):
    """Force small tiles so short sequences cross several block rows (the right-looking
    updates, the fp32 accumulator from the third block row on, partial last blocks).
    ``block_dv=16`` splits head dim 32 over two substitution programs and ``dk_cols=16``
    splits the dk̂ kernel's head dim, as the GPU tiles do at head dim 128; dk̂ key tiles
    smaller than the blocks take the GPU's BLOCK_N < BLOCK path."""
    original = lucid_ops.tiles

    def small(head_dim, dtype):
        bd = lucid_ops.block_d(head_dim)
        return lucid_ops.Tiles(block, block_dv, 4, 4, min(block, dk_block_n), min(dk_cols or bd, bd))

    lucid_ops.tiles = small
    try:
        yield
    finally:
        lucid_ops.tiles = original


def _tf32(x: np.ndarray) -> np.ndarray:
    """fp32 rounded to TF32 (10 mantissa bits, to nearest even), as the tensor cores read it."""
    bits = x.astype(np.float32).view(np.uint32)
    bits = (bits + np.uint32(0xFFF) + ((bits >> 13) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return bits.view(np.float32)


@contextmanager
def gpu_tf32():
    """The interpreter's ``tl.dot`` on fp32 operands as the GPU computes it: "tf32"
    rounds both operands to TF32, "tf32x3" sums the three TF32 products of the
    split operands (big·big + big·small + small·big); the interpreter itself multiplies
    fp32 exactly whatever the precision asked."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, precision, max_num_imprecise_acc):
        if a.data.dtype == np.float32 and precision in (ir.INPUT_PRECISION.TF32, ir.INPUT_PRECISION.TF32x3):
            a_big, b_big = _tf32(a.data), _tf32(b.data)
            prod = a_big @ b_big
            if precision == ir.INPUT_PRECISION.TF32x3:
                prod += a_big @ _tf32(b.data - b_big) + _tf32(a.data - a_big) @ b_big
            return interpreter.TensorHandle((prod + d.data).astype(np.float32), d.dtype.scalar)
        return original(self, a, b, d, precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original


def _inputs(B, S, N, H, HKV, D, masked, scale, seed, dtype=torch.float32, correlated=0.0):
    """q, k, v (and a ragged keep mask). ``correlated`` > 0: keys share a common
    direction (k = c + correlated·noise), so L is far from the identity below the diagonal."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=gen) * scale
    k = torch.randn(B, N, HKV, D, generator=gen)
    if correlated:
        k = torch.randn(1, 1, HKV, D, generator=gen) + correlated * k
    inp = {"q": q.to(DEVICE, dtype), "k": (k * scale).to(DEVICE, dtype),
           "v": (torch.randn(B, N, HKV, D, generator=gen) * scale).to(DEVICE, dtype)}
    if masked:
        keep = torch.rand(B, N, generator=gen) > 0.3
        keep[0, : min(3, N)] = False  # left padding
        if B > 1:
            keep[1, -1] = True
        inp["attention_mask"] = keep.to(DEVICE)
    return inp


heads = st.sampled_from([(1, 1), (2, 1), (4, 2)])


@given(B=st.integers(1, 2), S=st.integers(1, 40), extra=st.integers(0, 12), hk=heads,
       D=st.sampled_from([8, 16, 32]), masked=st.booleans(), scale=scales, unit=st.booleans(),
       correlated=st.sampled_from([0.0, 0.3]), block=st.sampled_from([16, 32]), split=st.booleans(), seed=seeds)
def test_kernel_matches_float64(B, S, extra, hk, D, masked, scale, unit, correlated, block, split, seed):
    """Against float64, the absolute terms at the size of the scores (scale²): at scale 4
    the fp32 reference and the kernel are each up to 2e-5 from the truth on an output
    element (sharp softmax), so 2.8e-5 apart, past the fp32-vs-fp32 element tolerance."""
    H, HKV = hk
    inp = _inputs(B, S, S + extra, H, HKV, D, masked, scale, seed, correlated=correlated)
    if unit:  # spec open point 1 alternative (eps = 1e-4 moves the computed diagonal of small keys off 1)
        inp.update(eps=1e-4, unit_diagonal=True)
    with forced_tiles(block, dk_cols=16 if split else None):
        assert_matches_float64(lucid_attention, lucid_attention_reference, inp, ["q", "k", "v"],
                               magnitude=max(1.0, scale) ** 2)


@given(B=st.integers(1, 2), N=st.integers(1, 40), HKV=st.integers(1, 2), D=st.sampled_from([8, 16, 32]),
       masked=st.booleans(), scale=scales, dtype=st.sampled_from(LOW), correlated=st.sampled_from([0.0, 0.3]),
       seed=seeds)
def test_preconditioner_16bit_matches_float64(B, N, HKV, D, masked, scale, dtype, correlated, seed):
    """V′, dk and dv of the preconditioner alone in bf16/fp16 (the 16-bit code paths
    at small tiles, several block rows) against float64."""
    inp = _inputs(B, 1, N, 1, HKV, D, masked, scale, seed, dtype, correlated)
    del inp["q"]
    with forced_tiles():
        assert_float64_truth(lucid_precondition, lucid_precondition_reference, inp, ["k", "v"], dtype)


@pytest.mark.parametrize("dtype, scale, split", [(torch.bfloat16, 0.01, False), (torch.float16, 0.01, False),
                                                  (torch.float32, 1e-3, False), (torch.float32, 1e-3, True)],
                         ids=["bf16", "fp16", "fp32", "fp32-split"])
def test_a_key_alone_gets_its_diagonal_gradient_in_fp32(dtype, scale, split):
    """One key: its whole dk is the diagonal term, ∝ dV·V′ of that row, a dot product
    that may cancel (at scale 0.01, 9e-4 of Σ|dV·V′| = 0.2). With V′ and dV rounded to
    16 bits before it, dk came out 0.30 (bf16) and 0.026 (fp16) off in relative RMSE;
    the kernel takes them in fp32 and lands where the fp32 reference does. In fp32,
    keys of RMS 1e-3 (where eps·ρ² ≈ 1/2 makes the term large) against the fp32 bound,
    fused and through the head-dim split's norm kernel."""
    inp = _inputs(1, 1, 1, 1, 1, 32, False, scale, 3926, dtype)
    del inp["q"]
    with forced_tiles(dk_cols=16 if split else None):
        assert_float64_truth(lucid_precondition, lucid_precondition_reference, inp, ["k", "v"], dtype)


def _launch_configurations():
    """(dtype, padded head dim) of every tile row the CUDA path can select."""
    for dtype in (torch.float32, *LOW):
        for bd in lucid_ops._TILES[lucid_ops._family(dtype)]:
            yield dtype, bd


def _config_id(c):
    return f"{str(c[0]).split('.')[-1]}-d{c[1]}"


@pytest.mark.parametrize("config", list(_launch_configurations()), ids=_config_id)
def test_every_launch_configuration_against_float64(config):
    """Each tile configuration ``tiles()`` selects, in its own dtype, against the float64
    reference: two key blocks (the last ragged), two value-column tiles and a split dk̂
    where the tiles have them, a GQA group, padding, correlated keys; bf16/fp16 with
    the GPU's TF32 rounding. Then the decoding kernels with those tiles: one new key
    (16-row cache panel) and a chunk of more than 16 (block-row panel), each after a
    cache of two key tiles split in two chunks, against the float64 row update."""
    dtype, bd = config
    t = lucid_ops.tiles(bd, dtype)
    N = t.block + 7
    inp = _inputs(1, 6, N, 2, 1, bd, True, 1.0, bd, dtype, correlated=0.3)
    emulate = gpu_tf32() if dtype != torch.float32 else contextlib.nullcontext()
    with emulate:
        assert_float64_truth(lucid_attention, lucid_attention_reference, inp, ["q", "k", "v"], dtype)
        keys, values, keep = inp["k"], inp["v"], inp["attention_mask"]
        v_prime = lucid_precondition_reference(keys.double(), values.double(), keep)
        for T in (1, lucid_ops.DECODE_ROWS + 3):
            C = N - T
            got = lucid_precondition_extend(keys[:, :C], v_prime[:, :C].float(), keys[:, C:], values[:, C:],
                                            keep[:, :C], keep[:, C:])
            k_hat = lucid_key_norm(keys.double(), attention_mask=keep)
            want = lucid_extend(k_hat[:, :C], v_prime[:, :C], keep[:, :C], k_hat[:, C:], values[:, C:].double(),
                                keep[:, C:])
            err = float(torch.linalg.vector_norm(got.double() - want) / torch.linalg.vector_norm(want))
            assert err <= FLOAT64_TOLERANCE[dtype][0], f"decoding {T} keys after {C}: rel RMSE {err:.2e}"


def test_decoding_reads_each_cache_at_its_own_batch_stride():
    """The cached keys may be a view of a roomier cache (a longer batch stride) while V′
    is a copy: each is read at its own batch stride."""
    N, T = 40, 3
    C = N - T
    inp = _inputs(2, 6, N, 2, 1, 16, True, 1.0, 16)
    keys, values, keep = inp["k"], inp["v"], inp["attention_mask"]
    v_prime = lucid_precondition_reference(keys.double(), values.double(), keep)[:, :C].float().contiguous()
    roomy = torch.zeros(2, C + 9, *keys.shape[2:], device=DEVICE)
    roomy[:, :C] = keys[:, :C]
    args = (keys[:, C:], values[:, C:], keep[:, :C], keep[:, C:])
    want = lucid_precondition_extend(keys[:, :C].contiguous(), v_prime, *args)
    torch.testing.assert_close(lucid_precondition_extend(roomy[:, :C], v_prime, *args), want)


def test_static_cases_are_the_tested_configurations():
    """Every (dtype, padded head dim) the static sm_90 cases compile is one the test
    above runs, and every tile row of ``tiles()`` has static cases."""
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    compiled = {(names[c.tags["dtype"]], c.constexprs["BLOCK_D"]) for c in lucid_ops.static_cases()}
    assert compiled == set(_launch_configurations())


def test_triangular_inverse_levels():
    """The blocked inverse of the diagonal blocks (16×16 row loop, then one or two
    doubling steps) against L built in float64 from the same keys: L·X = I to fp32
    accuracy, in fp32 and in 16-bit with the GPU's TF32 rounding (where the doubling
    products run in tf32x3)."""
    gen = torch.Generator().manual_seed(3)
    D, N = 32, 70
    base = torch.randn(1, 1, 1, D, generator=gen)
    k = base + 0.3 * torch.randn(2, N, 1, D, generator=gen)  # correlated: L far from the identity
    keep = torch.ones(2, N, dtype=torch.bool)
    keep[1, 5] = False
    for dtype, block in ((torch.float32, 16), (torch.float32, 32), (torch.float32, 64), (torch.float16, 64)):
        keys = k.to(DEVICE, dtype)
        t = lucid_ops.Tiles(block, 32, 4, 4, block, 32)
        with gpu_tf32():
            _, linv = lucid_ops._prepare(keys, lucid_ops._mask_arg(keep.to(DEVICE)), D, 1e-6, False, t)
        L = lucid_matrix(keys.double(), keep.to(DEVICE), 1e-6)  # [B, 1, N, N]
        blocks = -(-N // block)
        for b in range(2):
            for i in range(blocks):
                lo, hi = i * block, min(N, (i + 1) * block)
                x = linv[b, i * block:i * block + hi - lo, :hi - lo].double()
                residual = (L[b, 0, lo:hi, lo:hi] @ x - torch.eye(hi - lo, dtype=torch.float64)).abs().max()
                assert residual < 2e-5, f"{dtype}, block {block}, block row {i}: |L·X − I| = {residual:.2e}"


def test_block_solve_equals_dense_solve_T300_block64():
    inp = _inputs(1, 1, 300, 1, 1, 16, True, 1.0, 11)
    del inp["q"]
    with forced_tiles(64):
        assert_parity(lucid_precondition, lucid_precondition_reference, inp, ["k", "v"])


def test_padding_contents_never_reach_kept_rows():
    """NaN keys and values at padding positions: kept rows of V′ and every gradient
    at kept positions equal those of zeroed padding (0·NaN never enters a product)."""
    inp = _inputs(2, 1, 40, 1, 1, 32, True, 1.0, 5)
    k, v, keep = inp["k"], inp["v"], inp["attention_mask"]
    pad = ~keep[:, :, None, None]
    results = []
    for fill in (0.0, float("nan")):
        kk = torch.where(pad, fill, k).requires_grad_()
        vv = torch.where(pad, fill, v).requires_grad_()
        with forced_tiles(block_dv=16, dk_cols=16):
            vp = lucid_precondition(kk, vv, keep)
            dk, dv = torch.autograd.grad(vp, (kk, vv), torch.ones_like(vp))
        results.append([t.masked_fill(pad, 0.0) for t in (vp, dk, dv)])
    for a, b in zip(*results):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, atol=0, rtol=0)


def test_correlated_keys_stay_within_tolerance():
    """Keys sharing a common direction make L close to all-ones below the diagonal,
    its inverse far from the identity (the conditioning that grows with T): the
    blocked solve through inverted diagonal blocks keeps fp32 parity with fp64.
    Also the GPU's launch shapes in small: value columns split over two programs,
    the dk̂ kernel's head dim split over two programs (its norm backward in a second
    kernel), dk̂ key tiles (16) smaller than the blocks (32)."""
    gen = torch.Generator().manual_seed(7)
    B, N, HKV, D = 1, 120, 1, 32
    common = torch.randn(1, 1, 1, D, generator=gen)
    k = (common + 0.3 * torch.randn(B, N, HKV, D, generator=gen)).to(DEVICE)
    v = torch.randn(B, N, HKV, D, generator=gen).to(DEVICE)
    with forced_tiles(32, block_dv=16, dk_cols=16):
        assert_float64_truth(lucid_precondition, lucid_precondition_reference, {"k": k, "v": v}, ["k", "v"],
                             torch.float32)


def test_tour_case_is_within_tolerance():
    case = lucid_ops.tour_case(DEVICE)
    result = parity(case.op, case.reference, case.inputs, case.grad_names)
    assert result.ok, result.report()


def test_module_triton_backend_prefill_and_decode():
    """Prefill, then one-token steps and a chunk of more keys than a cache-panel row
    tile, on the kernels: equal to the reference forward."""
    torch.manual_seed(0)
    B, T, P, H, HKV, D = 2, 44, 17, 4, 2, 16
    inp = _inputs(B, T, T, H, HKV, D, True, 1.0, 2)
    q, k, v, keep = inp["q"], inp["k"], inp["v"], inp["attention_mask"]
    ref = LucidAttention(H, HKV, D, backend="reference")
    tri = LucidAttention(H, HKV, D, backend="triton")
    full_ref, _ = ref(q, k, v, keep)
    with forced_tiles():
        decoded, cache = prefill_then_decode(tri, q, k, v, cache=tri.empty_cache(B, device=DEVICE),
                                             chunks=[P, 1, 1, 1, T - P - 3], attention_mask=keep)
    torch.testing.assert_close(decoded, full_ref, atol=2e-5, rtol=2e-4)
    ref_cache = ref(q, k, v, keep, ref.empty_cache(B, device=DEVICE))[1]
    torch.testing.assert_close(cache.values, ref_cache.values, atol=2e-5, rtol=2e-4)


def test_decode_step_on_the_kernels_is_inference_only():
    k = torch.randn(1, 3, 1, 8, device=DEVICE)
    v = torch.randn(1, 3, 1, 8, device=DEVICE, requires_grad=True)
    vp = lucid_precondition_reference(k[:, :2], v[:, :2].detach())
    out = lucid_precondition_extend(k[:, :2], vp, k[:, 2:], v[:, 2:])
    with pytest.raises(ConfigError, match="inference-only"):
        out.sum().backward()


def test_triton_rejects_head_dims_without_a_tile():
    q = torch.randn(1, 3, 2, 96, device=DEVICE)
    k = torch.randn(1, 3, 1, 96, device=DEVICE)
    with pytest.raises(ShapeError, match="head_dim <= 64"):
        lucid_attention(q, k, k)
    assert lucid_ops.max_head_dim(torch.bfloat16) == 128


def test_triton_rejects_float64():
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64, device=DEVICE)
    k = torch.randn(1, 3, 1, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(DTypeError):
        lucid_attention(q, k, k)
    with pytest.raises(DTypeError):
        lucid_precondition(k, k)
    with pytest.raises(DTypeError):
        LucidAttention(2, 1, 8, backend="triton")(q, k, k)


def test_empty_sequence():
    q = torch.randn(2, 0, 2, 8, device=DEVICE)
    k = torch.randn(2, 0, 1, 8, device=DEVICE)
    assert lucid_attention(q, k, k).shape == (2, 0, 2, 8)


def test_opcheck_schema_and_autograd_registration():
    k = torch.randn(2, 21, 2, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(2, 21, 2, 16, device=DEVICE, requires_grad=True)
    mask = (torch.rand(2, 21) > 0.3).to(torch.int8).to(DEVICE)
    # The fake-tensor and AOT checks would execute the interpreter on meta tensors;
    # they run in the GPU-marked test below.
    with forced_tiles():
        for m in (None, mask):
            torch.library.opcheck(lucid_ops._lucid_precondition_op, (k, v, m, 16, 1e-6, False),
                                  test_utils=("test_schema", "test_autograd_registration"))
        torch.library.opcheck(lucid_ops._lucid_extend_op, (k[:, :17].detach(), v[:, :17].detach(), mask[:, :17],
                                                           k[:, 17:].detach(), v[:, 17:].detach(), mask[:, 17:],
                                                           16, 1e-6, False), test_utils=("test_schema",))


@pytest.mark.gpu
def test_opcheck_full_gpu():
    k = torch.randn(2, 130, 2, 64, device="cuda", requires_grad=True)
    v = torch.randn(2, 130, 2, 64, device="cuda", requires_grad=True)
    mask = (torch.rand(2, 130, device="cuda") > 0.2).to(torch.int8)
    torch.library.opcheck(lucid_ops._lucid_precondition_op, (k, v, mask, 64, 1e-6, False))
    torch.library.opcheck(lucid_ops._lucid_precondition_op, (k, v, mask, 64, 1e-6, True))
    dvp = torch.randn(2, 130, 2, 64, device="cuda")
    vp, _, rho, linv = lucid_ops._lucid_precondition_op(k.detach(), v.detach(), mask, 64, 1e-6, False)
    torch.library.opcheck(lucid_ops._lucid_precondition_bwd_op, (dvp, k.detach(), vp, rho, linv, mask, 64, 1e-6,
                                                                 False))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("D", [64, 128])
def test_kernel_matches_reference_low_precision(dtype, D):
    inp = _inputs(2, 200, 256, 8, 2, D, True, 1.0, 0, dtype=dtype, correlated=0.3)
    assert_float64_truth(lucid_attention, lucid_attention_reference, inp, ["q", "k", "v"], dtype)


@pytest.mark.gpu
def test_kernel_matches_reference_fp32_gpu_long():
    inp = _inputs(1, 1000, 1000, 4, 1, 64, True, 1.0, 1)
    assert_parity(lucid_attention, lucid_attention_reference, inp, ["q", "k", "v"])


@pytest.mark.gpu
def test_compile_fullgraph_smoke():
    m = LucidAttention(4, 2, 64).cuda()
    q = torch.randn(2, 96, 4, 64, device="cuda", requires_grad=True)
    k = torch.randn(2, 96, 2, 64, device="cuda", requires_grad=True)
    v = torch.randn(2, 96, 2, 64, device="cuda", requires_grad=True)
    compiled = torch.compile(lambda q, k, v: lucid_attention(q, k, v), fullgraph=True)
    y = compiled(q, k, v)
    y.sum().backward()
    torch.testing.assert_close(y, m(q, k, v)[0])
