"""Turn pytest-benchmark JSON into a markdown table and a PNG chart, and/or print
the static sm_90 summary (read from ``triton_ops/static_sm90.json``; ``make static``
refreshes that table and this script's ``--update-docs`` writes it into the docs).

    python bench/report.py bench/results/latest.json [--png out.png] [--static]
    python bench/report.py --update-docs docs/benchmarks.md

Table columns: median time per provider (eager reference, torch.compile'd
reference, Triton op), the speed-ups of the Triton op and of the compiled
reference over eager, achieved GB/s (memory-bound ops) or TFLOP/s when the
benchmark recorded bytes or FLOPs, and peak memory (CUDA).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict


def load(path: str) -> tuple[dict, list[dict]]:
    with open(path) as fh:
        data = json.load(fh)
    rows = []
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        if "provider" not in info:
            continue
        rows.append(dict(info, median_ms=b["stats"]["median"] * 1e3))
    return data.get("machine_info", {}), rows


def table(rows: list[dict]) -> str:
    groups: dict[tuple, dict] = defaultdict(dict)
    meta: dict[tuple, dict] = {}
    for r in rows:
        key = (r["mechanism"], r["shape"], r["mode"])
        groups[key][r["provider"]] = r
        meta[key] = r
    out = ["| mechanism | shape | mode | eager ms | compiled ms | triton ms | triton vs eager | compiled vs eager | "
           "triton GB/s | peak MB (eager/triton) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(groups):
        g = groups[key]

        def ms(p):
            return g[p]["median_ms"] if p in g else None

        e, c, t = ms("eager"), ms("compiled"), ms("triton")
        fmt = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}x" if a is not None and b else "-"  # noqa: E731
        gbs = "-"
        if t and meta[key].get("bytes_moved") and key[2] == "fwd":
            gbs = f"{meta[key]['bytes_moved'] / (t * 1e-3) / 1e9:.0f}"
        mem = "/".join(f"{g[p]['peak_mem_mb']:.1f}" if p in g and g[p].get("peak_mem_mb") is not None else "-"
                       for p in ("eager", "triton"))
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {fmt(e)} | {fmt(c)} | {fmt(t)} | {ratio(e, t)} | "
                   f"{ratio(e, c)} | {gbs} | {mem} |")
    return "\n".join(out)


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, dict] = defaultdict(dict)
    for r in rows:
        groups[(r["mechanism"], r["shape"], r["mode"])][r["provider"]] = r["median_ms"]
    keys = sorted(groups)
    providers = [p for p in ("eager", "compiled", "triton") if any(p in groups[k] for k in keys)]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(keys)), 4.5))
    width = 0.8 / max(1, len(providers))
    for i, p in enumerate(providers):
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, [groups[k].get(p, 0.0) for k in keys], width, label=p)
    ax.set_xticks([j + width * (len(providers) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([f"{k[0]}\n{k[1]}\n{k[2]}" for k in keys], fontsize=7)
    ax.set_ylabel("median ms (log)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("laminae benchmarks")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def static_table(per_config: bool = False) -> str:
    """The static sm_90 record, from the committed table (``make static`` refreshes
    it; nothing is compiled here)."""
    from laminae.triton_ops import _static

    reports = list(_static.load_table().values())
    return _static.markdown(reports) if per_config else _static.docs_section(reports)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="?", help="pytest-benchmark JSON file")
    p.add_argument("--png", help="chart path (default: next to the JSON)")
    p.add_argument("--static", action="store_true", help="also print the static sm_90 summary (from the table)")
    p.add_argument("--static-configs", action="store_true", help="print every static sm_90 configuration")
    p.add_argument("--update-docs", metavar="MD", help="rewrite the generated static section of this file")
    args = p.parse_args(argv)
    if args.json:
        machine, rows = load(args.json)
        if not rows:
            print("no laminae benchmarks in", args.json, file=sys.stderr)
            return 1
        print(f"machine: {machine.get('cpu', {}).get('brand_raw', '?')}; device: {rows[0].get('device')}; "
              f"torch {rows[0].get('torch')}\n")
        print(table(rows))
        png = args.png or os.path.splitext(args.json)[0] + ".png"
        try:
            chart(rows, png)
            print(f"\nchart: {png}")
        except ImportError:
            print("\n(matplotlib not installed: no chart; `pip install laminae[bench]`)")
    if args.static or args.static_configs:
        print("\n" + static_table(per_config=args.static_configs))
    if args.update_docs:
        from laminae.triton_ops import _static

        changed = _static.update_docs(args.update_docs, list(_static.load_table().values()))
        print(f"{args.update_docs}: static section {'updated' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
