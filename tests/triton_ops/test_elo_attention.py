import importlib
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from laminae.primitives import BackendUnavailableError, DTypeError
from laminae.primitives.elo_attention import EloAttention, elo_attention_reference, full_prior
from laminae.triton_ops.elo_attention import elo_attention, elo_attention_op

from .._decoding import prefill_then_decode
from .._helpers import DEVICE, assert_parity, scales, seeds
from .test_launch_configurations import _check

elo_triton = importlib.import_module("laminae.triton_ops.elo_attention")  # the kernel file, not the function

GRADS = ["q", "k", "v", "elo_log_k", "elo_gain", "prior_rating"]
OUTPUTS = ["out", "rating"]


# Small tiles, so short sequences already walk several checkpointed query blocks and
# key blocks (the default tiles would not cross a block boundary at these lengths).
# Beside square ones, the shapes the bf16/fp16 GPU tiles take (backward key blocks
# narrower than the query blocks and than the forward's), and the reverse.
SMALL_TILES = {
    "16x16": elo_triton.uniform(16, 16, 4, 2),
    "32x32,bwd16": elo_triton.uniform(32, 32, 4, 2, suffix=(16, 4, 2), dq=(16, 4, 2), dkdv=(16, 4, 2)),
    "16x32,bwd16": elo_triton.uniform(16, 32, 4, 2, suffix=(16, 4, 2), dq=(16, 4, 2)),
    "32x16,dkdv32": elo_triton.uniform(32, 16, 4, 2, dkdv=(32, 4, 2)),
}


@contextmanager
def _small_tiles(name: str = "16x16"):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(elo_triton, "tiles", lambda head_dim, dtype: SMALL_TILES[name])
        yield


@pytest.fixture
def small_tiles():
    with _small_tiles():
        yield


def _inputs(B, S, extra, H, HKV, D, mask, gain_scale, scale, seed, full_prior=False,
            dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    N = S + extra
    inp = {
        "q": (torch.randn(B, S, H, D, generator=gen) * scale).to(DEVICE, dtype),
        "k": (torch.randn(B, N, HKV, D, generator=gen) * scale).to(DEVICE, dtype),
        "v": torch.randn(B, N, HKV, D, generator=gen).to(DEVICE, dtype),
        # K = softplus(elo_log_k) in [0.1, 3]; gain = tanh(elo_gain) in [-1, 1]
        "elo_log_k": torch.log(torch.expm1(torch.empty(H).uniform_(0.1, 3.0, generator=gen))).to(DEVICE),
        "elo_gain": torch.atanh(torch.empty(H).uniform_(-0.99, 0.99, generator=gen) * gain_scale).to(DEVICE),
    }
    prior_len = N if full_prior else extra
    if prior_len:
        inp["prior_rating"] = torch.randn(B, H, prior_len, generator=gen).to(DEVICE)
    if mask == "ragged":
        keep = torch.rand(B, N, generator=gen) > 0.3
        keep[0, : min(3, N)] = False   # left padding: early queries see no key at all
        inp["attention_mask"] = keep.to(DEVICE)
    return inp


heads = st.sampled_from([(1, 1), (2, 1), (4, 2)])


@given(B=st.integers(1, 2), S=st.integers(1, 33), extra=st.integers(0, 12), heads=heads,
       D=st.sampled_from([8, 16, 32]), mask=st.sampled_from(["none", "ragged"]),
       gain_scale=st.floats(0.0, 1.0), full_prior=st.booleans(), scale=scales, seed=seeds,
       tiles=st.sampled_from(sorted(SMALL_TILES)))
def test_kernel_matches_reference_fp32(B, S, extra, heads, D, mask, gain_scale, full_prior, scale, seed, tiles):
    H, HKV = heads
    inp = _inputs(B, S, extra, H, HKV, D, mask, gain_scale, scale, seed, full_prior=full_prior)
    with _small_tiles(tiles):
        assert_parity(elo_attention, elo_attention_reference, inp, [n for n in GRADS if n in inp],
                      output_names=OUTPUTS)


def test_cached_prefix_of_one_key_past_a_query_tile(small_tiles):
    # past = N - S = 1: the last query of block 0 (row 15, position 16) is the only one
    # that sees key 16, the first of key block 1; a first query block one too late at
    # that boundary drops it (random shapes rarely meet past = 1 mod BLOCK_M)
    inp = _inputs(1, 20, 1, 2, 1, 8, "none", 1.0, 1.0, 3)
    assert_parity(elo_attention, elo_attention_reference, inp, GRADS, output_names=OUTPUTS)


def test_kernel_default_tiles_match_reference():
    inp = _inputs(1, 37, 4, 2, 1, 16, "ragged", 1.0, 1.0, 7)
    assert_parity(elo_attention, elo_attention_reference, inp, GRADS, output_names=OUTPUTS)


def test_module_triton_decoding_equals_reference_full_forward(small_tiles):
    torch.manual_seed(0)
    B, S, prefill, H, HKV, D = 2, 20, 17, 2, 1, 8
    m = EloAttention(H, HKV, D, backend="triton").to(DEVICE)
    with torch.no_grad():
        m.elo_gain.uniform_(-1, 1)
        m.elo_log_k.uniform_(-1, 1)
    q = torch.randn(B, S, H, D, device=DEVICE)
    k = torch.randn(B, S, HKV, D, device=DEVICE)
    v = torch.randn(B, S, HKV, D, device=DEVICE)
    keep = torch.ones(B, S, dtype=torch.bool, device=DEVICE)
    keep[1, :5] = False
    with torch.no_grad():
        m.backend = "reference"
        full, full_cache = m(q, k, v, attention_mask=keep, cache=m.empty_cache(B))
        m.backend = "triton"
        stepped, cache = prefill_then_decode(m, q, k, v, cache=m.empty_cache(B), prefill=prefill,
                                             attention_mask=keep)
    torch.testing.assert_close(stepped, full, atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(cache.rating, full_cache.rating, atol=2e-5, rtol=2e-4)


def test_triton_rejects_float64():
    q = torch.randn(1, 2, 1, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(DTypeError):
        elo_attention(q, q, q, torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE))


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("CPU-only behaviour")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = EloAttention(2, 1, 8, backend="triton")
    x = torch.randn(1, 3, 2, 8)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        m(x, x[:, :, :1], x[:, :, :1])


def _op_args(device, B=1, S=5, N=7, H=2, HKV=1, D=8, grad=True):
    q = torch.randn(B, S, H, D, device=device, requires_grad=grad)
    k = torch.randn(B, N, HKV, D, device=device, requires_grad=grad)
    v = torch.randn(B, N, HKV, D, device=device, requires_grad=grad)
    kf = torch.rand(H, device=device).add(0.5).requires_grad_(grad)
    gain = torch.rand(H, device=device).sub(0.5).requires_grad_(grad)
    prior = torch.randn(B, H, N, device=device, requires_grad=grad)
    mask = torch.ones(B, N, dtype=torch.int8, device=device)
    mask[0, 1] = 0
    return q, k, v, kf, gain, prior, mask


def test_opcheck_schema_and_autograd_registration():
    # The fake-tensor and AOT checks would execute the interpreter on meta tensors;
    # they run in the GPU-marked test below.
    torch.library.opcheck(elo_attention_op, _op_args(DEVICE),
                          test_utils=("test_schema", "test_autograd_registration"))


@pytest.mark.gpu
def test_opcheck_full_gpu():
    torch.library.opcheck(elo_attention_op, _op_args("cuda", B=2, S=70, N=90, H=4, HKV=2, D=64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_reference_low_precision(dtype):
    inp = _inputs(2, 200, 37, 4, 2, 64, "ragged", 1.0, 1.0, 0, dtype=dtype)
    assert_parity(elo_attention, elo_attention_reference, inp, GRADS, dtype=dtype, output_names=OUTPUTS)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [16, 32, 64, 128])
def test_kernel_matches_reference_fp32_every_head_dim_gpu(D):
    inp = _inputs(2, 150, 20, 4, 2, D, "ragged", 1.0, 1.0, D)
    assert_parity(elo_attention, elo_attention_reference, inp, GRADS, output_names=OUTPUTS)


@pytest.mark.gpu
def test_compile_fullgraph_smoke():
    m = EloAttention(4, 2, 64).cuda()
    with torch.no_grad():
        m.elo_gain.fill_(0.5)
    q = torch.randn(2, 64, 4, 64, device="cuda", requires_grad=True)
    k = torch.randn(2, 64, 2, 64, device="cuda", requires_grad=True)
    v = torch.randn(2, 64, 2, 64, device="cuda", requires_grad=True)

    def run(q, k, v):
        _, rating = elo_attention(q, k, v, m.elo_log_k, m.elo_gain)   # the rating is differentiable here
        return m(q, k, v).output, rating

    out, rating = torch.compile(run, fullgraph=True)(q, k, v)
    (out.sum() + rating.sum()).backward()
    ref_out, ref_rating = run(q, k, v)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(rating, ref_rating)


# Every launch configuration the CUDA path can pick, derived from static_cases(): one call
# per (dtype, head-dim tile) launches the three forward, the δ and the three backward
# kernels of that configuration, through the op's own tiles() lookup (checked against the
# static case). Two query and key tiles of every kernel plus a ragged one, cached keys
# with a prior, a ragged key mask with left padding, GQA in bf16 and fp32. Tolerances:
# test_launch_configurations' table (float64 truth), and ∂gain relative to its terms.
def _gain_grad_magnitude(inp, upstream):
    """[H] float64: the size of the terms whose sum is ∂elo_gain, dz_ij·(prior_j + intra_ij)
    times tanh′, with dz_ij = a_ij·(dO_i·v_j − δ_i) (module docstring of
    triton_ops/elo_attention.py). dz sums to 0 over each row, so ∂gain cancels and its
    rounding (δ from the 16-bit output included) is relative to the terms: each row's
    terms share δ_i, whose rounding is coherent along the row, and the rows round
    independently, so Σ_j over a row by magnitude (|dO_i·v_j| + |δ_i|), then the root of
    the sum of squares over the rows."""
    import torch.nn.functional as F

    from laminae.primitives._attention import visible_keys

    t = {n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in inp.items()}
    q, k, v = t["q"], t["k"], t["v"]
    B, S, H, D = q.shape
    N, group = k.shape[1], H // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bshd,bnhd->bhsn", q, k) / D**0.5
    visible = visible_keys(S, N, t.get("attention_mask"), q.device)
    prior = full_prior(t.get("prior_rating"), B, H, N, torch.float64, q.device)[:, :, None, :]
    K, gain = F.softplus(t["elo_log_k"]).view(1, H, 1, 1), torch.tanh(t["elo_gain"]).view(1, H, 1, 1)

    def softmax(x):
        return torch.where(visible, torch.softmax(x.masked_fill(~visible, float("-inf")), -1), 0.0).nan_to_num()

    d_rating = K * (softmax(scores) - 1.0 / visible.sum(-1, keepdim=True).clamp(min=1)) * visible
    logit = prior + torch.cumsum(d_rating, dim=2) - d_rating
    a = softmax(scores + gain * logit)
    dout = upstream.double().transpose(1, 2)
    delta = (dout * torch.einsum("bhsn,bnhd->bhsd", a, v)).sum(-1, keepdim=True)
    dp = torch.einsum("bhsd,bnhd->bhsn", dout, v)
    rows = (a * (dp.abs() + delta.abs()) * logit.abs()).sum(-1)
    return rows.pow(2).sum(dim=(0, 2)).sqrt() * (1 - gain.flatten() ** 2)


def _launch_runs():
    return sorted({(c.tags["dtype"], c.constexprs["BLOCK_D"]) for c in elo_triton.static_cases()
                   if c.name == "elo_fwd_stats"})


LAUNCH_RUNS = _launch_runs()
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("dtype, D", LAUNCH_RUNS, ids=[f"{dt}-D{d}" for dt, d in LAUNCH_RUNS])
def test_every_launch_configuration_against_float64(dtype, D):
    torch_dtype = _DTYPES[dtype]
    t = elo_triton.tiles(D, torch_dtype)   # the lookup the CUDA path makes
    for case in elo_triton.static_cases():
        kernel = case.name.split("_", 2)[-1]
        if case.tags["dtype"] == dtype and case.constexprs["BLOCK_D"] == D and kernel in elo_triton.KERNELS:
            assert (t.block_m, t.of(kernel)[0]) == (case.constexprs["BLOCK_M"], case.constexprs["BLOCK_N"])
    widest = max(t.block_m, *(t.of(k)[0] for k in elo_triton.KERNELS))
    S = 2 * widest + 5
    heads = (1, 1) if dtype == "fp16" else (2, 1)
    inp = _inputs(1, S, 3, *heads, D, "ragged", 1.0, 1.0, D + S, dtype=torch_dtype)
    _check(elo_attention, elo_attention_reference, inp, [n for n in GRADS if n in inp], torch_dtype, names=OUTPUTS,
           floors={"delo_gain": lambda up: _gain_grad_magnitude(inp, up[0])})
