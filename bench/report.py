"""Turn pytest-benchmark JSON into a markdown table and a PNG chart, and/or print
the static sm_90 summary (read from ``bench/static_sm90.json``; ``make static``
refreshes that table and this script's ``--update-docs`` writes it into the docs).

    python bench/report.py bench/results/latest.json [--png out.png] [--static]
    python bench/report.py --update-docs docs/benchmarks.md

    python bench/report.py run_triton.json run_eager.json run_compiled.json

Table columns: median time per provider (eager reference, torch.compile'd
reference, Triton op); the Triton op's speed-up over each; its TFLOP/s and GB/s
from the FLOP and compulsory-byte counts each benchmark records per mode (see
``bench/_harness.py``); its FLOP rate as a fraction of PyTorch SDPA's on the same
attention shape and mode; the fraction of what the device sustains (bf16 matmul
FLOP/s, or copy bandwidth for memory-bound kernels; H100/H200 only); peak memory
(CUDA).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict


# What the device sustains on plain work (measured on an H200: an 8192³ bf16 matmul
# through PyTorch, a device-to-device copy counting bytes read and written); the
# "% roofline" column divides by these.
ACHIEVABLE = {"H200": (790e12, 4.3e12), "H100": (760e12, 3.0e12)}
SDPA = "sdpa (baseline)"


def load(*paths: str) -> tuple[dict, list[dict]]:
    """Rows of every laminae benchmark in ``paths`` (several runs, e.g. one per provider,
    merge; a later file's row replaces an earlier one's)."""
    machine, rows = {}, {}
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        machine = machine or data.get("machine_info", {})
        for b in data["benchmarks"]:
            info = b.get("extra_info", {})
            if "provider" not in info:
                continue
            rows[(info["mechanism"], info["shape"], info["mode"], info["provider"])] = dict(
                info, median_ms=b["stats"]["median"] * 1e3)
    return machine, list(rows.values())


def _achievable(device: str | None) -> tuple[float, float] | None:
    return next((v for k, v in ACHIEVABLE.items() if device and k in device), None)


def rates(rows: list[dict]) -> list[dict]:
    """One dict per (mechanism, shape, mode): times per provider, the Triton op's
    TFLOP/s and GB/s, its speed-ups, its FLOP rate as a fraction of SDPA's on the same
    attention shape and mode, and as a fraction of what the device sustains."""
    groups: dict[tuple, dict] = defaultdict(dict)
    for r in rows:
        groups[(r["mechanism"], r["shape"], r["mode"])][r["provider"]] = r
    sdpa_rate = {(k[1], k[2]): g["eager"]["flops"] / (g["eager"]["median_ms"] * 1e-3)
                 for k, g in groups.items() if k[0] == SDPA and "eager" in g and g["eager"].get("flops")}
    out = []
    for key in sorted(groups):
        g = groups[key]
        ms = {p: g[p]["median_ms"] for p in ("eager", "compiled", "triton") if p in g}
        meta = next(iter(g.values()))
        flops, nbytes = meta.get("flops"), meta.get("bytes_moved")
        best = "triton" if "triton" in ms else ("eager" if key[0] == SDPA and "eager" in ms else None)
        t = ms.get(best) if best else None
        row = dict(mechanism=key[0], shape=key[1], mode=key[2], ms=ms, device=meta.get("device"),
                   peak_mb={p: g[p].get("peak_mem_mb") for p in g})
        row["tflops"] = flops / (t * 1e-3) / 1e12 if flops and t else None
        row["gbs"] = nbytes / (t * 1e-3) / 1e9 if nbytes and t else None
        row["vs_eager"] = ms["eager"] / ms["triton"] if "eager" in ms and "triton" in ms else None
        row["vs_compiled"] = ms["compiled"] / ms["triton"] if "compiled" in ms and "triton" in ms else None
        ref = sdpa_rate.get((key[1], key[2]))
        row["of_sdpa"] = row["tflops"] * 1e12 / ref if ref and row["tflops"] and key[0] != SDPA else None
        peak = _achievable(meta.get("device"))
        row["of_roofline"] = None
        if peak and row["tflops"]:
            row["of_roofline"] = row["tflops"] * 1e12 / peak[0]
        elif peak and row["gbs"]:
            row["of_roofline"] = row["gbs"] * 1e9 / peak[1]
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    out = ["| mechanism | shape | mode | eager ms | compiled ms | triton ms | vs eager | vs compiled | "
           "TFLOP/s | GB/s | of SDPA's FLOP rate | of roofline | peak MB (eager/triton) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    num = lambda v, f="{:.3f}": f.format(v) if v is not None else "-"  # noqa: E731
    for r in rates(rows):
        ms = r["ms"]
        mem = "/".join(num(r["peak_mb"].get(p), "{:.1f}") for p in ("eager", "triton"))
        out.append(f"| {r['mechanism']} | {r['shape']} | {r['mode']} | {num(ms.get('eager'))} | "
                   f"{num(ms.get('compiled'))} | {num(ms.get('triton'))} | {num(r['vs_eager'], '{:.2f}x')} | "
                   f"{num(r['vs_compiled'], '{:.2f}x')} | {num(r['tflops'], '{:.1f}')} | {num(r['gbs'], '{:.0f}')} | "
                   f"{num(r['of_sdpa'] and 100 * r['of_sdpa'], '{:.0f} %')} | "
                   f"{num(r['of_roofline'] and 100 * r['of_roofline'], '{:.0f} %')} | {mem} |")
    return "\n".join(out)


def chart(rows: list[dict], path: str):
    """Horizontal bars, one group per (mechanism, shape, mode) and one bar per provider,
    median time on a log axis; the labels sit on the y axis, one line each, so they
    never overlap however many cases there are. Returns the figure (already saved)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, dict] = defaultdict(dict)
    for r in rows:
        groups[(r["mechanism"], r["shape"], r["mode"])][r["provider"]] = r["median_ms"]
    keys = sorted(groups)
    providers = [p for p in ("eager", "compiled", "triton") if any(p in groups[k] for k in keys)]
    bar = 0.8 / max(1, len(providers))
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.22 * len(keys) * max(1, len(providers))))
    for i, p in enumerate(providers):
        have = [j for j, k in enumerate(keys) if p in groups[k]]
        ax.barh([j + (i - (len(providers) - 1) / 2) * bar for j in have], [groups[keys[j]][p] for j in have],
                bar, label=p)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"{m}  {s}  {mode}" for m, s, mode in keys], fontsize=8)
    for j in range(1, len(keys)):     # a rule between mechanisms
        if keys[j][0] != keys[j - 1][0]:
            ax.axhline(j - 0.5, color="0.8", linewidth=0.8)
    ax.set_ylim(len(keys) - 0.5, -0.5)
    ax.set_xscale("log")
    ax.set_xlabel("median ms (log scale; shorter is faster)")
    ax.grid(axis="x", which="major", color="0.9")
    ax.set_axisbelow(True)
    # the legend above the bars, never over one
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=max(1, len(providers)), fontsize=8, frameon=False)
    ax.set_title("laminae benchmarks", pad=24)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def _static():
    """The static check beside this file, whether this runs as ``bench.report`` or as a
    script (then ``bench/`` is on the path)."""
    try:
        from . import static_sm90
    except ImportError:
        import static_sm90
    return static_sm90


def static_table(per_config: bool = False) -> str:
    """The static sm_90 record, from the committed table (``make static`` refreshes
    it; nothing is compiled here)."""
    static = _static()
    reports = list(static.load_table().values())
    return static.markdown(reports) if per_config else static.docs_section(reports)


# Goals, as FLOP rates at the goal shape: exotic attention cores at 60 % of SDPA's rate.
# SDPA's rate is the measured one when a run gives it; otherwise an assumed
# FlashAttention-2-class 50 % of the dense bf16 peak (495 TFLOP/s), marked "assumed".
SDPA_ASSUMED = 0.5 * 990e12
GOAL_OF_SDPA = 0.6


def _estimator():
    try:
        from . import estimate, goal_plans
    except ImportError:
        import estimate
        import goal_plans
    return estimate, goal_plans


def estimate_rows(measured: list[dict] | None = None, entries: list | None = None) -> list[dict]:
    """Per (op, goal shape, mode, variant): FLOPs, bytes, the estimated time from the
    static table (bench/estimate.py) and, where a run measured it, the Triton time."""
    est, plans = _estimator()
    if entries is None:
        entries = [r.record() for r in _static().load_table().values()]
    ms = {(r["mechanism"], r["shape"], r["mode"]): r["median_ms"] for r in (measured or []) if r["provider"] == "triton"}
    sdpa = {(r["shape"], r["mode"]): r for r in rates(measured or []) if r["mechanism"] == SDPA}
    variants = [("derf_attention", "before", lambda s: plans.derf(s, split=False)),
                ("derf_attention", "after", lambda s: plans.derf(s, split=True)),
                ("elo_attention", "before", lambda s: plans.elo(s, delta_kernel=False)),
                ("elo_attention", "after", lambda s: plans.elo(s)),
                ("affine_scaled_attention", "before", lambda s: plans.affine(s, two_level=False)),
                ("affine_scaled_attention", "after", lambda s: plans.affine(s)),
                ("affine_scaled_attention", "projected", lambda s: plans.affine(s, fused_epilogue=True))]
    out = []
    for shape in plans.GOAL:
        sid = plans.goal_id(shape)
        flops = plans.attention_flops(shape)
        for name, variant, build in variants:
            for mode, launches in build(shape).items():
                parts = est.estimate_op(entries, launches)
                seconds = est.total_seconds(parts)
                ref = sdpa.get((sid, mode))
                sdpa_rate = ref["tflops"] * 1e12 if ref and ref.get("tflops") else SDPA_ASSUMED
                rate = flops[mode] / seconds
                out.append(dict(op=name, shape=sid, mode=mode, variant=variant, flops=flops[mode],
                                bytes=sum(l.bytes for l in launches), est_ms=seconds * 1e3,
                                of_sdpa=rate / sdpa_rate, sdpa_assumed=ref is None,
                                measured_ms=ms.get((name, sid, mode)), parts=parts))
    return out


def estimate_table(rows: list[dict]) -> str:
    lines = ["| op | shape | mode | variant | GFLOP | MB moved | est. ms | est. of SDPA's rate (goal 60 %) | "
             "measured ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        assumed = " (assumed SDPA)" if r["sdpa_assumed"] else ""
        meas = f"{r['measured_ms']:.3f}" if r["measured_ms"] is not None else "-"
        lines.append(f"| {r['op']} | {r['shape']} | {r['mode']} | {r['variant']} | {r['flops'] / 1e9:.1f} | "
                     f"{r['bytes'] / 1e6:.0f} | {r['est_ms']:.3f} | {100 * r['of_sdpa']:.0f} %{assumed} | {meas} |")
    return "\n".join(lines)


def launch_table(rows: list[dict]) -> str:
    """Per launch of each row: configuration facts and the model's terms."""
    lines = ["| op | shape | mode | variant | kernel | tiles | TC | CTAs/SM × warps | programs (waves) | "
             "serial steps | MB | tc µs | ALU µs | mem µs | serial µs | est. µs | bound by |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for e in r["parts"]:
            l, en = e.launch, e.entry
            lines.append(f"| {r['op']} | {r['shape']} | {r['mode']} | {r['variant']} | {l.kernel} | {l.note} | "
                         f"{en['tensor_cores']} | {en['ctas_per_sm']} × {en['num_warps']} | {l.programs} ({e.waves}) | "
                         f"{l.serial_steps} | {l.bytes / 1e6:.0f} | {e.tc_s * 1e6:.0f} | {e.alu_s * 1e6:.0f} | "
                         f"{e.mem_s * 1e6:.0f} | {e.lat_s * 1e6:.0f} | {e.seconds * 1e6:.0f} | {e.bound} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="*", help="pytest-benchmark JSON files (merged)")
    p.add_argument("--png", help="chart path (default: next to the JSON)")
    p.add_argument("--static", action="store_true", help="also print the static sm_90 summary (from the table)")
    p.add_argument("--static-configs", action="store_true", help="print every static sm_90 configuration")
    p.add_argument("--update-docs", metavar="MD", help="rewrite the generated static section of this file")
    p.add_argument("--estimate", action="store_true",
                   help="per op at the goal shapes: FLOPs, bytes, estimated time (static table), measured time")
    p.add_argument("--launches", action="store_true", help="with --estimate: the model's terms per launch")
    args = p.parse_args(argv)
    if args.json:
        machine, rows = load(*args.json)
        if not rows:
            print("no laminae benchmarks in", *args.json, file=sys.stderr)
            return 1
        print(f"machine: {machine.get('cpu', {}).get('brand_raw', '?')}; device: {rows[0].get('device')}; "
              f"torch {rows[0].get('torch')}\n")
        print(table(rows))
        png = args.png or os.path.splitext(args.json[0])[0] + ".png"
        try:
            import matplotlib.pyplot as plt

            plt.close(chart(rows, png))
            print(f"\nchart: {png}")
        except ImportError:
            print("\n(matplotlib not installed: no chart; `pip install laminae[bench]`)")
    if args.estimate:
        measured = load(*args.json)[1] if args.json else None
        est = estimate_rows(measured)
        print("\n" + estimate_table(est))
        if args.launches:
            print("\n" + launch_table(est))
    if args.static or args.static_configs:
        print("\n" + static_table(per_config=args.static_configs))
    if args.update_docs:
        static = _static()
        changed = static.update_docs(args.update_docs, list(static.load_table().values()))
        print(f"{args.update_docs}: static section {'updated' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
