import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from laminae.primitives import BackendUnavailableError, ConfigError, DTypeError, TokenIdError
from laminae.primitives.leviathan import LeviathanGenerator, leviathan_reference
from laminae.triton_ops._common import triton_dtype
from laminae.triton_ops._parity import _run, compare
from laminae.triton_ops.leviathan import (bwd_config, distinct_ids, fwd_config, leviathan, leviathan_spline,
                                          static_cases)

from .._helpers import DEVICE, assert_matches_float64, assert_parity, seeds

NAMES = ["codebooks", "head_proj_weight", "head_norm_weight", "head_norm_bias", "head_spline_delta", "head_out_weight"]


def _inputs(vocab, hidden, seed_dim, modes, knots, coords, rank, shape, *, id_pool=None, cb_scale=1.0,
            bias_scale=0.5, delta_std=0.1, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    gen = LeviathanGenerator(vocab, hidden, seed_dim, modes, knots, 2, coords, rank)
    with torch.no_grad():
        gen.codebooks.normal_(0.0, cb_scale)
        gen.head_proj_weight.normal_(0.0, seed_dim**-0.5)
        gen.head_norm_weight.normal_(1.0, 0.2)
        gen.head_norm_bias.normal_(0.0, bias_scale)
        gen.head_spline_delta.normal_(0.0, delta_std)
        gen.head_out_weight.normal_(0.0, rank**-0.5)
    pool = torch.randperm(vocab)[: id_pool or vocab]
    ids = pool[torch.randint(0, len(pool), shape)]
    params = {k: p.detach().to(DEVICE, dtype) for k, p in zip(NAMES, gen._params())}
    return {"input_ids": ids.to(DEVICE), **params, "knot_grid": gen.knot_grid.to(DEVICE)}


@given(batch=st.integers(1, 3), seq=st.integers(1, 20), vocab=st.integers(2, 400), coords=st.integers(1, 3),
       seed_dim=st.integers(1, 12), modes=st.integers(1, 2), knots=st.integers(2, 32),
       rank=st.sampled_from([1, 3, 16, 17, 40, 64, 100, 128]), hidden=st.integers(1, 20),
       unique_ids=st.booleans(), id_pool=st.sampled_from([None, 1, 3]),
       cb_scale=st.sampled_from([0.05, 1.0, 4.0]), bias_scale=st.sampled_from([0.0, 0.5, 3.0]),
       delta_std=st.sampled_from([0.01, 0.1, 0.7]), seed=seeds)
def test_kernel_matches_reference_fp32(batch, seq, vocab, coords, seed_dim, modes, knots, rank, hidden, unique_ids,
                                       id_pool, cb_scale, bias_scale, delta_std, seed):
    inp = _inputs(vocab, hidden, seed_dim, modes, knots, coords, rank, (batch, seq), id_pool=id_pool,
                  cb_scale=cb_scale, bias_scale=bias_scale, delta_std=delta_std, seed=seed)
    op = lambda **kw: leviathan(**kw, unique_ids=unique_ids)  # noqa: E731
    # one or two seed dims with a variance far above eps make the LayerNorm's gradient a
    # small difference of large terms: the kernel's fused LayerNorm backward is then up to
    # 25x as far from float64 as the fp32 reference (measured; both ~1e-4 relative)
    assert_matches_float64(op, leviathan_reference, inp, NAMES, conditioning=32)


def test_thorough_profile_example_is_judged_against_float64():
    """A case the 1000-example profile drew: one d codebooks element 0.0500 where the fp32
    reference says 0.0503. The float64 truth is 0.0500: the fp32 reference is itself outside
    the element-wise bound there (the element inherits the accumulation error of its large
    neighbours), so the kernel is judged against float64, tensor by tensor."""
    inp = _inputs(157, 11, 8, 1, 17, 2, 128, (3, 17), id_pool=3, cb_scale=0.05, bias_scale=0.5, delta_std=0.1,
                  seed=1848)
    _, fp32, up = _run(leviathan_reference, inp, NAMES, None, 0, None)
    _, truth, _ = _run(leviathan_reference, inp, NAMES, up, 0, torch.float64)
    assert not compare("dcodebooks", fp32["codebooks"], truth["codebooks"], 1e-4, 1e-3).ok
    assert_matches_float64(lambda **kw: leviathan(**kw, unique_ids=False), leviathan_reference, inp, NAMES)


def test_kernel_matches_reference_with_two_layernorm_chunks():
    # d = 70 spans two BLOCK_D chunks of the LayerNorm passes; NeoLLM's V, k, κ and r
    inp = _inputs(64402, 24, 70, 1, 16, 3, 64, (1, 3), cb_scale=1.0, delta_std=0.1)
    assert_parity(leviathan, leviathan_reference, inp, NAMES)


def test_kernel_matches_reference_at_the_ends_of_the_knot_range():
    # z̃ near 0 and 1 (the basis normaliser < 1 there) with κ = 5, padded to a 16-wide tile
    inp = _inputs(40, 8, 6, 2, 5, 2, 7, (2, 9), delta_std=0.3)
    inp["head_norm_bias"] = torch.tensor([5.0, -5.0, 6.0, -6.0, 0.0, 4.0], device=DEVICE).repeat(2, 1)
    assert_parity(leviathan, leviathan_reference, inp, NAMES)


# A rank inside each rank tile (ragged); 100 spans two tiles of 64 (partial dx̂, dγ, dβ).
_RANK_IN_TILE = {16: 11, 32: 27, 64: 100}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _config_runs() -> dict:
    """One (dtype, κ, r) run per configuration the CUDA launch can pick (the static cases,
    which every launch goes through), with the κ and r it is run at: ragged inside the tile."""
    runs = {}
    for case in static_cases():
        if "rank" in case.tags:
            run = (case.tags["dtype"], case.tags["knots"] - 3, _RANK_IN_TILE[min(64, case.tags["rank"])])
            runs.setdefault(run, []).append((case.name, case.constexprs, case.num_warps, case.num_stages))
    return runs


def test_every_launch_configuration_has_a_run():
    """The runs below select, through the launch's own functions, exactly the configurations
    declared for the static check: a configuration added there is run here or this fails."""
    for (dt, knots, rank), cases in _config_runs().items():
        selected = {"leviathan_fwd": fwd_config(knots, rank, dt), "leviathan_bwd_spline": bwd_config(knots, rank, dt)}
        for name, const, warps, stages in cases:
            assert selected[name] == (const, warps, stages), (name, dt, knots, rank)


def _spline_truth(y0t, gamma, beta, wd, grid):
    """The spline chain of one mode by the reference: a seed equal to y0 (one digit, identity
    projection) and an identity output map, so the output is M [U, r]."""
    d, n = y0t.shape[1:]
    eye_d = torch.eye(d, dtype=y0t.dtype, device=y0t.device)[None]
    eye_r = torch.eye(wd.shape[-1], dtype=y0t.dtype, device=y0t.device)[None]
    ids = torch.arange(n, device=y0t.device)
    return leviathan_reference(ids, y0t.transpose(1, 2), eye_d, gamma, beta, wd, eye_r, grid)


@pytest.mark.parametrize("dtype,knots,rank", sorted(_config_runs()))
def test_launch_configuration_matches_float64(dtype, knots, rank):
    """Each configuration in its own dtype (bf16/fp16 wd take fewer bf16 pieces) on 77 tokens
    (two 64-token tiles, ragged), 3 seed dims (two groups when a program takes two) and κ, r
    ragged inside their tiles. M and dy0 are fp32 results, held to fp32 accuracy in every
    dtype; dγ, dβ, d wd come back in the parameters' dtype."""
    torch.manual_seed(0)
    dt = _DTYPES[dtype]
    inputs = {"y0t": torch.randn(1, 3, 77, device=DEVICE),
              "gamma": (1 + 0.2 * torch.randn(1, 3, device=DEVICE)).to(dt),
              "beta": (0.5 * torch.randn(1, 3, device=DEVICE)).to(dt),
              "wd": (0.3 * torch.randn(1, 3, knots, rank, device=DEVICE)).to(dt),
              "grid": torch.linspace(0, 1, knots, device=DEVICE)}
    count = torch.tensor([77], dtype=torch.int32, device=DEVICE)
    op = lambda y0t, gamma, beta, wd, grid: leviathan_spline(y0t, gamma, beta, wd, grid, count)[0]  # noqa: E731
    assert_matches_float64(op, _spline_truth, inputs, ["y0t", "gamma", "beta", "wd"], dtype=dt,
                           exact_names=("out0", "dy0t"))


def _pieces(x, n, rounding):
    """x in n bf16 pieces, each rounded from the remainder (as _split3 forms them)."""
    out = []
    for _ in range(n):
        piece = rounding(x)
        out.append(piece)
        x = x - piece
    return out + [torch.zeros_like(x)] * (3 - n)


def _nearest(x):            # the GPU's fp32 → bf16 conversion
    return x.to(torch.bfloat16).float()


def _truncated(x):          # the interpreter's
    return (x.view(torch.int32) & -65536).view(torch.float32)


@pytest.mark.parametrize("rounding", [_nearest, _truncated], ids=["round_to_nearest", "truncate"])
def test_bf16x6_products_keep_m_within_the_float64_bound(rounding):
    """The kernels' φ = Σ_g B_g + B·wd with B·wd in six bf16 products of three-piece operands,
    emulated in torch with the GPU's rounding (nearest) and the interpreter's (truncation):
    M over NeoLLM's 128 seed dims stays within the float64-truth bound (relative RMSE 2e-5)
    and as close as plain fp32. One bf16 product (the pieces dropped) is far outside it."""
    from laminae.primitives.leviathan import leviathan_basis, leviathan_knot_grid

    gen = torch.Generator().manual_seed(0)
    tokens, dims, knots, rank = 32, 128, 16, 64
    basis = leviathan_basis(torch.rand(tokens, dims, generator=gen, dtype=torch.float64),
                            leviathan_knot_grid(knots, torch.float64))                     # [U, d, κ]
    wd = 0.1 * torch.randn(dims, knots, rank, generator=gen, dtype=torch.float64)

    def m_of(phi):
        return torch.where((phi < 0).sum(1) % 2 == 1, -1.0, 1.0) * torch.exp(torch.log(phi.abs() + 1e-9).sum(1))

    truth = m_of(basis.sum(-1, keepdim=True) + torch.einsum("udg,dgq->udq", basis, wd))

    def rel(phi):
        m = m_of(phi.double())
        return float((m - truth).norm() / truth.norm())

    b32, w32 = basis.float(), wd.float()
    bp, wp = _pieces(b32, 3, rounding), _pieces(w32, 3, rounding)
    products = [(0, 2), (2, 0), (1, 1), (0, 1), (1, 0), (0, 0)]       # small ones first, as _dot6
    phi = b32.sum(-1, keepdim=True).expand(tokens, dims, rank).clone()
    for i, j in products:
        phi += torch.einsum("udg,dgq->udq", bp[i], wp[j])
    plain = b32.sum(-1, keepdim=True) + torch.einsum("udg,dgq->udq", b32, w32)
    one_product = b32.sum(-1, keepdim=True) + torch.einsum("udg,dgq->udq", bp[0], wp[0])
    assert rel(phi) < 2e-5 and rel(phi) < 3 * rel(plain) + 1e-7
    assert rel(one_product) > 2e-5


def test_distinct_ids_is_a_sync_free_unique():
    flat = torch.tensor([5, 3, 5, 9, 3, 3, 0], device=DEVICE)
    uniq, slot, count = distinct_ids(flat, 7)
    assert uniq.shape == (7,) and count.tolist() == [4]
    assert uniq[:4].tolist() == [0, 3, 5, 9] and torch.equal(uniq[slot], flat)
    assert torch.all(uniq[4:] == 0)


def test_unique_and_per_token_evaluation_agree():
    inp = _inputs(50, 12, 8, 2, 16, 2, 16, (3, 30), id_pool=7)
    a = leviathan(**inp, unique_ids=True)
    b = leviathan(**inp, unique_ids=False)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # 90 tokens, 7 distinct ids: every row of one id is the same row of the table
    ids = inp["input_ids"].reshape(-1)
    rows = a.reshape(90, -1)
    for i in ids.unique():
        same = rows[ids == i]
        assert torch.equal(same, same[:1].expand_as(same))


@pytest.mark.parametrize("unique_ids", [True, False])
def test_unchecked_out_of_range_ids_give_the_reference_nan_rows(unique_ids):
    """With the id check off (the default) an id outside [0, vocab_size) gives a NaN row on
    the kernel as on the reference (also ids the digits could represent, and more
    out-of-range ids than the vocabulary holds); the other rows and every gradient match."""
    inp = _inputs(10, 6, 4, 2, 8, 2, 5, (1,), id_pool=None)       # b = 4: ids 10..15 are representable
    ids = torch.tensor([3, -1, 10, 15, 16, 3, 9, -2**40, 11, 12, 13, 14, 0], device=DEVICE)
    valid = (ids >= 0) & (ids < 10)
    g = torch.randn(len(ids), 6, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    res = []
    for fn in (lambda **kw: leviathan(**kw, unique_ids=unique_ids), leviathan_reference):
        params = {k: v.clone().requires_grad_() if k in NAMES else v for k, v in inp.items()}
        out = fn(**{**params, "input_ids": ids}, vocab_size=10)
        res.append((out, torch.autograd.grad(out, [params[k] for k in NAMES], g)))
    (out, grads), (ref, ref_grads) = res
    assert torch.equal(out.isnan().all(-1), ~valid) and not out[valid].isnan().any()
    torch.testing.assert_close(out, ref, equal_nan=True, atol=1e-6, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        assert got.isfinite().all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_module_checked_ids_raise_token_id_error(backend):
    gen = LeviathanGenerator(30, 5, 4, 2, 8, 2, 2, 3, backend=backend, validate_ids=True).to(DEVICE)
    with pytest.raises(TokenIdError, match=r"\[0, vocab_size=30\), got 30"):
        gen(torch.tensor([1, 30], device=DEVICE))


def test_backward_is_deterministic():
    inp = _inputs(80, 10, 6, 2, 8, 2, 20, (2, 40), id_pool=20)
    grads = []
    for _ in range(2):
        params = {k: v.clone().requires_grad_() if k in NAMES else v for k, v in inp.items()}
        out = leviathan(**params)
        grads.append(torch.autograd.grad(out, [params[k] for k in NAMES], torch.ones_like(out)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_module_backends_agree_with_padding_mask():
    torch.manual_seed(0)
    gen = LeviathanGenerator(120, 16, 8, 2, 16, 2, 2, 24).to(DEVICE)
    with torch.no_grad():
        gen.head_norm_bias.normal_(0.0, 0.5)
    ids = torch.randint(0, 120, (3, 11), device=DEVICE)
    ids[0, 7:] = -100                                 # padding ids that are not even valid
    keep = ids >= 0
    res = []
    for backend in ("reference", "triton"):
        gen.backend = backend
        out = gen(ids, attention_mask=keep)
        res.append((out, torch.autograd.grad(out.square().sum(), list(gen.parameters()))))
    torch.testing.assert_close(res[0][0], res[1][0], atol=2e-5, rtol=2e-4)
    for a, b in zip(res[0][1], res[1][1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
    assert torch.all(res[1][0][0, 7:] == 0)


def test_kernel_handles_empty_input():
    inp = _inputs(30, 5, 4, 2, 8, 2, 3, (2, 0))
    assert leviathan(**inp).shape == (2, 0, 5)


def test_triton_rejects_float64_and_unsupported_sizes():
    inp = _inputs(30, 5, 4, 2, 8, 2, 3, (4,), dtype=torch.float64)
    with pytest.raises(DTypeError):
        leviathan(**inp)
    with pytest.raises(DTypeError, match="input_ids"):
        leviathan(**{**_inputs(30, 5, 4, 2, 8, 2, 3, (4,)), "input_ids": torch.ones(4, device=DEVICE)})
    gen = LeviathanGenerator(30, 5, 4, 2, 40, 2, 2, 3, backend="triton").to(DEVICE)
    with pytest.raises(ConfigError, match="num_knots=40"):
        gen(torch.tensor([1, 2], device=DEVICE))
    gen = LeviathanGenerator(30, 5, 4, 2, 8, 2, 2, 3, backend="triton", dtype=torch.float64).to(DEVICE)
    with pytest.raises(ConfigError, match="fp64"):
        gen(torch.tensor([1, 2], device=DEVICE))


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("CPU-only behaviour")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = LeviathanGenerator(30, 5, 4, 2, 8, 2, 2, 3, backend="triton")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        gen(torch.tensor([1, 2]))


def _spline_args(n=9, modes=2, seed_dim=5, knots=8, rank=6, device=DEVICE):
    torch.manual_seed(0)
    return (torch.randn(modes, seed_dim, n, device=device, requires_grad=True),
            torch.randn(modes, seed_dim, device=device, requires_grad=True),
            torch.randn(modes, seed_dim, device=device, requires_grad=True),
            (0.1 * torch.randn(modes, seed_dim, knots, rank, device=device)).requires_grad_(),
            torch.linspace(0, 1, knots, device=device), torch.tensor([n - 2], dtype=torch.int32, device=device))


def test_rows_past_the_distinct_count_are_zero():
    m, mean, rstd = leviathan_spline(*_spline_args())
    assert torch.all(m[-2:] == 0) and torch.all(m[:-2] != 0)
    assert torch.all(mean[:, -2:] == 0) and torch.all(rstd[:, -2:] == 0)


def test_opcheck_schema_and_autograd_registration():
    # The fake-tensor and AOT checks would run the interpreter on meta tensors; they
    # run in the GPU-marked test below.
    torch.library.opcheck(leviathan_spline, _spline_args(), test_utils=("test_schema", "test_autograd_registration"))


@pytest.mark.gpu
def test_opcheck_full_gpu():
    args = _spline_args(n=100, modes=8, seed_dim=128, knots=16, rank=64, device="cuda")
    torch.library.opcheck(leviathan_spline, args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_reference_low_precision(dtype):
    inp = _inputs(64402, 512, 128, 8, 16, 3, 64, (4, 256), cb_scale=0.02, dtype=dtype)
    inp["head_proj_weight"] = inp["head_proj_weight"] * (0.02 * 128**0.5)    # NeoLLM init scale
    assert_parity(leviathan, leviathan_reference, inp, NAMES, dtype=dtype)


@pytest.mark.gpu
def test_bf16_cosine_against_fp32_truth():
    gen = LeviathanGenerator().cuda()
    ids = torch.randint(0, 64402, (8, 512), device="cuda")
    truth = leviathan_reference(ids, *gen._params(), gen.knot_grid)
    low = gen.to(torch.bfloat16)
    out = leviathan(ids, *low._params(), low.knot_grid)
    cos = torch.nn.functional.cosine_similarity(out.float(), truth.float(), dim=-1)
    assert float(cos.min()) > 0.9999


@pytest.mark.gpu
def test_compile_fullgraph_smoke():
    gen = LeviathanGenerator(backend="triton").cuda()
    ids = torch.randint(0, 64402, (4, 128), device="cuda")
    compiled = torch.compile(gen, fullgraph=True)
    out = compiled(ids)
    out.float().square().mean().backward()
    torch.testing.assert_close(out, gen(ids))
