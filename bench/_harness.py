"""Shared benchmark machinery: three providers (eager reference, compiled
reference, Triton op), two modes (forward, forward+backward), peak memory.

Each ``bench/test_X.py`` lists shapes and an input builder and calls
:func:`run_benchmark`. The references are the same functions the tests use as
oracles, so baselines and tests never drift apart. On CPU the Triton interpreter
is not benchmarked (it is a correctness tool): the "triton" provider is skipped.
"""
from __future__ import annotations

import functools
from typing import Callable, Mapping, Sequence

import pytest
import torch

PROVIDERS = ("eager", "compiled", "triton")
MODES = ("fwd", "fwd+bwd")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
                  flops: float | None = None, bytes_moved: float | None = None) -> None:
    if provider == "triton" and DEVICE.type != "cuda":
        pytest.skip("the Triton interpreter is not benchmarked; run on a CUDA device")
    fn = {"eager": reference, "compiled": _compiled(reference), "triton": op}[provider]
    inp = _materialise(inputs, grad_names)
    outs = fn(**inp)
    outs = outs if isinstance(outs, tuple) else (outs,)
    upstream = [torch.randn_like(o) for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    _step(fn, inp, grad_names, mode, upstream)  # warm-up: compilation, autotune, allocator
    _sync()
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(fn, inp, grad_names, mode, upstream)
        _sync()
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak_mb = None

    def target():
        _step(fn, inp, grad_names, mode, upstream)
        _sync()

    benchmark.extra_info.update(dict(mechanism=name, provider=provider, mode=mode, shape=shape,
                                     device=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
                                     torch=torch.__version__, peak_mem_mb=peak_mb, flops=flops,
                                     bytes_moved=bytes_moved))
    benchmark.pedantic(target, rounds=5 if DEVICE.type == "cpu" else 50, iterations=1, warmup_rounds=1)
