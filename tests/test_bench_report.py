"""The benchmark report's arithmetic: per-mode work counts, TFLOP/s and GB/s, the
comparison with SDPA on the same shape, merging runs, and the adaptive round count;
a readable chart; a run stopped by SIGINT keeping its JSON; `make bench BENCH=...`."""
import json
import shutil
import os
import subprocess
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


def test_a_run_stopped_by_sigint_still_writes_its_json(tmp_path):
    # the benchmarks' own conftest, next to a benchmark that SIGINTs itself in its first timed round
    (tmp_path / "conftest.py").write_text((ROOT / "bench" / "conftest.py").read_text())
    (tmp_path / "test_stop.py").write_text(
        "import os, signal\n"
        "def test_done(benchmark):\n"
        "    benchmark.pedantic(lambda: None, rounds=3, iterations=1)\n"
        "def test_stopped(benchmark):\n"
        "    benchmark.pedantic(lambda: os.kill(os.getpid(), signal.SIGINT), rounds=3, iterations=1)\n")
    out = tmp_path / "bench.json"
    # a child of a pytest-xdist worker inherits PYTEST_XDIST_WORKER, which makes
    # pytest-benchmark believe it runs under xdist and disable every benchmark
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(tmp_path / "test_stop.py"), f"--benchmark-json={out}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert "KeyboardInterrupt" in done.stdout + done.stderr
    assert out.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    saved = json.loads(out.read_text())["benchmarks"]
    assert [b["name"] for b in saved] == ["test_done"] and len(saved[0]["stats"]["data"]) == 3


def test_make_bench_takes_a_subset():
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    dry = subprocess.run([make, "-n", "bench", "BENCH=derf and not compiled"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert '-m pytest -q bench -k "derf and not compiled"' in dry.stdout, dry.stdout


def test_chart_labels_never_overlap(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    rows = [_row(mech, provider, 0.1 + i, mode=mode, shape=shape)
            for i, (mech, shape) in enumerate([("derf_attention", "B4-S2048-H8-KV8-D64"),
                                               ("derf_attention", "B2-S4096-H16-KV16-D128"),
                                               ("shared_matrix", "T=8192,D=4096,tiers=low/medium/max"),
                                               ("mom_read", "B4-S2048-M256-D1024"), ("laurel", "N=8192,D=2048"),
                                               (report.SDPA, "B4-S2048-H8-KV8-D64")])
            for mode in ("fwd", "fwd+bwd") for provider in ("eager", "compiled", "triton")]
    fig = report.chart(rows, str(tmp_path / "chart.png"))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        texts = [tick.label1 for ax in fig.axes for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim()))
                 for tick in axis.get_major_ticks()
                 if min(lo, hi) <= tick.get_loc() <= max(lo, hi) and tick.label1.get_text()]   # the drawn ones
        texts += [t for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        boxes = [t.get_window_extent(renderer) for t in texts]
        page = fig.bbox
        assert len({t.get_text() for t in texts}) >= 12
        for i, a in enumerate(boxes):
            assert page.x0 <= a.x0 and a.x1 <= page.x1, f"{texts[i].get_text()!r} leaves the figure"
            for j in range(i + 1, len(boxes)):
                assert not a.overlaps(boxes[j]), f"{texts[i].get_text()!r} overlaps {texts[j].get_text()!r}"
    finally:
        plt.close(fig)
    assert (tmp_path / "chart.png").stat().st_size > 0


def test_the_sdpa_baseline_sees_the_mask_the_ops_see():
    import torch

    from bench._attention import qkv, sdpa

    shape = (2, 12, 4, 2, 8)
    assert "attention_mask" not in qkv(shape)       # the ops' default: causal only, as SDPA's
    inp = qkv(shape, mask=True)
    q, k, v, keep = inp["q"], inp["k"], inp["v"], inp["attention_mask"]
    kr, vr = (t.repeat_interleave(2, dim=2) for t in (k, v))
    scores = torch.einsum("bshd,bnhd->bhsn", q.double(), kr.double()) / 8 ** 0.5
    visible = torch.ones(12, 12, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    want = torch.einsum("bhsn,bnhd->bshd", p, vr.double())
    torch.testing.assert_close(sdpa(**inp).double(), want, atol=1e-5, rtol=1e-5)
