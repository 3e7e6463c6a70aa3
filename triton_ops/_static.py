"""Static Hopper check: compile every kernel configuration for sm_90 on the host.

No GPU is needed: Triton compiles to a cubin for ``GPUTarget("cuda", 90, 32)`` on
any machine, and the ``cuobjdump``/``ptxas`` that ship inside Triton read its
register count, stack (spills), and shared memory. This catches what the
interpreter accepts but the GPU compiler rejects (``tl.dot`` with a dimension
below 16, shared memory over budget) and the register pressure that makes a
kernel slow.

    python -m laminae.triton_ops._static [--json] [stems...]

Must run with ``TRITON_INTERPRET`` unset (kernels must be real JIT functions);
the test suite runs it in a subprocess for that reason.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

# What one H200 (sm_90) thread block may use: 227 KB of dynamic shared memory.
SMEM_LIMIT = 227 * 1024


@dataclass
class StaticReport:
    mechanism: str
    kernel: str
    config: str
    registers: int = -1
    stack_bytes: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    shared_bytes: int = -1
    warnings: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return (not self.error and self.stack_bytes == 0 and self.spill_stores == 0
                and self.spill_loads == 0 and 0 <= self.shared_bytes <= SMEM_LIMIT)

    def problems(self) -> str:
        out = []
        if self.error:
            out.append(f"compile error: {self.error}")
        if self.stack_bytes:
            out.append(f"stack {self.stack_bytes} B")
        if self.spill_stores or self.spill_loads:
            out.append(f"spills {self.spill_stores}/{self.spill_loads} B (store/load)")
        if self.shared_bytes > SMEM_LIMIT:
            out.append(f"shared memory {self.shared_bytes} B > {SMEM_LIMIT} B")
        return "; ".join(out)


def _bin(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _compile_one(args) -> StaticReport:
    stem, index = args
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    case = list(importlib.import_module(f"laminae.triton_ops.{stem}").static_cases())[index]
    rep = StaticReport(stem, case.name, case.label + "".join(f",{k}={v}" for k, v in case.tags.items()))
    signature = dict(case.signature)
    signature.update({k: "constexpr" for k in case.constexprs})
    try:
        compiled = triton.compile(
            ASTSource(fn=case.kernel, signature=signature, constexprs=dict(case.constexprs)),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": case.num_warps, "num_stages": case.num_stages},
        )
    except Exception as exc:  # the report carries the reason; the check fails on it
        rep.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        return rep
    rep.shared_bytes = int(compiled.metadata.shared)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as fh:
            fh.write(compiled.asm["cubin"])
        res = subprocess.run([_bin("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", res)
        if m:
            rep.registers, rep.stack_bytes = int(m.group(1)), int(m.group(2)) + int(m.group(4))
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as fh:
            fh.write(compiled.asm["ptx"])
        out = subprocess.run([_bin("ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "p.cubin")],
                             capture_output=True, text=True)
        text = out.stdout + out.stderr
        s = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        if s:
            rep.spill_stores, rep.spill_loads = int(s.group(1)), int(s.group(2))
        warns = [ln.strip() for ln in text.splitlines() if "warning" in ln.lower()]
        rep.warnings = " | ".join(warns)[:300]
    return rep


def collect(stems, workers: int = 2) -> list[StaticReport]:
    jobs = []
    for stem in stems:
        n = len(list(importlib.import_module(f"laminae.triton_ops.{stem}").static_cases()))
        jobs += [(stem, i) for i in range(n)]
    if workers <= 1:
        return [_compile_one(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_compile_one, jobs))


def markdown(reports: list[StaticReport]) -> str:
    lines = ["| mechanism | kernel | config | registers | stack/spill B | shared B | status |",
             "|---|---|---|---|---|---|---|"]
    for r in reports:
        spill = f"{r.stack_bytes}/{max(r.spill_stores, 0) + max(r.spill_loads, 0)}"
        lines.append(f"| {r.mechanism} | {r.kernel} | {r.config} | {r.registers} | {spill} | {r.shared_bytes} | "
                     f"{'ok' if r.ok else r.problems()} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the static check compiles real kernels", file=sys.stderr)
        return 2
    from .tour import MECHANISMS

    p = argparse.ArgumentParser(prog="python -m laminae.triton_ops._static")
    p.add_argument("stems", nargs="*", default=MECHANISMS)
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = p.parse_args(argv)
    reports = collect(args.stems, args.workers)
    if args.json:
        print(json.dumps([asdict(r) | {"ok": r.ok} for r in reports]))
    else:
        print(markdown(reports))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
