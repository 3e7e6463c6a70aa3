"""Fused tier matmul vs the reference (combine the block, then F.linear), eager and
compiled, at ShellElastic's default sizes (D = 640, h = 2560, V = 50432, S = 6..10).

Besides time, the reference's memory cost is the materialised tier weight: its
forward writes a·init, b·delta, their sum and σ·W_τ ([R, C] each) and keeps W_τ
(and σ·W_τ) alive for backward; the fused op writes none of them and saves only
``x``. ``test_saved_for_backward_bytes`` measures the saved part on any device.
"""
import pytest
import torch

from laminae.primitives.shared_matrix import shared_matrix_reference
from laminae.triton_ops.shared_matrix import shared_matrix

from ._harness import DEVICE, MODES, PROVIDERS, by_mode, run_benchmark

# (tokens, out_features, in_features, rows, cols, ratio, learned scale)
GPU_SHAPES = [
    (16384, 1024, 1024, 1024, 1024, 10.0, False),   # goal shape: hidden 1024, 16k tokens (cuBLAS path)
    (512, 1024, 1024, 1024, 1024, 10.0, False),     # a short prompt: the fused kernels
    (8192, 640, 640, 640, 640, 10.0, False),        # attn.q_proj, Max tier
    (8192, 640, 2560, 384, 1536, 6.0, False),       # mlp.down_proj, Low tier
    (8192, 50432, 640, 50432, 640, 10.0, True),     # lm_head, Max tier
    (8, 50432, 640, 50432, 384, 6.0, True),         # lm_head, Low tier, decoding 8 sequences
]
CPU_SHAPES = [
    (512, 640, 640, 640, 640, 10.0, False),
    (512, 640, 2560, 384, 1536, 6.0, False),
    (8, 50432, 640, 50432, 384, 6.0, True),
]
SHAPES = GPU_SHAPES if DEVICE.type == "cuda" else CPU_SHAPES
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


def _inputs(tokens, out_features, in_features, rows, cols, ratio, scaled, dtype=DTYPE):
    inp = {
        "x": torch.randn(tokens, cols, device=DEVICE, dtype=dtype),
        "weight": torch.randn(out_features, in_features, device=DEVICE, dtype=dtype) * in_features ** -0.5,
        "delta": torch.randn(out_features, in_features, device=DEVICE, dtype=dtype) * 1e-2,
        "rows": rows, "cols": cols, "ratio": ratio,
    }
    if scaled:
        inp["scale"] = torch.tensor([1.3], device=DEVICE, dtype=dtype)
    return inp


def _label(shape):
    tokens, out_features, in_features, rows, cols, ratio, scaled = shape
    return f"M={tokens},W={out_features}x{in_features},blk={rows}x{cols},r={ratio:g}" + (",scale" if scaled else "")


@pytest.mark.parametrize("shape", SHAPES, ids=_label)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_shared_matrix(benchmark, provider, mode, shape):
    inputs = _inputs(*shape)
    tokens, _, _, rows, cols, _, scaled = shape
    grads = ["x", "delta"] + (["scale"] if scaled else [])  # init frozen, as in the paper
    flops = by_mode(2 * tokens * rows * cols, 6 * tokens * rows * cols)
    # compulsory traffic: forward x, y and the init and delta blocks; dx dy, dx and the
    # blocks; dW dy, x and the d delta block (the cuBLAS path adds the [R, C] tier weight)
    size = DTYPE.itemsize
    fwd = size * (tokens * cols + tokens * rows + 2 * rows * cols)
    bwd = size * (2 * tokens * (rows + cols) + 3 * rows * cols)
    run_benchmark(benchmark, name="shared_matrix", provider=provider, mode=mode, op=shared_matrix,
                  reference=shared_matrix_reference, inputs=inputs, grad_names=grads, shape=_label(shape),
                  flops=flops, bytes_moved=by_mode(fwd, fwd + bwd))


def _saved_bytes(fn, inputs, grads) -> int:
    """Bytes autograd keeps for backward that are not parameter storage already alive."""
    leaves = {k: (v.detach().clone().requires_grad_(k in grads) if isinstance(v, torch.Tensor) else v)
              for k, v in inputs.items()}
    params = {leaves[k].untyped_storage().data_ptr() for k in ("weight", "delta", "scale") if k in leaves}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(**leaves)
    return sum(seen.values())


@pytest.mark.parametrize("shape", [(8, 50432, 640, 50432, 640, 10.0, True)], ids=_label)
def test_saved_for_backward_bytes(shape):
    if DEVICE.type != "cuda":
        pytest.skip("the fused op runs compiled on CUDA; on CPU the figure is in docs/mechanisms/shared_matrix.md")
    inputs = _inputs(*shape)
    grads = ["x", "delta", "scale"]
    ref, fused = _saved_bytes(shared_matrix_reference, inputs, grads), _saved_bytes(shared_matrix, inputs, grads)
    print(f"saved for backward at {_label(shape)}: reference {ref / 2**20:.1f} MiB, fused {fused / 2**20:.3f} MiB")
    assert fused < ref
