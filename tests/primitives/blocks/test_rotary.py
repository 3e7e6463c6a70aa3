import pytest
import torch
from hypothesis import given, strategies as st

from laminae.primitives import ConfigError, ShapeError
from laminae.primitives.blocks.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq, rotary_embedding, yarn_rope

from .. import _elastic_model


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


def _rotate_half_fp32_angles(x, positions, inv_freq):
    """The rotation MoSRAH and the sliding window had: fp32 angles, cos/sin cast to x's
    dtype, ``x·cos + [−x_b, x_a]·sin``, positions one per row of x."""
    angle = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    angle = torch.cat([angle, angle], dim=-1)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_per_row_positions_give_the_routed_heads_rotation_bitwise(dtype):
    """One RoPE for every caller: MoSRAH's YaRN frequencies with per-head positions
    ``[B, L, T]`` and per-token positions shared by the heads, bit for bit the rotation
    MoSRAH and the sliding window computed before."""
    inv = yarn_rope(16, 10000.0, 64, 256, 1.0, 8.0).inv_freq
    x = torch.randn(2, 3, 5, 16).to(dtype)
    per_head = torch.randint(0, 300, (2, 3, 5))
    want = _rotate_half_fp32_angles(x, per_head, inv)
    torch.testing.assert_close(RotaryEmbedding(16, inv_freq=inv)(x, per_head), want, atol=0, rtol=0)
    torch.testing.assert_close(rotary_embedding(x, per_head, inv), want, atol=0, rtol=0)
    per_token = torch.randint(0, 300, (2, 3))
    torch.testing.assert_close(RotaryEmbedding(16, inv_freq=inv)(x, per_token),
                               _rotate_half_fp32_angles(x, per_token[..., None].expand(2, 3, 5), inv), atol=0, rtol=0)
    with pytest.raises(ShapeError, match="position_ids"):
        RotaryEmbedding(16)(x, torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_angles_are_shell_elastics_seed_rotation_bitwise(dtype):
    x = torch.randn(2, 11, 3, 8).to(dtype)
    rope = RotaryEmbedding(8, 10000.0, angle_dtype=torch.bfloat16, table_dtype=torch.bfloat16)
    want = _elastic_model.rotate(x, *_elastic_model.rotary(11, 8, 10000.0, "bfloat16", dtype))
    torch.testing.assert_close(rope(x, torch.arange(11)[None]), want, atol=0, rtol=0)
    plain = _elastic_model.rotate(x, *_elastic_model.rotary(11, 8, 10000.0, "float32", dtype))
    torch.testing.assert_close(RotaryEmbedding(8, 10000.0)(x, torch.arange(11)[None]), plain, atol=0, rtol=0)


def test_frequencies_stay_fp32_when_the_module_is_cast():
    """A bf16 frequency puts position 1000 up to ~2 rad off; a dtype cast of the model
    leaves the frequencies as they are (persistent tables follow the cast)."""
    inv = yarn_rope(16, 10000.0, 64, 256).inv_freq
    for cast in (torch.bfloat16, torch.float64):
        rope = RotaryEmbedding(16, inv_freq=inv, max_positions=8).to(cast)
        assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, inv)
        assert rope.cos_cache.dtype == cast
    with pytest.raises(ConfigError, match="angle_dtype"):
        RotaryEmbedding(8, angle_dtype=torch.int32)
