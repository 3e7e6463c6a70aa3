import math

import pytest
import torch

from laminae.primitives import ConfigError, DeviceError, DTypeError, ShapeError
from laminae.primitives.stack_memory import (StackMemory, StackMemoryCache, StackMemoryState,
                                             stack_actions_reference, stack_memory_reference,
                                             stack_read_reference, stack_scan_reference, stack_step_reference,
                                             stack_update_reference)

from .._decoding import prefill_then_decode


def _logits_for(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float64))


# ----------------------------------------------------------------------------
# The spec's worked example (H = 1, S = 3, d = 1, w_g = 1)
# ----------------------------------------------------------------------------


def _worked_example():
    stack, mask = torch.zeros(3, 1, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    stack, mask = stack_update_reference(stack, mask, torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64),
                                         torch.tensor([2.0], dtype=torch.float64))
    first = stack.clone(), mask.clone()
    stack, mask = stack_update_reference(stack, mask, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64),
                                         torch.tensor([-1.0], dtype=torch.float64))
    return first, (stack, mask)


def test_worked_example_push_pop_noop_values():
    (st0, m0), (st1, m1) = _worked_example()
    torch.testing.assert_close(st0.squeeze(-1), torch.tensor([1.4, 0, 0], dtype=torch.float64))
    torch.testing.assert_close(m0, torch.tensor([0.7, 0, 0], dtype=torch.float64))
    torch.testing.assert_close(st1.squeeze(-1), torch.tensor([-0.22, 0.7, 0], dtype=torch.float64))
    torch.testing.assert_close(m1, torch.tensor([0.64, 0.35, 0], dtype=torch.float64))


def test_worked_example_reads_and_entropy():
    _, (st1, m1) = _worked_example()
    gate = torch.ones(1, dtype=torch.float64)
    assert abs(float(stack_read_reference(st1, m1, gate, "soft")) - 0.223511) < 5e-7
    assert abs(float(stack_read_reference(st1, m1, gate, "released")) - (-0.22)) < 1e-12
    _, entropy = stack_actions_reference(_logits_for([0.5, 0.3, 0.2]))
    assert abs(float(entropy) - 1.029653) < 5e-7


def test_worked_example_through_the_step_function_as_two_layers():
    # the same example as two depth layers of stack_step_reference (B = T = H = 1)
    z = [_logits_for(p).view(1, 1, 1, 3) for p in ([0.7, 0.2, 0.1], [0.5, 0.3, 0.2])]
    p = [torch.tensor(v, dtype=torch.float64).view(1, 1, 1, 1) for v in (2.0, -1.0)]
    st, m = torch.zeros(1, 1, 1, 3, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 3, dtype=torch.float64)
    gate = torch.ones(1, dtype=torch.float64)
    for layer in range(2):
        read, st, m, ent = stack_step_reference(z[layer], p[layer], st, m, gate)
    assert abs(float(read) - 0.223511) < 5e-7 and abs(float(ent) - 1.029653) < 5e-7


# ----------------------------------------------------------------------------
# Invariants
# ----------------------------------------------------------------------------


def test_push_only_is_a_shift_register():
    S, d, L = 5, 2, 7
    st, m = torch.zeros(S, d, dtype=torch.float64), torch.zeros(S, dtype=torch.float64)
    pushes = torch.randn(L, d, dtype=torch.float64)
    push = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    for layer in range(L):
        st, m = stack_update_reference(st, m, push, pushes[layer])
        n = min(layer + 1, S)
        torch.testing.assert_close(st[:n], pushes[: layer + 1].flip(0)[:n], rtol=0, atol=0)
        assert torch.equal(m, (torch.arange(S) < n).double())


def test_push_then_pop_restores_and_noop_keeps():
    torch.manual_seed(3)
    S, d = 6, 3
    st = torch.randn(S, d, dtype=torch.float64)
    st[-1] = 0  # the bottom slot would overflow on push
    m = torch.rand(S, dtype=torch.float64)
    m[-1] = 0
    one = (lambda i: torch.eye(3, dtype=torch.float64)[i])
    pushed = stack_update_reference(st, m, one(0), torch.randn(d, dtype=torch.float64))
    restored = stack_update_reference(*pushed, one(1), torch.randn(d, dtype=torch.float64))
    torch.testing.assert_close(restored[0], st, rtol=0, atol=0)
    torch.testing.assert_close(restored[1], m, rtol=0, atol=0)
    kept = stack_update_reference(st, m, one(2), torch.randn(d, dtype=torch.float64))
    assert torch.equal(kept[0], st) and torch.equal(kept[1], m)


def test_single_slot_stack():
    st, m = torch.tensor([[3.0]], dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64)
    a = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    new, new_m = stack_update_reference(st, m, a, torch.tensor([2.0], dtype=torch.float64))
    torch.testing.assert_close(new, torch.tensor([[0.6 * 2 + 0.1 * 3]], dtype=torch.float64))
    torch.testing.assert_close(new_m, torch.tensor([0.6 + 0.1 * 0.5], dtype=torch.float64))


def _module(**kw):
    torch.manual_seed(0)
    return StackMemory(32, **dict(dict(stack_d_model=6, num_mem_heads=2, stack_slots=4, backend="reference"), **kw))


def test_zero_gate_or_up_projection_is_identity():
    m = _module()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        m.res_weight.zero_()
    torch.testing.assert_close(m(x).output, x, rtol=0, atol=0)
    m = _module()
    with torch.no_grad():
        m.up_proj.weight.zero_()
    torch.testing.assert_close(m(x).output, x, rtol=0, atol=0)


def test_depth_mode_is_token_independent():
    m = _module()
    x = torch.randn(2, 7, 32)
    perm = torch.randperm(7)
    out, _, state = m(x)
    out_p, _, state_p = m(x[:, perm])
    torch.testing.assert_close(out_p, out[:, perm])
    torch.testing.assert_close(state_p.stack, state.stack[:, perm])
    # decoding in depth mode: a new token alone gives what it gives inside the sequence
    last, _, _ = m(x[:, -1:])
    torch.testing.assert_close(last, out[:, -1:])


def test_temporal_mode_is_causal():
    m = _module(mode="temporal")
    x = torch.randn(2, 9, 32)
    y = m(x).output
    x2 = x.clone()
    x2[:, 5] += 3.0
    y2 = m(x2).output
    torch.testing.assert_close(y2[:, :5], y[:, :5], rtol=0, atol=0)
    assert not torch.allclose(y2[:, 5:], y[:, 5:])


def test_parameter_names_shapes_init_and_count():
    m = StackMemory(512)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes == {"action_head.weight": (12, 512), "down_proj.weight": (24, 512), "up_proj.weight": (512, 24),
                      "gate": (6,), "res_weight": ()}
    assert sum(p.numel() for p in m.parameters()) == 30_727  # the spec's count for D=512, H=4, d=6
    assert float(m.res_weight.detach()) == 1.0
    assert abs(float(m.down_proj.weight.detach().std()) - 0.02) < 2e-3
    with_bias = StackMemory(512, bias=True)
    assert sum(p.numel() for p in with_bias.parameters()) == 30_727 + 12 + 24 + 512
    assert float(with_bias.action_head.bias.detach().abs().sum()) == 0.0


# ----------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["depth", "temporal"])
@pytest.mark.parametrize("read_mode", ["soft", "released"])
def test_gradcheck_reference_float64(mode, read_mode):
    torch.manual_seed(1)
    B, T, D, H, d, S = 1, 3, 4, 2, 3, 4
    x = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)
    params = [torch.randn(3 * H, D, dtype=torch.float64), torch.randn(H * d, D, dtype=torch.float64),
              torch.randn(D, H * d, dtype=torch.float64), torch.randn(d, dtype=torch.float64),
              torch.tensor(0.7, dtype=torch.float64)]
    state = ([torch.randn(B, T, H, S, d, dtype=torch.float64), torch.rand(B, T, H, S, dtype=torch.float64)]
             if mode == "depth" else
             [torch.randn(B, H, S, d, dtype=torch.float64), torch.rand(B, H, S, dtype=torch.float64)])
    if read_mode == "released":
        # keep slot masks far apart: the 1e9 penalty makes the read a hard argmax,
        # differentiable only away from ties
        state[1] = torch.linspace(0.05, 0.95, S, dtype=torch.float64).expand_as(state[1]).clone()
    leaves = [t.requires_grad_() for t in params + state]
    keep = torch.tensor([[1, 0, 1]], dtype=torch.bool)

    def fn(x, *leaves):
        out = stack_memory_reference(x, *leaves[:5], leaves[5], leaves[6], keep, num_heads=H, num_slots=S,
                                     mode=mode, read_mode=read_mode, upcast=False)
        return out

    assert torch.autograd.gradcheck(fn, (x, *leaves), eps=1e-6, atol=1e-5)


def test_entropy_gradient_matches_the_spec_formula():
    z = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    a, h = stack_actions_reference(z)
    (dz,) = torch.autograd.grad(h.sum(), z)
    expected = -a * (torch.log(a) + h[:, None])
    torch.testing.assert_close(dz, expected.detach())


# ----------------------------------------------------------------------------
# Padding
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["depth", "temporal"])
def test_padding_contents_never_reach_kept_tokens(mode):
    m = _module(mode=mode)
    x = torch.randn(2, 6, 32)
    keep = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    x_nan = torch.where(keep[..., None], x, torch.full_like(x, float("nan")))
    x_big = torch.where(keep[..., None], x, torch.full_like(x, 1e4))
    y1, _, s1 = m(x_nan, attention_mask=keep)
    y2, _, s2 = m(x_big, attention_mask=keep)
    torch.testing.assert_close(y1[keep], y2[keep], rtol=0, atol=0)
    assert torch.isfinite(s1.entropy_sum) and torch.equal(s1.entropy_sum, s2.entropy_sum)
    y1.masked_fill(~keep[..., None], 0.0).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    # padded positions are no-ops: output = input, and (temporal) the stack is untouched
    torch.testing.assert_close(y2[~keep], x_big[~keep], rtol=0, atol=0)


def test_temporal_left_padding_equals_unpadded():
    m = _module(mode="temporal")
    x = torch.randn(1, 5, 32)
    padded = torch.cat([torch.randn(1, 3, 32), x], dim=1)
    keep = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(m(padded, attention_mask=keep).output[:, 3:], m(x).output)


# ----------------------------------------------------------------------------
# State from layer to layer, entropy loss, decoding cache
# ----------------------------------------------------------------------------


def test_state_threads_over_layers_like_the_spec_recurrence():
    layers = [_module() for _ in range(3)]
    for i, layer in enumerate(layers):
        torch.manual_seed(10 + i)
        layer.reset_parameters()
    x = torch.randn(2, 4, 32)
    keep = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    state = None
    stack = mask = None
    entropies = []
    for layer in layers:
        _, _, state = layer(x, keep, state=state)
        ref = stack_memory_reference(x, *layer._params()[:5], stack, mask, keep, num_heads=2, num_slots=4)
        _, stack, mask, ent = ref
        entropies.append(ent[keep])
        torch.testing.assert_close(state.stack, stack)
    assert state.num_layers == 3 and float(state.entropy_count) == 7 * 2 * 3
    expected = torch.cat(entropies).mean()
    torch.testing.assert_close(state.entropy_mean(), expected)
    torch.testing.assert_close(layers[0].aux_loss(state), 1e-3 * expected)


def test_entropy_loss_decreases_entropy_when_minimised():
    m = _module(stack_entropy_loss_weight=1.0)
    x = torch.randn(4, 6, 32)
    opt = torch.optim.SGD(m.parameters(), lr=5.0)
    first = None
    for _ in range(5):
        _, _, state = m(x)
        loss = m.aux_loss(state)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(m.aux_loss(m(x).state).detach()) < first


@pytest.mark.parametrize("read_mode", ["soft", "released"])
def test_temporal_prefill_then_steps_equals_full_forward(read_mode):
    m = _module(mode="temporal", read_mode=read_mode)
    x = torch.randn(2, 9, 32)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[0, :2] = False
    full = m(x, attention_mask=keep).output
    decoded, cache = prefill_then_decode(m, x, cache=m.empty_cache(2), prefill=4, attention_mask=keep)
    assert cache.length == 9
    torch.testing.assert_close(decoded, full, rtol=1e-6, atol=1e-6)


def test_two_branches_from_one_cache_are_independent():
    m = _module(mode="temporal")
    x = torch.randn(2, 6, 32)
    a, b = torch.randn(2, 1, 32), torch.randn(2, 1, 32)
    _, cache, _ = m(x, cache=m.empty_cache(2))
    before = cache.stack.clone(), cache.stack_mask.clone(), cache.length
    ya, cache_a, _ = m(a, cache=cache)
    yb, cache_b, _ = m(b, cache=cache)
    assert isinstance(cache_a, StackMemoryCache) and cache_a is not cache and cache_b is not cache
    assert torch.equal(cache.stack, before[0]) and torch.equal(cache.stack_mask, before[1])
    assert cache.length == before[2]
    torch.testing.assert_close(ya, m(torch.cat([x, a], 1)).output[:, -1:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(yb, m(torch.cat([x, b], 1)).output[:, -1:], rtol=1e-6, atol=1e-6)
    # and a third step continues branch a, not b
    c = torch.randn(2, 1, 32)
    yc, _, _ = m(c, cache=cache_a)
    torch.testing.assert_close(yc, m(torch.cat([x, a, c], 1)).output[:, -1:], rtol=1e-6, atol=1e-6)


def test_cache_reset_does_not_touch_sibling_caches():
    m = _module(mode="temporal")
    _, cache, _ = m(torch.randn(1, 4, 32), cache=m.empty_cache(1))
    _, child, _ = m(torch.randn(1, 1, 32), cache=cache)
    snapshot = child.stack.clone()
    cache.reset()
    assert cache.length == 0 and float(cache.stack.abs().sum()) == 0.0
    assert torch.equal(child.stack, snapshot)


def test_scan_reference_splits_exactly():
    torch.manual_seed(4)
    B, T, H, d, S = 2, 7, 3, 2, 5
    z, p, g = torch.randn(B, T, H, 3), torch.randn(B, T, H, d), torch.randn(d)
    read, ent, st, m = stack_scan_reference(z, p, g, num_slots=S)
    r1, e1, st1, m1 = stack_scan_reference(z[:, :3], p[:, :3], g, num_slots=S)
    r2, e2, st2, m2 = stack_scan_reference(z[:, 3:], p[:, 3:], g, None, st1, m1)
    torch.testing.assert_close(torch.cat([r1, r2], 1), read, rtol=0, atol=0)
    torch.testing.assert_close(st2, st, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_autocast_bf16_runs_and_returns_the_autocast_dtype(backend):
    m = _module(backend=backend)
    x = torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.nn.functional.linear(x, torch.eye(32))   # a bf16 activation, as inside a model
        out, _, state = m(h)
    assert out.dtype == torch.bfloat16 and state.stack.dtype == torch.float32
    torch.testing.assert_close(out.float(), m(h.float()).output, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------
# Named errors
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(stack_d_model=0), "stack_d_model"),
    (dict(num_mem_heads=-1), "num_mem_heads"),
    (dict(stack_slots=0), "stack_slots"),
    (dict(stack_d_model=10, num_mem_heads=4), "divisible"),
    (dict(stack_entropy_loss_weight=-1e-3), "stack_entropy_loss_weight"),
    (dict(stack_entropy_loss_weight=float("nan")), "stack_entropy_loss_weight"),
    (dict(mode="sequential"), "mode"),
    (dict(read_mode="hard"), "read_mode"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_config_raises_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        StackMemory(32, **kwargs)


def test_bad_inputs_raise_named_errors():
    m = _module()
    x = torch.randn(2, 5, 32)
    with pytest.raises(ShapeError, match="hidden_size=32"):
        m(torch.randn(2, 5, 16))
    with pytest.raises(ShapeError, match="3 dimensions"):
        m(torch.randn(5, 32))
    with pytest.raises(ShapeError, match="at least one token"):
        m(torch.randn(2, 0, 32))
    with pytest.raises(DTypeError, match="bfloat16"):
        m(x.bfloat16())
    with pytest.raises(DTypeError):
        m(torch.ones(2, 5, 32, dtype=torch.int32))
    with pytest.raises(ShapeError, match="attention_mask"):
        m(x, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(DTypeError, match="additive"):
        m(x, attention_mask=torch.zeros(2, 5).masked_fill(torch.rand(2, 5) > 0.5, float("-inf")))
    with pytest.raises(TypeError, match="state"):
        m(x, state=(torch.zeros(1),))


def test_state_from_another_configuration_raises():
    m = _module()
    x = torch.randn(2, 5, 32)
    _, _, state = _module(stack_slots=5)(x)
    with pytest.raises(ConfigError, match="another StackMemory configuration"):
        m(x, state=state)
    _, _, state = _module(mode="temporal")(x)
    with pytest.raises(ConfigError, match="another StackMemory configuration"):
        m(x, state=state)
    _, _, state = m(x)
    with pytest.raises(ShapeError, match="state.stack"):
        m(torch.randn(2, 4, 32), state=state)
    bad = StackMemoryState(state.config, state.stack.double().half(), state.stack_mask, state.entropy_sum,
                           state.entropy_count)
    with pytest.raises(DTypeError, match="state.stack"):
        m(x, state=bad)


def test_cache_misuse_raises():
    m = _module(mode="temporal")
    cache = m.empty_cache(2)
    with pytest.raises(ShapeError, match="batch"):
        m(torch.randn(3, 1, 32), cache=cache)
    with pytest.raises(ConfigError, match="another configuration"):
        m(torch.randn(2, 1, 32), cache=_module(mode="temporal", stack_slots=3).empty_cache(2))
    with pytest.raises(TypeError, match="StackMemoryCache"):
        m(torch.randn(2, 1, 32), cache={"stack": None})
    depth = _module()
    with pytest.raises(ConfigError, match="temporal"):
        depth(torch.randn(2, 1, 32), cache=cache)
    with pytest.raises(ConfigError, match="temporal"):
        depth.empty_cache(2)
    with pytest.raises(DTypeError, match="cache"):
        m(torch.randn(2, 1, 32), cache=m.empty_cache(2, dtype=torch.float64))
    with pytest.raises(DeviceError, match="cache"):
        m(torch.randn(2, 1, 32), cache=m.empty_cache(2, device="meta"))
    assert m(torch.randn(2, 3, 32)).cache is None          # cache=None: no decoding


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_device_mismatch_raises():
    m = _module()
    with pytest.raises(DeviceError):
        m(torch.randn(2, 5, 32, device="cuda"))


def test_device_mismatch_of_the_state_raises_on_meta():
    m = _module()
    x = torch.randn(2, 5, 32)
    _, _, state = m(x)
    moved = StackMemoryState(state.config, state.stack.to("meta"), state.stack_mask.to("meta"),
                             state.entropy_sum, state.entropy_count)
    with pytest.raises(DeviceError, match="state.stack"):
        m(x, state=moved)
    with pytest.raises(DeviceError, match="attention_mask"):
        m(x, attention_mask=torch.ones(2, 5, dtype=torch.bool, device="meta"))


def test_float64_module_keeps_float64():
    m = _module().double()
    out, _, state = m(torch.randn(2, 3, 32, dtype=torch.float64))
    assert out.dtype == torch.float64 and state.stack.dtype == torch.float64
    _, _, state2 = m(torch.randn(2, 3, 32, dtype=torch.float64), state=state)
    assert state2.num_layers == 2


def test_action_temperature_is_sqrt_of_hidden_per_head():
    m = _module()
    x = torch.randn(1, 3, 32)
    _, _, state = m(x)
    logits = torch.nn.functional.linear(x, m.action_head.weight).view(1, 3, 2, 3) / math.sqrt(32 / 2)
    _, entropy = stack_actions_reference(logits)
    torch.testing.assert_close(state.entropy_sum, entropy.sum())
