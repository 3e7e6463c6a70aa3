import pytest
import torch
from hypothesis import given, strategies as st

from laminae.primitives import ConfigError, ShapeError
from laminae.primitives.blocks.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq


def rotate_half_reference(x, positions, dim, theta):
    """The Hugging Face Llama form: cat(freqs, freqs), x·cos + rotate_half(x)·sin."""
    inv = rope_inv_freq(dim, theta)
    freqs = positions.float()[..., None] * inv
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, :, None], emb.sin()[:, :, None]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@given(seq=st.integers(1, 9), heads=st.integers(1, 3), half=st.integers(1, 8), theta=st.sampled_from([1e4, 5e5]))
def test_full_head_matches_rotate_half(seq, heads, half, theta):
    dim = 2 * half
    x = torch.randn(2, seq, heads, dim)
    pos = torch.arange(seq).unsqueeze(0)
    torch.testing.assert_close(RotaryEmbedding(dim, theta)(x, pos), rotate_half_reference(x, pos, dim, theta))


def test_partition_rotates_only_the_last_features_and_keeps_norms():
    rope = RotaryEmbedding(4)
    x = torch.randn(1, 5, 2, 10)
    y = rope(x, torch.arange(5)[None], start=6)
    torch.testing.assert_close(y[..., :6], x[..., :6])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_scores_depend_on_relative_position_only():
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    s = lambda pq, pk: (rope(q, torch.tensor([[pq]])) * rope(k, torch.tensor([[pk]]))).sum()  # noqa: E731
    torch.testing.assert_close(s(7, 3), s(104, 100), atol=1e-5, rtol=0)


def test_persistent_tables_are_in_the_state_dict_and_match_on_the_fly():
    tabled = RotaryEmbedding(8, max_positions=32, persistent=True)
    assert {"inv_freq", "cos_cache", "sin_cache"} <= set(tabled.state_dict())
    assert "inv_freq" not in RotaryEmbedding(8).state_dict()
    x, pos = torch.randn(2, 5, 1, 8), torch.tensor([[0, 3, 9, 30, 31]])
    torch.testing.assert_close(tabled(x, pos), RotaryEmbedding(8)(x, pos))


def test_bf16_rounded_tables():
    rope = RotaryEmbedding(8, table_dtype=torch.bfloat16)
    cos, _ = rope.cos_sin(torch.arange(50))
    assert torch.equal(cos, cos.bfloat16().float())


def test_named_errors():
    with pytest.raises(ConfigError, match="even"):
        RotaryEmbedding(5)
    with pytest.raises(ConfigError, match="max_positions"):
        RotaryEmbedding(4, persistent=True)
    with pytest.raises(ShapeError, match="does not fit"):
        apply_rotary(torch.randn(1, 2, 1, 4), torch.ones(1, 2, 3), torch.ones(1, 2, 3))


def test_positions_past_the_tables_are_a_shape_error_in_debug_mode(monkeypatch):
    """A table lookup past ``max_positions`` is a raw IndexError (a device assert on
    CUDA); the models refuse such a context on the host, and LAMINAE_DEBUG=1 reads the
    positions of a direct call."""
    rope = RotaryEmbedding(8, max_positions=4)
    x = torch.randn(1, 5, 2, 8)
    monkeypatch.setenv("LAMINAE_DEBUG", "1")
    with pytest.raises(ShapeError, match=r"max_positions=4\) \(the rotary tables\), got \[0, 4\]"):
        rope(x, torch.arange(5)[None])
    rope(x[:, :4], torch.arange(4)[None])
