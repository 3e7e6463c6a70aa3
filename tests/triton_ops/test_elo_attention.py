import importlib
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from laminae.primitives import BackendUnavailableError, DTypeError
from laminae.primitives.elo_attention import EloAttention, elo_attention_reference
from laminae.triton_ops.elo_attention import elo_attention, elo_attention_op

from .._decoding import prefill_then_decode
from .._helpers import DEVICE, assert_parity, scales, seeds

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


def _config_cases():
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for d in (16, 32, 64, 128):
            t = elo_triton.tiles(d, dtype)   # the lookup the CUDA path makes
            widest = max(t.block_m, *(t.of(k)[0] for k in elo_triton.KERNELS))
            cases.append(pytest.param(dtype, d, 2 * widest + 5, id=f"{str(dtype)[6:]}-D{d}"))
    return cases


@pytest.mark.parametrize("dtype, D, S", _config_cases())
def test_every_16bit_tile_configuration_against_float64(dtype, D, S):
    # two query and key tiles of every kernel plus a ragged one, cached keys, a ragged
    # key mask, GQA in bf16; base-2 scores and the δ row kernel in every configuration
    from laminae.triton_ops.testing import parity_float64

    heads = (2, 1) if dtype == torch.bfloat16 else (1, 1)
    inp = _inputs(1, S, 3, *heads, D, "ragged", 1.0, 1.0, D + S, dtype=dtype)
    result = parity_float64(elo_attention, elo_attention_reference, inp, GRADS, output_names=OUTPUTS)
    assert result.ok, result.report()
