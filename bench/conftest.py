"""Benchmarks: ``pytest bench --benchmark-json=bench/results/latest.json`` then
``python bench/report.py bench/results/latest.json``.

A run stopped with SIGINT (``scripts/gpu_check.sh`` stops each run at its time budget)
still writes its JSON: a benchmark interrupted before its first timed round has no
statistics, and pytest-benchmark fails on it while writing the file (losing every
other result), so such benchmarks are dropped first. An interrupted benchmark with
at least one round is kept, with the rounds it ran."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.backends.cuda.matmul.allow_tf32 = True  # benchmark what users run


@pytest.hookimpl(tryfirst=True)
def pytest_benchmark_generate_json(config, benchmarks, include_data, machine_info, commit_info):
    from pytest_benchmark.plugin import pytest_benchmark_generate_json as generate

    timed = [b for b in benchmarks if b]   # a benchmark is falsy until its first round is recorded
    return generate(config=config, benchmarks=timed, include_data=include_data, machine_info=machine_info,
                    commit_info=commit_info)
