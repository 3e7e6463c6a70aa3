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


def test_the_estimate_is_the_documented_model_on_a_made_up_table():
    from bench import estimate as est

    table = [dict(mechanism="m", kernel="k", config="BLOCK=64,dtype=bf16", ctas_per_sm=2, num_warps=4,
                  tensor_cores="HGMMA"),
             dict(mechanism="m", kernel="k", config="BLOCK=64,dtype=fp16", ctas_per_sm=1, num_warps=4,
                  tensor_cores="HMMA"),
             dict(mechanism="m", kernel="scan", config="dtype=bf16", ctas_per_sm=1, num_warps=4, tensor_cores="-")]
    # 2 CTAs/SM x 132 SMs = 264 slots; 400 programs: 2 waves, busy 400/528; 8 resident warps hide all
    gemm = est.Launch("m", "k", ("BLOCK=64",), programs=400, tc_flops=990e9, alu_slots=10e9, bytes=4.8e9)
    (e,) = est.estimate_op(table, [gemm])
    busy = 400 / 528
    assert e.entry["tensor_cores"] == "HGMMA" and e.waves == 2 and e.busy == pytest.approx(busy) and e.hide == 1.0
    assert e.tc_s == pytest.approx(1e-3 / busy) and e.mem_s == pytest.approx(1e-3 / busy)
    assert e.alu_s == pytest.approx(10e9 / (132 * 128 * 1.98e9) / busy)
    assert e.seconds == pytest.approx(e.tc_s + e.alu_s + 4e-6) and e.bound == "tensor cores"
    # fp16 picks the other entry: 1 CTA/SM (4 waves of 132, busy 400/528 again), mma.sync
    # at half the rate and 4 resident warps (hide 1/2)
    (f,) = est.estimate_op(table, [gemm], dtype="fp16")
    assert f.waves == 4 and f.hide == 0.5 and f.tc_s == pytest.approx(990e9 / (495e12 * busy * 0.5))
    # a scan of 64 carried steps on 64 programs: one wave, latency-bound
    scan = est.Launch("m", "scan", (), programs=64, bytes=1e6, serial_steps=64, step_s=est.STEP_S)
    (s,) = est.estimate_op(table, [scan])
    assert s.bound == "serial steps" and s.seconds == pytest.approx(64 * 0.5e-6 + 4e-6)
    with pytest.raises(KeyError):
        est.estimate_op(table, [est.Launch("m", "k", ("BLOCK=32",), programs=1, tc_flops=1.0)])
    # causal tiles: 4 query blocks of 64 over 32-key blocks read 2, 4, 6, 8; diagonal ones 2 each
    assert est.causal_tiles(256, 64, 32) == 20 and est.diagonal_tiles(256, 64, 32) == 8
    assert est.diagonal_tiles(256, 64, 64) == 4 and est.diagonal_tiles(256, 32, 64) == 8


def test_the_goal_estimates_read_the_static_table_for_every_launch():
    rows = report.estimate_rows()
    assert {r["op"] for r in rows} == {"derf_attention", "elo_attention", "affine_scaled_attention"}
    assert all(r["est_ms"] > 0 and r["measured_ms"] is None for r in rows)
    table = report.estimate_table(rows)
    assert "| derf_attention | B8-S2048-H16-KV16-D64 | fwd | after | 68.7 |" in table
