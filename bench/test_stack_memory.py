import importlib

import pytest
import torch

from laminae.primitives.stack_memory import stack_memory_reference
from laminae.triton_ops.stack_memory import stack_memory

from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

kernels = importlib.import_module("laminae.triton_ops.stack_memory")

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
# Goal hidden size with NeoLLM's per-head stack (6 wide, 16 slots) on 8 memory heads:
# B·H = 64 sequences of the temporal scan at B = 8; (batch, seq)
HIDDEN, HEADS, HEAD_DIM, SLOTS = 1024, 8, 6, 16
SHAPES = [(1, 512), (4, 2048), (8, 2048)]


def _inputs(batch, seq, mode):
    gen = torch.Generator().manual_seed(0)
    lead = (batch, seq, HEADS) if mode == "depth" else (batch, HEADS)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)

    return {
        "x": randn(batch, seq, HIDDEN).to(DTYPE),
        "action_weight": randn(3 * HEADS, HIDDEN, scale=0.02),
        "down_weight": randn(HEADS * HEAD_DIM, HIDDEN, scale=0.02),
        "up_weight": randn(HIDDEN, HEADS * HEAD_DIM, scale=0.02),
        "gate": randn(HEAD_DIM, scale=0.02),
        "res_weight": torch.ones((), device=DEVICE),
        # a layer past the first: a non-zero incoming state
        "stack": randn(*lead, SLOTS, HEAD_DIM),
        "stack_mask": torch.rand(*lead, SLOTS, generator=gen).to(DEVICE),
        "num_heads": HEADS, "num_slots": SLOTS, "mode": mode,
    }


def serial_steps(provider: str, stack_mode: str, seq: int) -> dict:
    """Dependent steps on the critical path per mode: depth mode has none over tokens;
    the references (and the token-serial scan this kernel replaced) take one per token
    forward and one per token backward; the chunked scan its chunk loops and combine."""
    if stack_mode == "depth":
        return by_mode(1, 2)
    if provider == "triton":
        steps = kernels.scan_serial_steps(seq)
        return by_mode(steps["fwd"], steps["fwd"] + steps["bwd"])
    return by_mode(seq, 2 * seq)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-T{}".format(*s))
@pytest.mark.parametrize("stack_mode", ["depth", "temporal"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_stack_memory(benchmark, provider, mode, stack_mode, shape):
    batch, seq = shape
    if stack_mode == "temporal" and provider == "compiled":
        pytest.skip("torch.compile unrolls the reference's Python loop over tokens")
    if DEVICE.type == "cpu" and batch * seq > 2048:
        pytest.skip("the CPU reference at this size takes minutes")
    inputs = _inputs(batch, seq, stack_mode)
    grads = ["x", "action_weight", "down_weight", "up_weight", "gate", "res_weight", "stack", "stack_mask"]
    rows = batch * seq * HEADS
    state = SLOTS * (HEAD_DIM + 1) * 4
    # memory-bound: x and out once, the state in and out (depth), read and entropy
    per_row_state = 2 * state if stack_mode == "depth" else 0
    bytes_moved = 2 * batch * seq * HIDDEN * inputs["x"].element_size() + rows * (per_row_state + 4 * (HEAD_DIM + 4))
    run_benchmark(benchmark, name=f"stack_memory_{stack_mode}", provider=provider, mode=mode, op=stack_memory,
                  reference=stack_memory_reference, inputs=inputs, grad_names=grads,
                  shape=f"B={batch},T={seq},D={HIDDEN},H={HEADS},d={HEAD_DIM},S={SLOTS}", bytes_moved=bytes_moved)
    benchmark.extra_info["serial_steps"] = serial_steps(provider, stack_mode, seq)[mode]
