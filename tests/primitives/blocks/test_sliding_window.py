"""SHRAM's local path: the window over live ranks, its decoding frame, the flash path,
and its calling contract (forward(x, attention_mask, cache, *, position_ids),
empty_cache, cache=None → None)."""
import pytest
import torch

from laminae.primitives import ConfigError, DTypeError, ShapeError
from laminae.primitives.blocks.sliding_window import SlidingWindowAttention


def _live_rank(live):
    return (torch.cumsum(live.long(), 1) - 1).clamp_min(0)


def _reference_window(layer, x, live):
    """Brute force over live ranks, one query at a time."""
    B, N, _ = x.shape
    pos = _live_rank(live)
    out = torch.zeros(B, N, x.shape[-1])
    for b in range(B):
        idx = live[b].nonzero().flatten()
        for r, n in enumerate(idx.tolist()):
            keys = idx[max(0, r - layer.window + 1):r + 1]
            y, _ = layer(x[b:b + 1, keys], position_ids=pos[b:b + 1, keys])
            out[b, n] = y[0, -1]
    return out


def test_sliding_window_sees_itself_and_the_previous_window_minus_one_live_tokens():
    torch.manual_seed(0)
    layer = SlidingWindowAttention(16, 2, 8, window_size=3)
    x = torch.randn(2, 9, 16)
    live = torch.ones(2, 9, dtype=torch.bool)
    live[0, :2] = False
    live[1, 3:5] = False
    got, none = layer(x, live)
    assert none is None                                   # cache=None: no decoding
    want = _reference_window(layer, x, live)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert got[~live].abs().max() == 0
    # the default positions are the live ranks
    torch.testing.assert_close(layer(x, live, position_ids=_live_rank(live)).output, got, atol=0, rtol=0)
    # decoding token by token keeps exactly the last `window` live entries
    cache, steps = layer.empty_cache(2), []
    for t in range(9):
        y, cache = layer(x[:, t:t + 1], live[:, t:t + 1], cache)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), got, atol=1e-6, rtol=0)
    assert 3 <= cache.keys.shape[1] < 6 and cache.length == 9 and cache.live_tokens.tolist() == [7, 7]


def test_steps_write_into_the_ring_and_compact_once_per_window():
    """A one-token step writes its row after the frame in the same storage (no
    per-step copy of the window); every `window` steps the last `window` live rows
    move to the front of fresh storage; a second step from one cache copies, so
    neither continuation sees the other's rows; a cached chunk keeps its gradient."""
    torch.manual_seed(2)
    layer = SlidingWindowAttention(16, 2, 8, window_size=3)
    x = torch.randn(2, 12, 16)
    live = torch.ones(2, 12, dtype=torch.bool)
    live[0, :3] = False
    live[1, 5:7] = False
    with torch.no_grad():
        want = layer(x, live).output
        cache, steps, ends, storages, frames = layer.empty_cache(2), [], [], [], []
        for t in range(12):
            y, cache = layer(x[:, t:t + 1], live[:, t:t + 1], cache)
            steps.append(y)
            ends.append(cache.keys.shape[1])
            storages.append(cache.keys.data_ptr())
            frames.append((cache, cache.keys.clone(), cache.keep.clone()))
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-6, rtol=0)
    assert ends == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    moved = [t for t in range(1, 12) if storages[t] != storages[t - 1]]
    assert moved == [6, 10]                                # compactions only
    for old, keys, keep in frames:                         # no step changed an earlier cache
        assert torch.equal(old.keys, keys) and torch.equal(old.keep, keep)
    # the last `window` live rows of each row are the newest live keys, in order
    k = layer.rotary(layer.k_proj(x).view(2, 12, 2, 8), (torch.cumsum(live.long(), 1) - 1).clamp_min(0))
    for b in range(2):
        torch.testing.assert_close(cache.keys[b][cache.keep[b]][-3:], k[b][live[b]][-3:].detach(), atol=1e-6, rtol=0)
    with torch.no_grad():
        prefix = frames[7][0]                              # its storage's newest write is frames[8]
        y, again = layer(x[:, 8:9], live[:, 8:9], prefix)
    assert again.keys.data_ptr() != frames[8][0].keys.data_ptr()
    assert torch.equal(frames[8][0].keys, frames[8][1])
    torch.testing.assert_close(y, steps[8], atol=1e-6, rtol=0)
    # gradient through a cached chunk's own keys and values (written in place)
    with torch.no_grad():
        _, prefix = layer(x[:, :4], live[:, :4], layer.empty_cache(2))
    chunk = x[:, 4:6].clone().requires_grad_(True)
    xf = x.clone().requires_grad_(True)
    y, grown = layer(chunk, live[:, 4:6], prefix)
    assert grown.keys.data_ptr() == prefix.keys.data_ptr()
    y.sum().backward()
    layer(xf, live).output[:, 4:6].sum().backward()
    torch.testing.assert_close(chunk.grad, xf.grad[:, 4:6], atol=1e-6, rtol=0)


@pytest.mark.parametrize("length,window", [(1, 3), (7, 3), (9, 16)])
def test_local_path_on_the_flash_kernel_matches_the_reference(length, window, monkeypatch):
    import laminae.triton_ops._flash as flash

    calls = []
    real = flash.flash_attention
    monkeypatch.setattr(flash, "flash_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    ref = SlidingWindowAttention(16, 2, 8, window_size=window, backend="reference")
    tri = SlidingWindowAttention(16, 2, 8, window_size=window, backend="triton")
    tri.load_state_dict(ref.state_dict())
    x = torch.randn(2, length, 16, requires_grad=True)
    grad = torch.randn(2, length, 16)
    outs = []
    for layer in (ref, tri):
        x.grad = None
        y, _ = layer(x)
        y.backward(grad)
        outs.append((y.detach(), x.grad.clone(), layer.q_proj.weight.grad.clone(), layer.v_proj.weight.grad.clone()))
    assert calls, "the Triton backend did not run the flash kernel"
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    calls.clear()
    with torch.no_grad():                                  # a mask, even all-ones, takes the live-rank path
        tri(x, torch.ones(2, length, dtype=torch.bool))
    assert not calls


def test_one_token_steps_on_the_triton_backend_run_the_decoding_kernel(monkeypatch):
    """Cached one-token steps with holes, left padding and a dead step equal the
    reference's full forward, through the split-K decoding kernel over the frame: the
    ring's first slots, read in place (not the whole ring)."""
    import laminae.triton_ops._flash as flash

    calls, widths = [], []
    real = flash.flash_decode
    monkeypatch.setattr(flash, "flash_decode", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    torch.manual_seed(1)
    ref = SlidingWindowAttention(16, 2, 8, window_size=3, backend="reference")
    tri = SlidingWindowAttention(16, 2, 8, window_size=3, backend="triton")
    tri.load_state_dict(ref.state_dict())
    x = torch.randn(2, 8, 16)
    live = torch.ones(2, 8, dtype=torch.bool)
    live[0, :2] = False
    live[1, 4] = False
    with torch.no_grad():
        want = ref(x, live).output
        cache, steps = tri.empty_cache(2), []
        for t in range(8):
            held = cache.keys.shape[1]
            y, cache = tri(x[:, t:t + 1], live[:, t:t + 1], cache)
            steps.append(y)
            if held < 2 * 3:                               # written in place (else compacted: a fresh frame)
                widths.append(held + 1)
                assert calls[-1].data_ptr() == cache.keys.data_ptr() and calls[-1].shape == cache.keys.shape
                assert calls[-1].stride() == cache.keys.stride()
    assert len(calls) == 8 and len(widths) >= 6
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-6, rtol=0)


def test_empty_cache_and_named_errors():
    layer = SlidingWindowAttention(16, 2, 8, window_size=3)
    cache = layer.empty_cache(2)
    assert (cache.length, cache.batch, cache.dtype, cache.device) == (0, 2, torch.float32, torch.device("cpu"))
    assert cache.config == {"window": 3, "num_heads": 2, "head_dim": 8} and not cache.keep.any()
    assert layer.empty_cache(1, dtype=torch.float64).keys.dtype == torch.float64
    with pytest.raises(TypeError):
        layer.empty_cache(2, torch.float32)                # dtype is keyword-only
    with pytest.raises(DTypeError, match="dtype"):
        layer.empty_cache(2, dtype=torch.int32)
    x = torch.randn(2, 4, 16)
    with pytest.raises(ShapeError, match="batch"):
        layer(x, cache=layer.empty_cache(3))
    with pytest.raises(ConfigError, match="window"):
        SlidingWindowAttention(16, 2, 8, window_size=4)(x, cache=cache)
    with pytest.raises(TypeError, match="SlidingWindowCache"):
        layer(x, cache=object())
    with pytest.raises(DTypeError, match="x"):
        layer(x.double())
    with pytest.raises(ShapeError, match="position_ids"):
        layer(x, position_ids=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ShapeError, match="embedding_width"):
        layer(torch.randn(2, 4, 8))
    with pytest.raises(ConfigError, match="even"):
        SlidingWindowAttention(16, 2, 7, window_size=3)
