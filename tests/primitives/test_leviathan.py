import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from laminae.primitives import ConfigError, DeviceError, DTypeError, ShapeError, TokenIdError
from laminae.primitives.leviathan import (LeviathanGenerator, leviathan_base, leviathan_basis, leviathan_digits,
                                          leviathan_knot_grid, leviathan_kwargs_from_config, leviathan_reference)

NAMES = ["codebooks", "head_proj_weight", "head_norm_weight", "head_norm_bias", "head_spline_delta", "head_out_weight"]


def _tiny(dtype=torch.float64, **kw):
    """The spec's gradcheck configuration: V = 30, k = 2, d = 4, h = 2, κ = 8, r = 3, D = 5."""
    torch.manual_seed(0)
    args = dict(vocab_size=30, hidden_size=5, seed_dim=4, num_modes=2, num_knots=8, num_coords=2, rank=3)
    args.update(kw)
    gen = LeviathanGenerator(**args, backend="reference", dtype=dtype)
    with torch.no_grad():  # well-conditioned LayerNorm inputs and some negative φ factors
        gen.codebooks.normal_()
        gen.head_proj_weight.normal_()
        gen.head_norm_bias.normal_(0.0, 0.5)
        gen.head_spline_delta.normal_(0.0, 0.7)
    return gen


# --- the spec's worked examples -------------------------------------------------------

def test_base_and_digits_worked_examples():
    assert leviathan_base(10, 2) == 4 and leviathan_base(64402, 3) == 41 and leviathan_base(200376, 3) == 59
    assert leviathan_digits(torch.tensor([7]), 4, 2).tolist() == [[1, 3]]
    assert leviathan_digits(torch.tensor([64401, 41]), 41, 3).tolist() == [[38, 12, 31], [0, 1, 0]]
    ids = torch.arange(41**3)
    d = leviathan_digits(ids, 41, 3)
    assert torch.equal(d[:, 0] * 41**2 + d[:, 1] * 41 + d[:, 2], ids)


@given(vocab=st.integers(1, 10**7), coords=st.integers(1, 4))
def test_base_is_the_smallest_that_covers_the_vocabulary(vocab, coords):
    base = leviathan_base(vocab, coords)
    assert base**coords >= vocab and (base - 1) ** coords < vocab
    ids = torch.tensor([0, vocab - 1, vocab // 2])
    digits = leviathan_digits(ids, base, coords)
    weights = torch.tensor([base ** (coords - 1 - i) for i in range(coords)])
    assert torch.equal((digits * weights).sum(-1), ids) and int(digits.max()) < base


@given(z=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=20), knots=st.integers(2, 64))
def test_basis_is_a_partition_of_unity_with_three_knots(z, knots):
    grid = leviathan_knot_grid(knots, torch.float64)
    basis = leviathan_basis(torch.tensor(z, dtype=torch.float64), grid)
    assert torch.all(basis >= 0) and int((basis > 1e-12).sum(-1).max()) <= 3
    torch.testing.assert_close(basis.sum(-1), torch.ones(len(z), dtype=torch.float64))


def test_seed_is_the_sum_of_one_codebook_row_per_digit():
    gen = _tiny(vocab_size=10, num_coords=2)      # b = 4: id 7 = (1, 3), id 8 = (2, 0), id 6 = (1, 2)
    with torch.no_grad():                          # make C0[2] + C1[0] equal C0[1] + C1[3]
        gen.codebooks[1, 0] = gen.codebooks[0, 1] + gen.codebooks[1, 3] - gen.codebooks[0, 2]
    out = gen(torch.tensor([7, 8, 6]))
    torch.testing.assert_close(out[0], out[1])
    assert (out[0] - out[2]).abs().max() > 1e-3


@pytest.mark.parametrize("z_tilde, expected", [
    (0.2, {2: 0.125, 3: 0.75, 4: 0.125}),
    (0.0, {0: 6 / 7, 1: 1 / 7}),
    (0.5, {7: 0.5, 8: 0.5}),
])
def test_basis_worked_examples(z_tilde, expected):
    basis = leviathan_basis(torch.tensor([z_tilde]), leviathan_knot_grid(16))[0]
    want = torch.zeros(16)
    for knot, value in expected.items():
        want[knot] = value
    torch.testing.assert_close(basis, want, atol=1e-6, rtol=0)


def test_basis_normaliser_range_and_partition_of_unity():
    grid = leviathan_knot_grid(16, torch.float64)
    z = torch.linspace(0, 1, 10001, dtype=torch.float64)
    delta = (z[:, None] - grid).abs() * 15
    w = torch.where(delta < 0.5, 0.75 - delta**2, torch.where(delta < 1.5, 0.5 * (1.5 - delta) ** 2, 0.0))
    total = w.sum(-1)
    assert abs(float(total.min()) - 0.875) < 1e-12 and abs(float(total.max()) - 1.0) < 1e-12
    basis = leviathan_basis(z, grid)
    torch.testing.assert_close(basis.sum(-1), torch.ones_like(z))
    assert int((basis > 1e-12).sum(-1).max()) <= 3


def test_parameter_count_for_the_defaults():
    assert sum(p.numel() for p in LeviathanGenerator().parameters()) == 1_459_584
    # the extracted reference's own default vocabulary (o200k), errata 3
    assert sum(p.numel() for p in LeviathanGenerator(vocab_size=200376).parameters()) == 1_466_496


def test_state_dict_names_and_shapes_are_pinned():
    gen = LeviathanGenerator()
    shapes = {k: tuple(v.shape) for k, v in gen.state_dict().items()}
    assert shapes == {"codebooks": (3, 41, 128), "head_proj_weight": (8, 128, 128), "head_norm_weight": (8, 128),
                      "head_norm_bias": (8, 128), "head_spline_delta": (8, 128, 16, 64),
                      "head_out_weight": (8, 64, 512)}
    assert gen.knot_grid.dtype == torch.float32 and "knot_grid" not in gen.state_dict()
    other = LeviathanGenerator()
    other.load_state_dict(gen.state_dict(), strict=True)
    ids = torch.randint(0, 64402, (3, 5))
    torch.testing.assert_close(other(ids), gen(ids))


def test_initialisation_statistics():
    gen = LeviathanGenerator(seed_dim=64, rank=32)
    assert abs(float(gen.codebooks.detach().std()) - 0.02) < 2e-3
    assert abs(float(gen.head_spline_delta.detach().std()) - 0.1) < 5e-3
    assert abs(float(gen.head_out_weight.detach().std()) - 0.02 / 8**0.5) < 1e-3
    assert torch.all(gen.head_norm_weight == 1) and torch.all(gen.head_norm_bias == 0)


# --- invariants -----------------------------------------------------------------------

def test_zero_delta_gives_a_token_independent_output_and_no_upstream_gradient():
    gen = _tiny(torch.float32, vocab_size=200, num_knots=16, rank=6, seed_dim=32)
    with torch.no_grad():
        gen.head_spline_delta.zero_()
    out = gen(torch.arange(200))
    expected = gen.head_out_weight.sum((0, 1))
    torch.testing.assert_close(out, expected.expand_as(out), atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    for name in ("codebooks", "head_proj_weight", "head_norm_weight", "head_norm_bias"):
        assert float(getattr(gen, name).grad.abs().max()) < 1e-4, name


def test_batch_independence():
    gen = _tiny(torch.float32, vocab_size=500, seed_dim=16)
    ids = torch.randint(0, 500, (4, 9))
    batch = gen(ids)
    alone = torch.stack([gen(ids[i, j].reshape(1)) for i in range(4) for j in range(9)]).reshape(4, 9, -1)
    # Not bitwise: BLAS picks a different kernel (and summation order) for 1 row than for 36.
    torch.testing.assert_close(batch, alone, atol=1e-7, rtol=1e-6)
    # Same batch size, rows permuted: each row is computed alone, so bitwise.
    perm = torch.randperm(36)
    assert torch.equal(gen(ids.reshape(-1)[perm]), batch.reshape(36, -1)[perm])


def test_negative_spline_factors_set_the_sign_by_parity():
    gen = _tiny(torch.float64, seed_dim=2, num_modes=1, rank=1)
    with torch.no_grad():
        gen.head_spline_delta.fill_(-2.0)            # every factor φ = -1: M = (-1)^d
    out = gen(torch.tensor([3]))
    torch.testing.assert_close(out[0], gen.head_out_weight[0, 0], atol=1e-7, rtol=1e-7)
    gen3 = _tiny(torch.float64, seed_dim=3, num_modes=1, rank=1)
    with torch.no_grad():
        gen3.head_spline_delta.fill_(-2.0)
    torch.testing.assert_close(gen3(torch.tensor([3]))[0], -gen3.head_out_weight[0, 0], atol=1e-7, rtol=1e-7)


@pytest.mark.parametrize("upcast", [True, False])
def test_gradcheck_reference_float64(upcast):
    gen = _tiny()
    ids = torch.tensor([[0, 7, 29], [7, 13, 21]])
    params = [p.detach().clone().requires_grad_() for p in gen._params()]
    fn = lambda *p: leviathan_reference(ids, *p, gen.knot_grid, upcast=upcast)  # noqa: E731
    assert gen.knot_grid.dtype == torch.float64
    assert torch.autograd.gradcheck(fn, tuple(params))


def test_same_dtype_baseline_is_close_to_the_fp32_truth_in_bf16():
    gen = _tiny(torch.float32, vocab_size=300, seed_dim=32, num_knots=16, rank=16, hidden_size=24)
    ids = torch.randint(0, 300, (40,))
    truth = gen(ids)
    low = gen.to(torch.bfloat16)
    assert low.knot_grid.dtype == torch.float32       # errata 1: the knots are never rounded
    same_dtype = leviathan_reference(ids, *low._params(), low.knot_grid, upcast=False)
    upcast = leviathan_reference(ids, *low._params(), low.knot_grid, upcast=True)
    assert same_dtype.dtype == upcast.dtype == torch.bfloat16
    for out in (same_dtype, upcast):
        cos = torch.nn.functional.cosine_similarity(out.detach().float(), truth.detach(), dim=-1)
        assert float(cos.min()) > 0.99


def test_knot_grid_stays_fp32_and_exact_through_casts():
    gen = LeviathanGenerator(num_knots=16).to(torch.bfloat16)
    assert gen.knot_grid.dtype == torch.float32
    assert torch.equal(gen.knot_grid, torch.linspace(0, 1, 16))
    assert LeviathanGenerator(dtype=torch.float64).knot_grid.dtype == torch.float64


def test_autocast_leaves_the_generator_in_its_parameter_dtype():
    gen = _tiny(torch.float32, vocab_size=100, seed_dim=8)
    ids = torch.randint(0, 100, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gen(ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, gen(ids))


def test_an_input_without_tokens_is_refused():
    gen = _tiny(torch.float32)       # the empty-input rule of docs/protocol.md
    for ids in (torch.zeros(0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        with pytest.raises(ShapeError, match="at least one token"):
            gen(ids)


def test_attention_mask_padding_never_reaches_kept_positions():
    gen = _tiny(torch.float32)
    ids = torch.tensor([[3, 4, -100, 99999], [5, 6, 7, 8]])
    keep = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    out = gen(ids, attention_mask=keep)
    torch.testing.assert_close(out[0, :2], gen(ids[0, :2]))
    torch.testing.assert_close(out[1], gen(ids[1]))
    assert torch.all(out[0, 2:] == 0)


def test_frozen_embedding_table_matches_the_generator():
    gen = _tiny(torch.float32, vocab_size=200, seed_dim=8)
    table = gen.embedding_table(chunk_size=64)
    assert table.shape == (200, 5) and not table.requires_grad
    ids = torch.randint(0, 200, (3, 7))
    torch.testing.assert_close(torch.nn.functional.embedding(ids, table), gen(ids).detach(), atol=1e-7, rtol=1e-6)


def test_kwargs_from_neollm_config():
    cfg = {"vocab_size": 64402, "hidden_size": 512, "generator_d_seed": 128, "generator_num_modes": 8,
           "generator_num_knots": 16, "generator_spline_degree": 2, "generator_k": 3, "generator_krank": 64,
           "use_token_generator": True}
    kwargs = leviathan_kwargs_from_config(cfg)
    assert kwargs == dict(vocab_size=64402, hidden_size=512, seed_dim=128, num_modes=8, num_knots=16,
                          spline_degree=2, num_coords=3, rank=64)
    assert LeviathanGenerator(**kwargs).base == 41


# --- named errors ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(spline_degree=3), dict(num_knots=1), dict(num_knots=0), dict(seed_dim=0), dict(num_modes=0),
    dict(rank=0), dict(hidden_size=0), dict(num_coords=0), dict(vocab_size=0), dict(backend="cuda"),
    dict(unique_ids="yes"), dict(initializer_range=-1.0), dict(validate_ids=None),
])
def test_bad_config_raises(kwargs):
    with pytest.raises(ConfigError):
        LeviathanGenerator(**{"vocab_size": 50, "hidden_size": 8, "seed_dim": 4, **kwargs})


def test_bad_ids_raise_named_errors():
    gen = _tiny(torch.float32, validate_ids=True)  # V = 30, b = 6: ids 30..35 are representable, not vocabulary
    with pytest.raises(TokenIdError, match=r"\[0, vocab_size=30\), got -1"):
        gen(torch.tensor([1, -1]))
    with pytest.raises(TokenIdError, match="got 30"):
        gen(torch.tensor([30]))
    with pytest.raises(IndexError):
        gen(torch.tensor([36]))
    gen(torch.tensor([[1, 36]]), attention_mask=torch.tensor([[1, 0]]))   # a padded position is never checked
    with pytest.raises(DTypeError, match="input_ids"):
        gen(torch.tensor([1.0, 2.0]))
    with pytest.raises(DTypeError, match="input_ids"):
        gen(torch.tensor([True]))
    with pytest.raises(TypeError):
        gen([1, 2])
    with pytest.raises(DeviceError):
        gen(torch.tensor([1], device="meta"))


def test_unchecked_out_of_range_ids_give_nan_rows():
    """Without the id check (the default on every device) an id outside [0, V) cannot pass
    for an ordinary embedding: its row is NaN, every other row is what the id gives alone,
    and the parameters' gradient through the valid rows stays finite."""
    gen = _tiny(torch.float32)
    ids = torch.tensor([[1, -1, 30, 35], [36, 2, 29, -7]])   # 30..35: representable by the digits, not vocabulary
    valid = (ids >= 0) & (ids < 30)
    out = gen(ids)
    assert torch.equal(out.isnan().all(-1), ~valid) and not out[valid].isnan().any()
    torch.testing.assert_close(out[valid], gen(ids[valid]))
    grads = torch.autograd.grad(out[valid].sum(), list(gen.parameters()))
    assert all(g.isfinite().all() for g in grads)
    masked = gen(ids, attention_mask=valid)                  # padded positions give zero rows, not NaN
    assert torch.equal(masked[~valid], torch.zeros_like(masked[~valid]))
    ref = leviathan_reference(ids, *gen._params(), gen.knot_grid)       # the functional default range is b^k
    assert torch.equal(ref.isnan().all(-1), (ids < 0) | (ids >= 36))
    with pytest.raises(ConfigError, match="vocab_size"):
        leviathan_reference(ids, *gen._params(), gen.knot_grid, vocab_size=37)


def test_reference_compiles_with_fullgraph_and_keeps_the_nan_rows():
    """torch.compile(fullgraph=True), forward and backward: no host read of the ids (the
    check is skipped while tracing, so an out-of-range id still gives its NaN row)."""
    gen = _tiny(torch.float32, validate_ids=True)
    ids = torch.tensor([[1, 30, 2], [2, 2, -1]])
    valid = (ids >= 0) & (ids < 30)
    out = torch.compile(gen, fullgraph=True, backend="eager")(ids)
    grads = torch.autograd.grad(out[valid].square().sum(), list(gen.parameters()))
    eager = gen(ids[valid])
    want = torch.autograd.grad(eager.square().sum(), list(gen.parameters()))
    assert torch.equal(out.isnan().all(-1), ~valid)
    torch.testing.assert_close(out[valid], eager)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref)


def test_bad_mask_and_buffers_raise_named_errors():
    gen = _tiny(torch.float32)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ShapeError, match="2-D"):
        gen(ids[0], attention_mask=torch.ones(3))
    with pytest.raises(ShapeError, match="attention_mask"):
        gen(ids, attention_mask=torch.ones(1, 4))
    with pytest.raises(DTypeError, match="mask == 0"):   # additive float masks are refused
        gen(ids, attention_mask=torch.tensor([[0.0, float("-inf"), 0.0]]))
    gen.knot_grid = torch.linspace(0, 1, 9)
    with pytest.raises(ShapeError, match="knot_grid"):
        gen(ids)


def test_loading_a_checkpoint_of_another_shape_raises_shape_error():
    state = LeviathanGenerator(vocab_size=50, hidden_size=8, seed_dim=4, num_knots=32).state_dict()
    with pytest.raises(ShapeError, match=r"head_spline_delta.*\(8, 4, 16, 64\)"):
        LeviathanGenerator(vocab_size=50, hidden_size=8, seed_dim=4, num_knots=16).load_state_dict(state)
