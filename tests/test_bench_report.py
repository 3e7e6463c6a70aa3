"""The benchmark report's arithmetic: per-mode work counts, TFLOP/s and GB/s, the
comparison with SDPA on the same shape, merging runs, and the adaptive round count."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from bench._harness import by_mode, for_mode, rounds_for  # noqa: E402


def _row(mechanism, provider, ms, mode="fwd", shape="S", **counts):
    return dict(mechanism=mechanism, provider=provider, mode=mode, shape=shape, median_ms=ms,
                device="NVIDIA H200", **counts)


def test_rates_against_sdpa_and_the_roofline():
    rows = [_row(report.SDPA, "eager", 10.0, flops=4e12), _row("derf", "triton", 20.0, flops=4e12),
            _row("derf", "eager", 80.0, flops=4e12), _row("derf", "compiled", 40.0, flops=4e12),
            _row("laurel", "triton", 2.0, shape="N", bytes_moved=4.3e9)]
    by = {r["mechanism"]: r for r in report.rates(rows)}
    derf = by["derf"]
    assert derf["tflops"] == pytest.approx(200.0) and derf["of_sdpa"] == pytest.approx(0.5)
    assert derf["vs_eager"] == pytest.approx(4.0) and derf["vs_compiled"] == pytest.approx(2.0)
    assert derf["of_roofline"] == pytest.approx(200e12 / 790e12)
    assert by["laurel"]["gbs"] == pytest.approx(2150.0) and by["laurel"]["of_roofline"] == pytest.approx(0.5)
    assert by[report.SDPA]["of_sdpa"] is None and by[report.SDPA]["tflops"] == pytest.approx(400.0)
    assert "| derf | S | fwd | 80.000 | 40.000 | 20.000 | 4.00x | 2.00x | 200.0 |" in report.table(rows)


def test_sdpa_is_compared_on_the_same_shape_and_mode_only():
    rows = [_row(report.SDPA, "eager", 10.0, flops=1e12, shape="A"),
            _row("elo", "triton", 10.0, flops=1e12, shape="B"),
            _row("elo", "triton", 10.0, flops=1e12, shape="A", mode="fwd+bwd")]
    assert all(r["of_sdpa"] is None for r in report.rates(rows) if r["mechanism"] == "elo")


def test_a_bare_count_is_the_forwards_and_runs_merge(tmp_path):
    assert for_mode(5.0, "fwd") == 5.0 and for_mode(5.0, "fwd+bwd") is None
    assert for_mode(by_mode(1, 3.5), "fwd+bwd") == 3.5 and for_mode(None, "fwd") is None
    files = []
    for i, (provider, ms) in enumerate((("triton", 1.0), ("eager", 3.0))):
        bench = {"benchmarks": [{"extra_info": dict(mechanism="x", provider=provider, mode="fwd", shape="s"),
                                 "stats": {"median": ms / 1e3}}]}
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(bench))
    _, rows = report.load(*map(str, files))
    assert report.rates(rows)[0]["vs_eager"] == pytest.approx(3.0)


def test_rounds_fit_half_a_second_on_gpu():
    assert rounds_for(0.1, "cuda") == 5 and rounds_for(1e-4, "cuda") == 50 and rounds_for(0.02, "cuda") == 25
    assert rounds_for(1e-4, "cpu") == 5
