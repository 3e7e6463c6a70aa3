import math

import pytest
import torch

from laminae.primitives import ConfigError, DeviceError, DTypeError, LeviathanGenerator, ShapeError, TokenIdError
from laminae.primitives.spelling_bee import (SpellingBeeEmbedding, byte_level_token_bytes, byte_table_from_strings,
                                             parameter_count, sentencepiece_piece_bytes, spelling_bee_reference,
                                             spelling_bee_rotary, spelling_vectors)


def _worked_example():
    byte_embed = torch.zeros(256, 4)
    byte_embed[0x61] = torch.tensor([1.0, 0, 0, 0])
    byte_embed[0x62] = torch.tensor([0.0, 1, 0, 0])
    byte_ids, byte_len = byte_table_from_strings([b"ab"])
    e_tok = torch.tensor([[0.2, -0.4, 0.0, 1.0]])
    return torch.tensor([0]), e_tok, byte_embed, byte_ids, byte_len


def test_spec_worked_example():
    args = _worked_example()
    s = spelling_vectors(args[0], args[2], args[3], args[4])
    torch.testing.assert_close(s, torch.tensor([[0.0625, 0.0624969, 0.0, 0.000625]]), atol=1e-7, rtol=0)
    out = spelling_bee_reference(*args)
    torch.testing.assert_close(out, torch.tensor([[0.13125, -0.1687516, 0.0, 0.5003125]]), atol=1e-7, rtol=0)


def test_rotary_table_frequencies():
    cos, sin = spelling_bee_rotary(4)
    assert cos.shape == (16, 2) and cos.dtype == torch.float32
    torch.testing.assert_close(torch.atan2(sin[1], cos[1]).double(), torch.tensor([1.0, 0.01], dtype=torch.float64))
    cos1, _ = spelling_bee_rotary(4, byte_position_offset=1)
    torch.testing.assert_close(cos1[0], cos[1])


def test_extra_parameters_are_256_d():
    bee = SpellingBeeEmbedding(64402, 512)
    assert sum(p.numel() for p in bee.parameters()) == 256 * 512 == parameter_count(512) == 131_072
    assert [n for n, _ in bee.named_parameters()] == ["byte_embed.weight"]
    assert {"byte_ids", "byte_len", "table_ready"} <= set(bee.state_dict())
    assert 0.018 < float(bee.byte_embed.weight.detach().std()) < 0.022


def test_zero_byte_table_gives_half_token_embedding():
    ids, e_tok, byte_embed, byte_ids, byte_len = _worked_example()
    out = spelling_bee_reference(ids, e_tok, torch.zeros_like(byte_embed), byte_ids, byte_len)
    assert torch.equal(out, 0.5 * e_tok)


def _module(vocab=12, d=8, **kw):
    torch.manual_seed(0)
    bee = SpellingBeeEmbedding(vocab, d, backend="reference", **kw)
    words = [b"the", b"the", b"a", b"", "h\u00e9llo", b"x" * 20, b"\x00", b"ab"]
    bee.set_byte_table_from_strings(words)
    return bee


def test_identical_spellings_identical_vectors_position_independent():
    bee = _module()
    ids = torch.tensor([[0, 1, 0], [2, 0, 1]])
    e_tok = torch.zeros(2, 3, 8)
    out = bee(ids, token_embeddings=e_tok)
    torch.testing.assert_close(out[0, 0], out[0, 1])
    torch.testing.assert_close(out[0, 0], out[1, 1])
    torch.testing.assert_close(out[0, 0], out[1, 2])


def test_byte_table_builder_truncates_pads_and_extends():
    byte_ids, byte_len = byte_table_from_strings([b"ab", "\u00e9", b"y" * 17], vocab_size=5)
    assert byte_ids.shape == (5, 16) and byte_ids.dtype == torch.int16
    assert byte_len.tolist() == [2, 2, 16, 0, 0]
    assert byte_ids[1, :2].tolist() == [0xC3, 0xA9] and byte_ids[1, 2:].eq(0).all()
    assert byte_ids[2].eq(ord("y")).all() and byte_ids[3:].eq(0).all()
    with pytest.raises(ConfigError, match="more than vocab_size"):
        byte_table_from_strings([b"a", b"b"], vocab_size=1)


def test_tokenizer_spellings():
    assert byte_level_token_bytes("\u0120hello") == b" hello"  # GPT-2 'Ġ' is the space byte
    assert byte_level_token_bytes("\u00e2\u0122\u013e") == "\u201c".encode()  # partial-free UTF-8 of “
    assert byte_level_token_bytes("\u010a") == b"\n"
    assert sentencepiece_piece_bytes("\u2581the") == b" the"
    assert sentencepiece_piece_bytes("<0x0A>") == b"\n"
    assert sentencepiece_piece_bytes("<|im_start|>") == b"<|im_start|>"
    with pytest.raises(ConfigError):
        byte_level_token_bytes("\u4e2d")


@pytest.mark.parametrize("pad_mode, mode", [("embed", "mean"), ("zero", "mean"), ("embed", "masked_sqrt")])
def test_modes_match_their_formulas(pad_mode, mode):
    bee = _module(pad_mode=pad_mode, mode=mode)
    w = bee.byte_embed.weight.detach()
    cos, sin = spelling_bee_rotary(8)
    v = 4  # "héllo": 6 bytes
    n = int(bee.byte_len[v])
    terms = []
    for i in range(16):
        if (pad_mode == "zero" or mode == "masked_sqrt") and i >= n:
            continue
        u = w[int(bee.byte_ids[v, i])]
        terms.append(torch.cat([u[:4] * cos[i] - u[4:] * sin[i], u[4:] * cos[i] + u[:4] * sin[i]]))
    scale = 1 / math.sqrt(n) if mode == "masked_sqrt" else 1 / 16
    expected = scale * torch.stack(terms).sum(0)
    got = 2 * bee(torch.tensor([v]), token_embeddings=torch.zeros(1, 8))[0]
    torch.testing.assert_close(got, expected)
    if mode == "masked_sqrt":  # an empty token has s = 0
        assert torch.equal(bee(torch.tensor([3]), token_embeddings=torch.zeros(1, 8)), torch.zeros(1, 8))


def test_gradcheck_reference_float64():
    gen = torch.Generator().manual_seed(0)
    words = [bytes(torch.randint(0, 256, (int(k),), generator=gen).tolist()) for k in (0, 3, 7, 16, 18, 1, 2, 5)]
    byte_ids, byte_len = byte_table_from_strings(words)  # V = 8
    ids = torch.tensor([[0, 3, 7], [5, 3, 1]])
    e_tok = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    byte_embed = torch.randn(256, 4, dtype=torch.float64, requires_grad=True)
    for mode in ("mean", "masked_sqrt"):
        assert torch.autograd.gradcheck(
            lambda e, b: spelling_bee_reference(ids, e, b, byte_ids, byte_len, mode=mode, upcast=False),
            (e_tok, byte_embed))


@pytest.mark.parametrize("mode", ["masked_sqrt", "mean"])
def test_float64_is_computed_in_float64(mode):
    """fp64 inputs get fp64 slot weights and rotations: against a closed form in Python
    doubles the error is at fp64 rounding, not at fp32's (1/√3 in fp32 is off by 3e-8)."""
    d, theta = 4, 10000.0
    byte_ids, byte_len = byte_table_from_strings([b"abc"])
    byte_embed = torch.randn(256, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    e_tok = torch.zeros(1, d, dtype=torch.float64)
    expected = [0.0] * d
    weight = 1 / math.sqrt(3) if mode == "masked_sqrt" else 1 / 16
    for i in range(16):
        if mode == "masked_sqrt" and i >= 3:
            break
        u = byte_embed[int(byte_ids[0, i])].tolist()
        for j in range(d // 2):
            angle = i * theta ** (-2 * j / d)
            expected[j] += 0.5 * weight * (u[j] * math.cos(angle) - u[j + d // 2] * math.sin(angle))
            expected[j + d // 2] += 0.5 * weight * (u[j + d // 2] * math.cos(angle) + u[j] * math.sin(angle))
    for upcast in (True, False):
        out = spelling_bee_reference(torch.tensor([0]), e_tok, byte_embed, byte_ids, byte_len, mode=mode,
                                     upcast=upcast)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out[0], torch.tensor(expected, dtype=torch.float64), rtol=1e-13, atol=1e-15)
    bee = SpellingBeeEmbedding(1, d, mode=mode, backend="reference").double()
    bee.set_byte_table(byte_ids, byte_len)
    with torch.no_grad():
        bee.byte_embed.weight.copy_(byte_embed)
    unbaked = bee(torch.tensor([0]), token_embeddings=e_tok)
    bee.eval().bake_inference_table()
    for got in (unbaked, bee(torch.tensor([0]), token_embeddings=e_tok), bee.fold_into_embedding(e_tok)):
        torch.testing.assert_close(got[0], torch.tensor(expected, dtype=torch.float64), rtol=1e-13, atol=1e-15)


def test_unchecked_out_of_range_ids_give_nan_rows():
    """Without the id check (the default on every device) an id outside [0, V) gives a NaN
    row, unbaked and baked alike, and the byte table's gradient stays finite."""
    bee = _module()
    ids = torch.tensor([[0, -1, 4], [12, 7, 40]])
    valid = (ids >= 0) & (ids < 12)
    e_tok = torch.randn(2, 3, 8, requires_grad=True)
    out = bee(ids, token_embeddings=e_tok)
    assert torch.equal(out.isnan().all(-1), ~valid) and not out[valid].isnan().any()
    torch.testing.assert_close(out[valid], bee(ids[valid], token_embeddings=e_tok[valid]))
    (grad,) = torch.autograd.grad(out[valid].sum(), bee.byte_embed.weight)
    assert grad.isfinite().all()
    bee.eval().bake_inference_table()
    torch.testing.assert_close(bee(ids, token_embeddings=e_tok), out, equal_nan=True)


def test_one_error_class_for_out_of_range_ids():
    bee = _module(validate_ids=True)
    gen = LeviathanGenerator(vocab_size=12, hidden_size=8, seed_dim=4, num_modes=1, num_knots=4, rank=2,
                             backend="reference", validate_ids=True)
    for call in (lambda ids: bee(ids, token_embeddings=torch.zeros(*ids.shape, 8)), gen):
        with pytest.raises(TokenIdError, match=r"`\w*ids` must lie in \[0, vocab_size=12\), got 12"):
            call(torch.tensor([0, 12]))
        with pytest.raises(TokenIdError, match=r"got -1 \(2 of 3 ids out of range, values in \[-1, 15\]\)"):
            call(torch.tensor([-1, 0, 15]))
    assert issubclass(TokenIdError, (ValueError, IndexError))


def test_reference_compiles_with_fullgraph():
    """torch.compile(fullgraph=True), forward and backward: the forward reads no device
    tensor on the host (the table flag is a Python attribute)."""
    bee = _module()
    ids = torch.tensor([[0, 4, 11], [3, 7, 1]])
    e_tok = torch.randn(2, 3, 8, requires_grad=True)
    out = torch.compile(bee, fullgraph=True, backend="eager")(ids, token_embeddings=e_tok)
    grads = torch.autograd.grad(out.square().sum(), [e_tok, bee.byte_embed.weight])
    eager = bee(ids, token_embeddings=e_tok)
    want = torch.autograd.grad(eager.square().sum(), [e_tok, bee.byte_embed.weight])
    torch.testing.assert_close(out, eager)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref)


def test_bake_matches_unbaked_and_is_dropped_by_train():
    bee = _module().eval()
    ids = torch.tensor([[0, 3, 4, 7, 11]])
    e_tok = torch.randn(1, 5, 8)
    ref = bee(ids, token_embeddings=e_tok)
    baked = bee.bake_inference_table()
    assert baked.shape == (12, 8)
    torch.testing.assert_close(bee(ids, token_embeddings=e_tok), ref)
    bee.train()
    assert bee.baked is None
    bee.eval().bake_inference_table()
    bee.training = True  # e.g. a caller flipping the flag by hand
    with pytest.raises(RuntimeError, match="unbake"):
        bee(ids, token_embeddings=e_tok)


def test_fold_into_dense_embedding_is_one_lookup():
    bee = _module().eval()
    table = torch.randn(12, 8)
    ids = torch.tensor([[1, 4, 11, 3]])
    folded = bee.fold_into_embedding(table)
    torch.testing.assert_close(folded[ids], bee(ids, token_embeddings=table[ids]))
    with pytest.raises(ShapeError, match="embedding_weight"):
        bee.fold_into_embedding(torch.randn(11, 8))


def test_state_dict_roundtrip_keeps_table():
    bee = _module()
    other = SpellingBeeEmbedding(12, 8, backend="reference")
    other.load_state_dict(bee.state_dict(), strict=True)
    ids, e_tok = torch.tensor([4, 5]), torch.randn(2, 8)
    torch.testing.assert_close(other(ids, token_embeddings=e_tok), bee(ids, token_embeddings=e_tok))


def test_runs_under_cpu_autocast():
    bee = _module()
    ids = torch.tensor([[0, 4]])
    e_tok = torch.randn(1, 2, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bee(ids, token_embeddings=e_tok)
    out.sum().backward()
    assert out.shape == e_tok.shape and bee.byte_embed.weight.grad is not None
    # the cast policy: the block's own math runs with autocast off, on fp32 activations here
    torch.testing.assert_close(out, bee(ids, token_embeddings=e_tok), atol=1e-7, rtol=1e-6)


def test_forward_before_table_raises():
    bee = SpellingBeeEmbedding(4, 8)
    with pytest.raises(RuntimeError, match="set_byte_table"):
        bee(torch.tensor([0]), token_embeddings=torch.zeros(1, 8))
    with pytest.raises(RuntimeError, match="set_byte_table"):
        bee.bake_inference_table()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden_size=7), "even"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(byte_position_offset=2), "byte_position_offset"),
        (dict(pad_mode="mask"), "pad_mode"),
        (dict(mode="sum"), "mode"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(backend="cuda"), "backend"),
        (dict(validate_ids=None), "validate_ids"),
    ],
)
def test_bad_config_raises(kwargs, match):
    args = dict(vocab_size=8, hidden_size=8) | kwargs
    with pytest.raises(ConfigError, match=match):
        SpellingBeeEmbedding(**args)


def test_bad_inputs_raise():
    bee = _module(validate_ids=True)
    e = torch.zeros(2, 8)
    with pytest.raises(TokenIdError, match=r"\[0, vocab_size=12\), got 12"):
        bee(torch.tensor([0, 12]), token_embeddings=e)
    with pytest.raises(ConfigError, match=r"got -1"):     # a TokenIdError is a ConfigError, as before
        bee(torch.tensor([-1, 0]), token_embeddings=e)
    with pytest.raises(DTypeError, match="input_ids"):
        bee(torch.tensor([0.0, 1.0]), token_embeddings=e)
    with pytest.raises(TypeError):                       # the token embeddings are keyword-only
        bee(torch.tensor([0, 1]), e)
    with pytest.raises(ShapeError, match="token_embeddings"):
        bee(torch.tensor([0, 1]), token_embeddings=torch.zeros(2, 6))
    with pytest.raises(ShapeError, match="token_embeddings"):
        bee(torch.tensor([[0, 1]]), token_embeddings=e)
    with pytest.raises(DTypeError, match="bfloat16"):
        bee(torch.tensor([0, 1]), token_embeddings=e.bfloat16())
    with pytest.raises(DeviceError, match="meta"):
        bee(torch.tensor([0, 1]), token_embeddings=torch.zeros(2, 8, device="meta"))


def test_bad_byte_tables_raise():
    bee = SpellingBeeEmbedding(4, 8)
    good_ids, good_len = byte_table_from_strings([b"a"], vocab_size=4)
    with pytest.raises(ShapeError, match="byte_ids"):
        bee.set_byte_table(torch.zeros(4, 8, dtype=torch.int16), good_len)  # wrong width
    with pytest.raises(ShapeError, match="byte_ids"):
        bee.set_byte_table(torch.zeros(5, 16, dtype=torch.int16), good_len)  # vocabulary exceeds V
    with pytest.raises(ConfigError, match=r"\[0, 255\]"):
        bad = good_ids.clone()
        bad[0, 0] = 256
        bee.set_byte_table(bad, good_len)
    with pytest.raises(ConfigError, match="byte_len"):
        bee.set_byte_table(good_ids, torch.full((4,), 17, dtype=torch.int16))
    with pytest.raises(DTypeError, match="byte_ids"):
        bee.set_byte_table(good_ids.float(), good_len)
    with pytest.raises(ConfigError, match="more than vocab_size"):
        bee.set_byte_table_from_strings([b"a"] * 5)
    assert not bool(bee.table_ready)
