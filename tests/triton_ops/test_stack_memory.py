import importlib
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from laminae.primitives import BackendUnavailableError, ConfigError, DTypeError
from laminae.primitives.stack_memory import (StackMemory, stack_memory_reference, stack_scan_reference,
                                             stack_step_reference)
from laminae.triton_ops.stack_memory import (_stack_scan_op, _stack_step_op, stack_memory, stack_scan, stack_step,
                                             supports)

from .._helpers import DEVICE, assert_parity, keep_mask, scales, seeds

kernels = importlib.import_module("laminae.triton_ops.stack_memory")

read_modes = st.sampled_from(["soft", "released"])
# (S, d): non-powers of two, the single slot, and the NeoLLM (16, 6) and paper (24, 16) sizes
sizes = st.sampled_from([(1, 1), (3, 5), (4, 3), (7, 2), (16, 6), (24, 16), (9, 8)])


def _state_inputs(B, T, H, S, d, scale, seed, *, masked, temporal=False):
    gen = torch.Generator().manual_seed(seed)
    lead = (B, H) if temporal else (B, T, H)
    inp = {
        "logits": (torch.randn(B, T, H, 3, generator=gen) * scale).to(DEVICE),
        "push": (torch.randn(B, T, H, d, generator=gen) * scale).to(DEVICE),
        "gate": torch.randn(d, generator=gen).to(DEVICE),
        "stack" if not temporal else "initial_stack": torch.randn(*lead, S, d, generator=gen).to(DEVICE),
        "stack_mask" if not temporal else "initial_mask": torch.rand(*lead, S, generator=gen).to(DEVICE),
    }
    if masked:
        inp["attention_mask"] = keep_mask(B, T, gen)
    return inp


@given(batch=st.integers(1, 3), length=st.integers(1, 6), heads=st.integers(1, 3), size=sizes,
       read_mode=read_modes, masked=st.booleans(), scale=scales, seed=seeds)
def test_step_kernel_matches_reference_fp32(batch, length, heads, size, read_mode, masked, scale, seed):
    S, d = size
    inp = _state_inputs(batch, length, heads, S, d, scale, seed, masked=masked)
    inp["read_mode"] = read_mode
    grads = ["logits", "push", "gate", "stack", "stack_mask"]
    assert_parity(stack_step, stack_step_reference, inp, grads,
                  output_names=["read", "new_stack", "new_mask", "entropy"])


SCAN_GRADS = ["logits", "push", "gate", "initial_stack", "initial_mask"]
SCAN_OUTPUTS = ["read", "entropy", "final_stack", "final_mask"]


# Chunks of 1–3 tokens put every chunk boundary of the scan into short sequences:
# T < chunk, T a multiple of it, and T over several chunks with a ragged last one.
@given(batch=st.integers(1, 2), length=st.integers(1, 7), heads=st.integers(1, 2), size=sizes,
       read_mode=read_modes, masked=st.booleans(), chunk=st.sampled_from([1, 2, 3, kernels.SCAN_CHUNK]),
       scale=scales, seed=seeds)
def test_scan_kernel_matches_reference_fp32(batch, length, heads, size, read_mode, masked, chunk, scale, seed):
    S, d = size
    inp = _state_inputs(batch, length, heads, S, d, scale, seed, masked=masked, temporal=True)
    inp["read_mode"] = read_mode
    with mock.patch.object(kernels, "SCAN_CHUNK", chunk):
        assert_parity(stack_scan, stack_scan_reference, inp, SCAN_GRADS, output_names=SCAN_OUTPUTS)


def _scan_configurations():
    """(BLOCK_S, BLOCK_W, num_warps) of every temporal-scan kernel the static cases
    declare: what the CUDA path can launch."""
    return sorted({(c.constexprs["BLOCK_S"], c.constexprs["BLOCK_W"], c.num_warps) for c in kernels.static_cases()
                   if c.name.startswith("stack_scan")})


@pytest.mark.parametrize("config, chunk", [(c, 2 + i % 2) for i, c in enumerate(_scan_configurations())],
                         ids=lambda v: "S{}-W{}-warps{}".format(*v) if isinstance(v, tuple) else f"chunk{v}")
def test_scan_every_launch_configuration(config, chunk):
    # the fullest state the launcher maps to this configuration: the most slots, then
    # the widest head, so the bottom slot and the mask column sit at the tile's edge
    # where they can
    S, d = max(((s, d) for s in range(1, 33) for d in range(1, 65)
                if kernels.supports(s, d, "temporal") and kernels._scan_config(s, d) == config))
    inp = _state_inputs(2, 5, 1, S, d, 1.0, sum(config), masked=False, temporal=True)
    # chunks of 2 ([0, 2) [2, 4) [4]) or 3 ([0, 3) [3, 5)): holes at t = 0, on both
    # sides of every boundary, a wholly padded chunk or a padded last token
    inp["attention_mask"] = torch.tensor([[0, 1, 0, 0, 1], [1, 0, 1, 1, 0]], dtype=torch.bool, device=DEVICE)
    inp["read_mode"] = "released" if config[1] == 32 else "soft"
    with mock.patch.object(kernels, "SCAN_CHUNK", chunk):
        assert_parity(stack_scan, stack_scan_reference, inp, SCAN_GRADS, output_names=SCAN_OUTPUTS)


def test_scan_released_read_at_a_tie():
    # A full stack that dropped tokens leave as it is: every penalty 10⁹·(1 − M) is 0,
    # the released read is the gate's softmax and the mask gradient is 10⁹·dscore
    # (elsewhere dscore vanishes: one slot takes the whole read).
    inp = _state_inputs(1, 2, 2, 5, 3, 1.0, 0, masked=False, temporal=True)
    inp["initial_mask"] = torch.ones_like(inp["initial_mask"])
    inp["attention_mask"] = torch.zeros(1, 2, dtype=torch.bool, device=DEVICE)
    inp["read_mode"] = "released"
    with mock.patch.object(kernels, "SCAN_CHUNK", 1):
        assert_parity(stack_scan, stack_scan_reference, inp, SCAN_GRADS, output_names=SCAN_OUTPUTS)
    mask = inp["initial_mask"].clone().requires_grad_()
    read = stack_scan_reference(**dict(inp, initial_mask=mask))[0]
    (d_mask,) = torch.autograd.grad(read.square().sum(), [mask])
    assert float(d_mask.abs().max()) > 1e6      # the case really is at a tie


def test_scan_serial_steps_at_the_goal_shape():
    # T = 2048: 64 (chunk summaries) + 31 (combine) + 64 (expansion), against 2,048
    # steps of the token-serial scan forward and 4,096 backward (rerun + reverse)
    steps = kernels.scan_serial_steps(2048)
    assert steps == {"fwd": 159, "bwd": 159}
    assert 2048 / steps["fwd"] >= 10 and 4096 / steps["bwd"] >= 10


def _layer_inputs(B, T, D, H, d, S, mode, seed, masked, bias, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    lead = (B, T, H) if mode == "depth" else (B, H)
    inp = {
        "x": (torch.randn(B, T, D, generator=gen) * scale).to(DEVICE),
        "action_weight": (torch.randn(3 * H, D, generator=gen) / D**0.5 * 3).to(DEVICE),
        "down_weight": (torch.randn(H * d, D, generator=gen) / D**0.5).to(DEVICE),
        "up_weight": (torch.randn(D, H * d, generator=gen) / (H * d) ** 0.5).to(DEVICE),
        "gate": torch.randn(d, generator=gen).to(DEVICE),
        "res_weight": torch.tensor(0.9).to(DEVICE),
        "stack": torch.randn(*lead, S, d, generator=gen).to(DEVICE),
        "stack_mask": torch.rand(*lead, S, generator=gen).to(DEVICE),
    }
    if bias:
        inp["action_bias"] = torch.randn(3 * H, generator=gen).to(DEVICE)
        inp["down_bias"] = torch.randn(H * d, generator=gen).to(DEVICE)
        inp["up_bias"] = torch.randn(D, generator=gen).to(DEVICE)
    grads = [k for k in inp]
    if masked:
        inp["attention_mask"] = keep_mask(B, T, gen)
    inp.update(num_heads=H, num_slots=S, mode=mode)
    return inp, grads


@given(length=st.integers(1, 5), hidden=st.sampled_from([8, 20, 33]), heads=st.integers(1, 3),
       size=sizes, mode=st.sampled_from(["depth", "temporal"]), masked=st.booleans(), bias=st.booleans(),
       scale=scales, seed=seeds)
def test_layer_matches_reference_fp32_all_gradients(length, hidden, heads, size, mode, masked, bias, scale, seed):
    S, d = size
    inp, grads = _layer_inputs(2, length, hidden, heads, d, S, mode, seed, masked, bias, scale)
    assert_parity(stack_memory, stack_memory_reference, inp, grads,
                  output_names=["out", "new_stack", "new_mask", "entropy"])


def test_module_backends_agree_with_nan_padding_and_state_over_layers():
    torch.manual_seed(0)
    layers = [StackMemory(24, stack_d_model=6, num_mem_heads=2, stack_slots=5).to(DEVICE) for _ in range(2)]
    x = torch.randn(2, 6, 24, device=DEVICE)
    keep = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 1]], dtype=torch.bool, device=DEVICE)
    x = torch.where(keep[..., None], x, torch.full_like(x, float("nan"))).requires_grad_()
    results = []
    for backend in ("reference", "triton"):
        state, h = None, x
        for layer in layers:
            layer.backend = backend
            h, _, state = layer(h, keep, state=state)
        loss = h.masked_fill(~keep[..., None], 0).square().sum() + layers[0].aux_loss(state)
        params = [p for layer in layers for p in layer.parameters()]
        results.append((h[keep], loss, torch.autograd.grad(loss, [x, *params])))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    for a, b in zip(results[0][2], results[1][2]):
        assert torch.isfinite(b[keep] if b.shape[:2] == keep.shape else b).all()
        torch.testing.assert_close(torch.nan_to_num(a), torch.nan_to_num(b), atol=1e-4, rtol=1e-4)


def test_temporal_decoding_with_triton_equals_full_forward():
    torch.manual_seed(1)
    m = StackMemory(16, stack_d_model=8, num_mem_heads=2, stack_slots=6, mode="temporal", backend="triton").to(DEVICE)
    x = torch.randn(2, 7, 16, device=DEVICE)
    full = m(x).output
    y, cache, _ = m(x[:, :3], cache=m.empty_cache(2))
    outs = [y]
    for t in range(3, 7):
        y, cache, _ = m(x[:, t:t + 1], cache=cache)
        outs.append(y)
    diff = (torch.cat(outs, 1) - full).abs().max()
    assert float(diff.detach()) < 1e-5, diff


def test_unsupported_sizes_and_dtypes_raise():
    assert supports(16, 6) and supports(24, 16) and not supports(64, 16)
    assert supports(33, 8) and supports(32, 8, "temporal") and not supports(33, 8, "temporal")
    inp, _ = _layer_inputs(1, 2, 8, 1, 16, 64, "depth", 0, False, False)
    with pytest.raises(ConfigError, match="backend='reference'"):
        stack_memory(**inp)
    inp, _ = _layer_inputs(1, 2, 8, 1, 8, 33, "temporal", 0, False, False)
    with pytest.raises(ConfigError, match="at most 32 stack slots"):
        stack_memory(**inp)
    inp, _ = _layer_inputs(1, 2, 8, 1, 2, 3, "depth", 0, False, False)
    inp["x"] = inp["x"].double()
    with pytest.raises(DTypeError):
        stack_memory(**inp)


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    if DEVICE.type == "cuda":
        pytest.skip("CPU-only behaviour")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = StackMemory(8, stack_d_model=4, num_mem_heads=2, stack_slots=3, backend="triton")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        m(torch.randn(1, 2, 8))


def _op_args(temporal):
    gen = torch.Generator().manual_seed(0)
    N, H, S, D = 3, 2, 5, 3
    z = torch.randn(N, 4, H, 3, generator=gen) if temporal else torch.randn(N, H, 3, generator=gen)
    p = torch.randn(N, 4, H, D, generator=gen) if temporal else torch.randn(N, H, D, generator=gen)
    st = torch.randn(N, H, S, D, generator=gen)
    m = torch.rand(N, H, S, generator=gen)
    g = torch.randn(D, generator=gen)
    keep = torch.ones(N * 4 if temporal else N)
    leaves = [t.to(DEVICE).requires_grad_() for t in (z, p, st, m, g)]
    z, p, st, m, g = leaves
    if temporal:   # two chunks of two tokens
        return (z, p, g, keep.to(DEVICE), st, m, False, 2)
    return (z, p, st, m, g, keep.to(DEVICE), False)


@pytest.mark.parametrize("temporal", [False, True])
def test_opcheck_schema_and_autograd_registration(temporal):
    op = _stack_scan_op if temporal else _stack_step_op
    # The fake-tensor and AOT checks would execute the interpreter on meta tensors;
    # they run in the GPU-marked test below.
    torch.library.opcheck(op, _op_args(temporal), test_utils=("test_schema", "test_autograd_registration"))


@pytest.mark.gpu
@pytest.mark.parametrize("temporal", [False, True])
def test_opcheck_full_gpu(temporal):
    op = _stack_scan_op if temporal else _stack_step_op
    torch.library.opcheck(op, _op_args(temporal))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["depth", "temporal"])
def test_layer_matches_reference_low_precision(dtype, mode):
    inp, grads = _layer_inputs(4, 128, 512, 4, 6, 16, mode, 0, True, False)
    inp["x"] = inp["x"].to(dtype)
    assert_parity(stack_memory, stack_memory_reference, inp, grads, dtype=dtype,
                  output_names=["out", "new_stack", "new_mask", "entropy"])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["depth", "temporal"])
def test_compile_fullgraph_smoke(mode):
    m = StackMemory(512, mode=mode).cuda()
    x = torch.randn(2, 64, 512, device="cuda", requires_grad=True)
    compiled = torch.compile(m, fullgraph=True)
    out, _, state = compiled(x)
    (out.sum() + m.aux_loss(state)).backward()
    torch.testing.assert_close(out, m(x).output)


@pytest.mark.gpu
def test_cuda_autocast_bf16():
    m = StackMemory(512).cuda()
    x = torch.randn(2, 64, 512, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _, state = m(torch.nn.functional.linear(x, torch.eye(512, device="cuda")))
    assert out.dtype == torch.bfloat16 and state.stack.dtype == torch.float32
