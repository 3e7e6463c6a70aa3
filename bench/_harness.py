"""Shared benchmark machinery: three providers (eager reference, compiled
reference, Triton op), two modes (forward, forward+backward), peak memory.

Each ``bench/test_X.py`` lists shapes and an input builder and calls
:func:`run_benchmark`. The references are the same functions the tests use as
oracles, so baselines and tests never drift apart. On CPU the Triton interpreter
is not benchmarked (it is a correctness tool): the "triton" provider is skipped.

Work counts, per mode (``{"fwd": x, "fwd+bwd": y}``; a bare number is the forward's
and leaves fwd+bwd unrated):

- ``flops``: 2 per multiply-add of every matmul the mechanism needs (recomputation
  inside a backward counts, as FlashAttention counts it: attention's fwd+bwd is 3.5×
  its forward).
- ``bytes_moved``: compulsory traffic: every input read once, every output and
  gradient written once, at the benchmark's dtype. GB/s from it is the fraction of
  bandwidth a perfectly fused kernel would reach, not what the caches saw.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Mapping, Sequence, Union

import pytest
import torch

PROVIDERS = ("eager", "compiled", "triton")
MODES = ("fwd", "fwd+bwd")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


PerMode = Union[float, Mapping[str, float], None]


def by_mode(fwd: float, fwd_bwd: float) -> dict:
    return {"fwd": float(fwd), "fwd+bwd": float(fwd_bwd)}


def for_mode(count: PerMode, mode: str) -> float | None:
    """The count of ``mode``: a bare number is the forward's only."""
    if count is None:
        return None
    if isinstance(count, Mapping):
        return count.get(mode)
    return float(count) if mode == "fwd" else None


def rounds_for(seconds_per_call: float, device_type: str) -> int:
    """Timed rounds: about half a second of work per case on GPU (so the whole bench
    fits a short lease), at least 5 and at most 50 rounds."""
    if device_type != "cuda":
        return 5
    return int(min(50, max(5, 0.5 / max(seconds_per_call, 1e-6))))


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def _materialise(inputs: Mapping[str, object], grad_names: Sequence[str]) -> dict:
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.detach().clone().requires_grad_(k in grad_names)
        out[k] = v
    return out


def _step(fn: Callable, inputs: dict, grad_names: Sequence[str], mode: str, upstream):
    outs = fn(**inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if mode == "fwd":
        return outs
    diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    leaves = [inputs[k] for k in grad_names]
    return torch.autograd.grad(diff, leaves, upstream[: len(diff)], allow_unused=True)


def run_benchmark(benchmark, *, name: str, provider: str, mode: str, op: Callable, reference: Callable,
                  inputs: Mapping[str, object], grad_names: Sequence[str], shape: str,
                  flops: PerMode = None, bytes_moved: PerMode = None) -> None:
    if provider == "triton" and DEVICE.type != "cuda":
        pytest.skip("the Triton interpreter is not benchmarked; run on a CUDA device")
    fn = {"eager": reference, "compiled": _compiled(reference), "triton": op}[provider]
    inp = _materialise(inputs, grad_names)
    outs = fn(**inp)
    outs = outs if isinstance(outs, tuple) else (outs,)
    upstream = [torch.randn_like(o) for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    _step(fn, inp, grad_names, mode, upstream)  # warm-up: compilation, autotune, allocator
    _sync()
    t0 = time.perf_counter()
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(fn, inp, grad_names, mode, upstream)
        _sync()
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak_mb = None
    once = time.perf_counter() - t0

    def target():
        _step(fn, inp, grad_names, mode, upstream)
        _sync()

    benchmark.extra_info.update(dict(mechanism=name, provider=provider, mode=mode, shape=shape,
                                     device=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
                                     torch=torch.__version__, peak_mem_mb=peak_mb, flops=for_mode(flops, mode),
                                     bytes_moved=for_mode(bytes_moved, mode),
                                     dtype=str(next((v.dtype for v in inp.values() if isinstance(v, torch.Tensor)
                                                     and v.is_floating_point()), "")).replace("torch.", "")))
    benchmark.pedantic(target, rounds=rounds_for(once, DEVICE.type), iterations=1, warmup_rounds=1)
