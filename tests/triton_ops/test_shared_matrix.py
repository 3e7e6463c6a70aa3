from importlib import import_module

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from laminae.primitives import BackendUnavailableError, DTypeError
from laminae.primitives.shared_matrix import Readout, SharedMatrix, shared_matrix_block, shared_matrix_reference
from laminae.triton_ops.shared_matrix import CUBLAS_MIN_ROWS, DTYPE_PAIRS, shared_matrix, shared_matrix_linear
from laminae.triton_ops.testing import parity_float64

from .._helpers import DEVICE, assert_parity, keep_mask, scales, seeds
from .._fixtures import load_fixture
from ..primitives._elastic_model import ElasticDecoder
from .test_launch_configurations import _check

sm_ops = import_module("laminae.triton_ops.shared_matrix")  # the package attribute is the function

GRADS = ["x", "weight", "delta", "scale"]


def _inputs(*, lead, out_features, in_features, rows, cols, ratio, split, scaled, masked, divisor, scale, seed,
            dtype=torch.float32, param_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    param_dtype = param_dtype or dtype
    inp = {
        "x": (torch.randn(*lead, cols, generator=gen) * scale).to(DEVICE, dtype),
        "weight": (torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5).to(DEVICE, param_dtype),
        "rows": rows, "cols": cols, "ratio": ratio if split else 1.0, "output_divisor": divisor,
    }
    if split:
        inp["delta"] = (torch.randn(out_features, in_features, generator=gen) * scale).to(DEVICE, param_dtype)
    if scaled:
        inp["scale"] = (0.5 + torch.rand(1, generator=gen)).to(DEVICE, param_dtype)
    if masked:
        mask = keep_mask(lead[0], lead[1], gen)
        inp["x"][~mask] = float("nan")  # padding contents must never matter
        inp["attention_mask"] = mask
    return inp


@st.composite
def problems(draw):
    out_features, in_features = draw(st.integers(1, 150)), draw(st.integers(1, 140))
    masked = draw(st.booleans())
    lead = (draw(st.integers(1, 3)), draw(st.integers(1, 40))) if masked else (draw(st.integers(1, 90)),)
    return dict(
        lead=lead, out_features=out_features, in_features=in_features,
        rows=draw(st.integers(1, out_features)), cols=draw(st.integers(1, in_features)),
        ratio=draw(st.sampled_from([1.0, 2.0, 3.0, 7.0, 0.5])), split=draw(st.booleans()),
        scaled=draw(st.booleans()), masked=masked, divisor=draw(st.sampled_from([1.0, 4.0, 0.5, 3.0])),
        scale=draw(scales), seed=draw(seeds))


@given(problem=problems())
def test_kernel_matches_reference_fp32(problem):
    inp = _inputs(**problem)
    assert_parity(shared_matrix, shared_matrix_reference, inp, [k for k in GRADS if k in inp])


def test_tier_weight_is_combined_on_chip_with_the_reference_roundings_bitwise():
    # x = I makes the kernel's output its own combined tier weight (ieee products with
    # 0/1 are exact), so the on-chip combine must equal the reference block bit for bit.
    inp = _inputs(lead=(1,), out_features=150, in_features=70, rows=133, cols=67, ratio=3.0, split=True,
                  scaled=True, masked=False, divisor=1.0, scale=1.0, seed=1)
    eye = torch.eye(67, device=DEVICE)
    got = shared_matrix(eye, inp["weight"], inp["delta"], inp["scale"], rows=133, cols=67, ratio=3.0)
    want = shared_matrix_block(inp["weight"], inp["delta"], 133, 67, 3.0, inp["scale"])
    assert torch.equal(got, want.t())


def test_delta_gradient_is_exactly_zero_outside_the_block():
    inp = _inputs(lead=(37,), out_features=100, in_features=90, rows=65, cols=33, ratio=2.0, split=True,
                  scaled=True, masked=False, divisor=1.0, scale=1.0, seed=2)
    leaves = {k: (v.requires_grad_(True) if k in GRADS else v) for k, v in inp.items()}
    y = shared_matrix(**leaves)
    dy = torch.randn_like(y)
    dx, dw, dd, ds = torch.autograd.grad(y, [leaves[k] for k in GRADS], dy)
    for g in (dw, dd):
        assert torch.count_nonzero(g[65:]) == 0 and torch.count_nonzero(g[:, 33:]) == 0
    alpha = float(inp["scale"].detach())
    torch.testing.assert_close(dd[:65, :33], alpha / 2.0 * dy.t() @ inp["x"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, 2.0 ** 0.5 * dd, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_weight_gradient_with_m_split_across_programs(masked):
    # A 50x40 block is one tile: the dW kernel splits the 300 rows over programs and
    # reduces an fp32 workspace; the result must not change.
    from laminae.triton_ops.shared_matrix import DW_TILES, _dw_splits

    assert _dw_splits(300, 1, DW_TILES["fp32"][2], torch.device("cpu"))[0] > 1
    lead = (3, 100) if masked else (300,)
    inp = _inputs(lead=lead, out_features=64, in_features=48, rows=50, cols=40, ratio=3.0, split=True,
                  scaled=True, masked=masked, divisor=2.0, scale=1.0, seed=4)
    assert_parity(shared_matrix, shared_matrix_reference, inp, GRADS)


@pytest.mark.parametrize("tokens", [7, 300])   # one program over M; M split over programs
def test_weight_gradient_without_delta_is_the_float64_truth(tokens):
    # Without a delta the weight gradient has its own stores (and the M split its own
    # rescale in torch): an element-wise fp32 tolerance admits a uniform ×1.001 there,
    # relative RMSE against float64 does not.
    inp = _inputs(lead=(tokens,), out_features=64, in_features=48, rows=50, cols=40, ratio=1.0, split=False,
                  scaled=True, masked=False, divisor=2.0, scale=1.0, seed=5)
    result = parity_float64(shared_matrix, shared_matrix_reference, inp, ["x", "weight", "scale"])
    assert result.ok, result.report()


def _count_transient(monkeypatch, rows: int) -> list:
    """Lower the cuBLAS threshold to ``rows`` and record each transient tier weight built."""
    monkeypatch.setattr(sm_ops, "CUBLAS_MIN_ROWS", rows)
    built, real = [], sm_ops._transient_weight
    monkeypatch.setattr(sm_ops, "_transient_weight", lambda *args: built.append(args[-1]) or real(*args))
    return built


def test_cublas_threshold_is_inclusive_for_forward_and_dx(monkeypatch):
    built = _count_transient(monkeypatch, 20)
    w = torch.randn(12, 9, device=DEVICE)
    for tokens, want in ((19, 0), (20, 2)):   # one weight for the forward, one for dx
        built.clear()
        x = torch.randn(tokens, 8, device=DEVICE, requires_grad=True)
        shared_matrix(x, w, rows=12, cols=8).sum().backward()
        assert len(built) == want, tokens


# (split, scaled, masked): delta, learned scale and keep mask each on and off
TRANSIENT_VARIANTS = [(True, True, True), (True, False, False), (False, True, False), (False, False, True)]
PAIR_IDS = [f"{a}-{b}".replace("torch.", "") for a, b in DTYPE_PAIRS]


@pytest.mark.parametrize("split, scaled, masked", TRANSIENT_VARIANTS)
@pytest.mark.parametrize("x_dtype, p_dtype", DTYPE_PAIRS, ids=PAIR_IDS)
def test_transient_weight_and_cublas_path_against_float64(monkeypatch, x_dtype, p_dtype, split, scaled, masked):
    # 20 tokens at a threshold of 20; the block spans two combine tiles each way, ragged
    built = _count_transient(monkeypatch, 20)
    rows, cols = sm_ops.COMBINE_TILE[0] + 13, sm_ops.COMBINE_TILE[1] + 6
    inp = _inputs(lead=(2, 10) if masked else (20,), out_features=rows + 3, in_features=cols + 5, rows=rows,
                  cols=cols, ratio=3.0, split=split, scaled=scaled, masked=masked, divisor=3.0, scale=1.0, seed=6,
                  dtype=x_dtype, param_dtype=p_dtype)
    _check(shared_matrix, shared_matrix_reference, inp, [k for k in GRADS if k in inp], x_dtype)
    assert built and set(built) == {x_dtype}


def test_modules_on_triton_backend_match_reference_with_parameter_grads():
    torch.manual_seed(0)
    cases = ((SharedMatrix(70, 50, base_fan_in=10), lambda m, x: m(x, rows=61, ratio=3.0, output_divisor=4.0)),
             (Readout(90, 50, num_scales=3, base_fan_in=10), lambda m, x: m(x, ratio=2.0, scale_index=1)))
    for module, call in cases:
        module.to(DEVICE)
        with torch.no_grad():
            module.delta.normal_()
            if isinstance(module, Readout):
                module.logit_scale.copy_(torch.tensor([0.5, 1.5, 2.0]))
        x = torch.randn(2, 9, 47, device=DEVICE, requires_grad=True)
        results = []
        for backend in ("reference", "triton"):
            module.backend = backend
            y = call(module, x)
            params = [p for p in module.parameters() if p.requires_grad]
            results.append((y, torch.autograd.grad(y, [x, *params], torch.ones_like(y))))
        torch.testing.assert_close(results[1][0], results[0][0], atol=2e-5, rtol=2e-4)
        for a, b in zip(results[1][1], results[0][1]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
        assert module.init.grad is None


def test_seed_checkpoint_through_the_kernels_reproduces_seed_numbers():
    config, weights, inputs, expected = load_fixture("elastic_fully")
    model = ElasticDecoder(config, backend="triton")
    model.load_state_dict(weights, strict=True)
    for tier in ("low", "max"):
        logits = model(inputs["input_ids"].to(DEVICE), tier)
        torch.testing.assert_close(logits.cpu(), expected[f"logits.{tier}"], atol=1e-4, rtol=0)
        loss = F.cross_entropy(logits.flatten(0, 1), inputs["labels"].to(DEVICE).flatten(), ignore_index=-100)
        model.zero_grad()
        loss.backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.grad.cpu(), expected[f"grad.{tier}.{k}"], atol=1e-4, rtol=1e-3, msg=k)


def test_empty_batch_and_single_token():
    inp = _inputs(lead=(0,), out_features=20, in_features=10, rows=20, cols=10, ratio=2.0, split=True,
                  scaled=True, masked=False, divisor=1.0, scale=1.0, seed=3)
    assert shared_matrix(**inp).shape == (0, 20)
    inp = _inputs(lead=(1, 1), out_features=20, in_features=10, rows=1, cols=1, ratio=2.0, split=True,
                  scaled=True, masked=True, divisor=2.0, scale=1.0, seed=3)
    inp["attention_mask"][:] = True
    inp["x"] = torch.randn(1, 1, 1, device=DEVICE)
    assert_parity(shared_matrix, shared_matrix_reference, inp, GRADS)


def test_triton_rejects_unsupported_dtypes():
    w = torch.randn(4, 4, dtype=torch.float64, device=DEVICE)
    with pytest.raises(DTypeError, match="fp64"):
        shared_matrix(torch.randn(2, 4, dtype=torch.float64, device=DEVICE), w, rows=4, cols=4)
    with pytest.raises(DTypeError, match="x bf16 with weights fp32"):
        shared_matrix(torch.randn(2, 4, device=DEVICE).bfloat16(), w.half(), rows=4, cols=4)


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("CPU-only behaviour")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        SharedMatrix(8, 8, backend="triton")(torch.randn(2, 8), 8)


def test_opcheck_schema_and_autograd_registration():
    x = torch.randn(5, 12, device=DEVICE, requires_grad=True)
    w = torch.randn(20, 16, device=DEVICE, requires_grad=True)
    d = torch.randn(20, 16, device=DEVICE, requires_grad=True)
    s = torch.tensor([0.7], device=DEVICE, requires_grad=True)
    keep = torch.tensor([True, False, True, True, True], device=DEVICE)
    # The fake-tensor and AOT checks would execute the interpreter on meta tensors;
    # they run in the GPU-marked test below.
    torch.library.opcheck(shared_matrix_linear, (x, w, d, s, keep, 17, 12, 0.5, 0.25, 2.0),
                          test_utils=("test_schema", "test_autograd_registration"))


@pytest.mark.gpu
def test_opcheck_full_gpu():
    x = torch.randn(70, 96, device="cuda", requires_grad=True)
    w = torch.randn(200, 128, device="cuda", requires_grad=True)
    d = torch.randn(200, 128, device="cuda", requires_grad=True)
    s = torch.tensor([0.7], device="cuda", requires_grad=True)
    torch.library.opcheck(shared_matrix_linear, (x, w, d, s, None, 190, 96, 0.5, 0.25, 2.0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, param_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
@pytest.mark.parametrize("tokens", [1, 37, 1000, CUBLAS_MIN_ROWS])   # decode and prefill tiles, then cuBLAS
def test_kernel_matches_reference_low_precision(dtype, param_dtype, tokens):
    inp = _inputs(lead=(tokens,), out_features=1100, in_features=700, rows=1000, cols=640, ratio=10.0, split=True,
                  scaled=True, masked=False, divisor=4.0, scale=1.0, seed=0, dtype=dtype, param_dtype=param_dtype)
    assert_parity(shared_matrix, shared_matrix_reference, inp, GRADS, dtype=dtype)


@pytest.mark.gpu
def test_bf16_tier_weight_is_bitwise_the_reference_block():
    inp = _inputs(lead=(1,), out_features=300, in_features=200, rows=256, cols=192, ratio=7.0, split=True,
                  scaled=True, masked=False, divisor=1.0, scale=1.0, seed=1, dtype=torch.bfloat16)
    eye = torch.eye(192, device="cuda", dtype=torch.bfloat16)
    got = shared_matrix(eye, inp["weight"], inp["delta"], inp["scale"], rows=256, cols=192, ratio=7.0)
    assert torch.equal(got, shared_matrix_block(inp["weight"], inp["delta"], 256, 192, 7.0, inp["scale"]).t())


@pytest.mark.gpu
def test_compile_fullgraph_and_cuda_autocast():
    m = Readout(1000, 256, num_scales=2, base_fan_in=64).cuda()
    h = torch.randn(4, 64, 192, device="cuda", requires_grad=True)
    compiled = torch.compile(lambda h: m(h, ratio=3.0, scale_index=1), fullgraph=True)
    y = compiled(h)
    y.sum().backward()
    torch.testing.assert_close(y, m(h, ratio=3.0, scale_index=1))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        z = SharedMatrix(512, 256, base_fan_in=64).cuda()(h, 500, 3.0)
    assert z.dtype == torch.bfloat16
