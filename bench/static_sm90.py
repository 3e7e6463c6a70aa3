"""Static Hopper check: every kernel configuration compiled for sm_90 on the host.

No GPU is needed: Triton compiles to a cubin for ``GPUTarget("cuda", 90, 32)`` on
any machine; the log of the ``ptxas`` bundled with Triton gives registers, spills and
stack, Triton's metadata the shared memory, and the bundled ``cuobjdump`` the SASS. Per configuration the check records
those, the CTAs per SM they allow, which tensor-core instructions the SASS holds
(Hopper's HGMMA, the older HMMA, or none) and ptxas' "Potential Performance Loss"
notes about wgmma.

The check is incremental. ``static_sm90.json`` (next to this file, committed) holds
one entry per (mechanism, kernel, configuration) with a key: a hash of everything
that determines the compile -- the kernel's source and, transitively, the source of
every ``@triton.jit`` helper it calls (wherever defined) and the global constants it
reads; the argument types; the constexprs; num_warps/num_stages; the target; the
Triton version; and the format of an entry. Only configurations whose key is not in
the table are compiled; the rest are read from it.

The table is a cache and a record; correctness comes from the compile. So:

- any entry (read or freshly compiled) with a spill, stack use, shared memory over
  227 KB or a compile error fails the check;
- a configuration with no entry, or a changed one, is compiled in the same run and
  passes if that compile is clean; the table is then *stale* and the check says so
  (run ``make static`` to refresh it and the docs). ``--strict`` makes staleness,
  including entries for configurations no longer launched, a failure too.

    python -m bench.static_sm90 [stems...]          check (incremental)
    python -m bench.static_sm90 --write [stems...]  refresh the table
    python -m bench.static_sm90 --force ...         ignore the table

(from the repository root: this is tooling beside the package, not part of it; it
finds each mechanism's ``static_cases()`` in ``laminae.triton_ops.<stem>``).

Compiles run in parallel (one process per core). A compile fails, naming its kernel,
only when it is stuck -- over a CPU-time budget, or making no CPU progress for
minutes -- never on wall-clock time, which a loaded machine stretches.

Must run with ``TRITON_INTERPRET`` unset (kernels must be real JIT functions); the
test suite runs it in a subprocess for that reason.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

# Bump when an entry's fields or how they are measured change: every key changes.
SCHEMA = 2
TARGET = ("cuda", 90, 32)
TARGET_LABEL = "sm_90a"
TABLE_PATH = Path(__file__).with_name("static_sm90.json")

# sm_90 limits (CUDA occupancy calculator, compute capability 9.0). One block may
# ask for 227 KB of shared memory; an SM has 228 KB and reserves 1 KB per resident
# block; shared memory is allocated in 128-byte units, registers in 256 per warp.
SMEM_LIMIT = 227 * 1024
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
SMEM_UNIT = 128
REGS_PER_SM = 65536
REG_UNIT_PER_WARP = 256
WARPS_PER_SM = 64
CTAS_PER_SM = 32

# A compile is stuck when it spends this much CPU time (the largest configuration
# today takes under a minute), or when its process tree makes no CPU progress for
# this many seconds of wall time (a starved process still gets some CPU).
CPU_LIMIT_S = float(os.environ.get("LAMINAE_STATIC_CPU_LIMIT", 900))
STALL_S = float(os.environ.get("LAMINAE_STATIC_STALL_S", 600))


# ----------------------------------------------------------------------------
# One entry
# ----------------------------------------------------------------------------


@dataclass
class StaticReport:
    """What ptxas built for one kernel at one launch configuration (-1: unknown)."""

    mechanism: str
    kernel: str
    config: str
    key: str = ""
    num_warps: int = 4
    num_stages: int = 3
    registers: int = -1
    stack_bytes: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    shared_bytes: int = -1
    ctas_per_sm: int = -1
    limiter: str = ""
    dots: int = 0
    tensor_cores: str = ""
    mma: str = ""
    perf_notes: str = ""
    warnings: str = ""
    error: str = ""
    source: str = field(default="compiled", compare=False)  # "table" or "compiled"; not stored

    @property
    def id(self) -> str:
        return f"{self.mechanism}/{self.kernel}[{self.config}]"

    @property
    def ok(self) -> bool:
        return (not self.error and self.stack_bytes == 0 and self.spill_stores == 0
                and self.spill_loads == 0 and 0 <= self.shared_bytes <= SMEM_LIMIT)

    @property
    def occupancy(self) -> float:
        """Resident warps per SM as a fraction of 64."""
        return max(self.ctas_per_sm, 0) * self.num_warps / WARPS_PER_SM

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

    def record(self) -> dict:
        d = asdict(self)
        d.pop("source")
        return d


_FIELDS = {f.name for f in dataclasses.fields(StaticReport)}


def ctas_per_sm(registers: int, num_warps: int, shared_bytes: int) -> tuple[int, str]:
    """Blocks of ``num_warps`` warps one sm_90 SM holds at once, and what limits it
    ("registers", "shared", "warps" or "blocks")."""
    # on a tie, the hardware cap is named: fewer registers or less shared memory would not help
    limits = {"blocks": CTAS_PER_SM, "warps": WARPS_PER_SM // num_warps}
    if registers > 0:
        per_warp = math.ceil(registers * 32 / REG_UNIT_PER_WARP) * REG_UNIT_PER_WARP
        limits["registers"] = (REGS_PER_SM // per_warp) // num_warps
    if shared_bytes >= 0:
        per_cta = math.ceil((shared_bytes + SMEM_RESERVED_PER_CTA) / SMEM_UNIT) * SMEM_UNIT
        limits["shared"] = SMEM_PER_SM // per_cta if shared_bytes <= SMEM_LIMIT else 0
    limiter = min(limits, key=lambda k: limits[k])  # the first of equals
    return limits[limiter], limiter


_MMA = re.compile(r"\b((?:HGMMA|HMMA|IMMA|DMMA|QMMA)(?:\.[A-Za-z0-9_]+)*)")


def tensor_core_kind(sass: str, dots: int) -> tuple[str, str]:
    """("HGMMA" | "HMMA" | "FMA" | "-", distinct MMA instruction shapes) from SASS.

    "FMA": the kernel has ``tl.dot`` but no tensor-core instruction (fp32 "ieee"
    products); "-": no ``tl.dot`` at all."""
    variants = sorted({m.group(1) for m in _MMA.finditer(sass)})
    if any(v.startswith("HGMMA") for v in variants):
        kind = "HGMMA"
    elif variants:
        kind = variants[0].split(".")[0]
    else:
        kind = "FMA" if dots else "-"
    return kind, " ".join(variants)


def perf_notes(ptxas_log: str) -> str:
    """ptxas' performance notes (wgmma serialisation and the like); they are "info"
    lines, not warnings."""
    lines = [ln.strip() for ln in ptxas_log.splitlines() if "Performance Loss" in ln or "performance" in ln.lower()]
    return " | ".join(dict.fromkeys(lines))[:600]


def parse_ptxas(log: str) -> dict:
    out = {}
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m:
        out.update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    m = re.search(r"Used (\d+) registers", log)
    if m:
        out["registers"] = int(m.group(1))
    return out


# ----------------------------------------------------------------------------
# Cases and their keys
# ----------------------------------------------------------------------------


def _module(stem: str, path: str | None = None):
    """``laminae.triton_ops.<stem>``, or the file at ``path`` loaded under that name
    (a temporary edited copy of a kernel file)."""
    name = f"laminae.triton_ops.{stem}"
    if path is None:
        return importlib.import_module(name)
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == path:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_AS_JIT: dict = {}


def _unwrap(kernel):
    """The JITFunction under autotuner/heuristics wrappers. Under ``TRITON_INTERPRET=1``
    kernels are interpreter objects: a JITFunction is built from the same Python
    function (nothing is compiled), so keys are the same in both modes."""
    while not hasattr(kernel, "src") and hasattr(kernel, "fn"):
        if type(kernel).__name__ == "InterpretedFunction":
            from triton.runtime.jit import JITFunction

            if kernel.fn not in _AS_JIT:
                _AS_JIT[kernel.fn] = JITFunction(kernel.fn)
            return _AS_JIT[kernel.fn]
        kernel = kernel.fn
    return kernel


def expand(case) -> list:
    """A case whose kernel is ``@triton.autotune``'d becomes one case per config, at
    that config's constexprs, num_warps and num_stages."""
    configs = getattr(case.kernel, "configs", None)
    if not configs:
        return [dataclasses.replace(case, kernel=_unwrap(case.kernel))]
    return [dataclasses.replace(case, kernel=_unwrap(case.kernel), constexprs={**case.constexprs, **cfg.kwargs},
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                tags={**case.tags, "autotune": i})
            for i, cfg in enumerate(configs)]


def cases_of(stem: str, path: str | None = None) -> list:
    out = []
    for case in _module(stem, path).static_cases():
        out += expand(case)
    return out


def config_label(case) -> str:
    return case.label + "".join(f",{k}={v}" for k, v in case.tags.items())


def source_key(fn, _memo: dict | None = None) -> str:
    """Hash of a JIT function's source, of every ``@triton.jit`` function it calls
    (transitively, from any module) and of the global values it reads.

    Triton's own ``cache_key`` also hashes line numbers (for debug info), so editing
    anything above a kernel would invalidate it; line numbers change no register."""
    from triton.runtime.jit import DependenciesFinder

    memo = {} if _memo is None else _memo  # id -> (function, key); JITFunction's hash is its cache_key
    fn = _unwrap(fn)
    if id(fn) in memo:
        return memo[id(fn)][1]
    if not hasattr(fn, "parse"):  # a JIT callable of another kind: Triton's key
        return fn.cache_key
    memo[id(fn)] = (fn, f"recursion:{fn.__qualname__}")

    class _Finder(DependenciesFinder):
        def _update_hash(self, func):
            self.hasher.update(source_key(func, memo).encode())

        def record_reference(self, val, var_dict=None, name=None):
            if type(val).__name__ == "InterpretedFunction":
                return self.hasher.update(source_key(val, memo).encode())
            return super().record_reference(val, var_dict, name)

    import inspect

    finder = _Finder(name=fn.__qualname__, globals=fn.__globals__,
                     nonlocals=inspect.getclosurevars(fn.fn).nonlocals, src=fn.src)
    finder.visit(fn.parse())
    used = sorted((name, repr(val)) for (name, _), (val, _) in finder.used_global_vals.items())
    memo[id(fn)] = (fn, hashlib.sha256((finder.ret + repr(used)).encode()).hexdigest())
    return memo[id(fn)][1]


def case_key(case, memo: dict | None = None) -> str:
    import triton

    what = dict(schema=SCHEMA, target=list(TARGET), triton=triton.__version__, source=source_key(case.kernel, memo),
                signature=dict(case.signature), constexprs={k: repr(v) for k, v in case.constexprs.items()},
                num_warps=case.num_warps, num_stages=case.num_stages)
    if getattr(case, "divisible", ()):
        what["divisible"] = sorted(case.divisible)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


@dataclass
class Job:
    stem: str
    index: int
    id: str
    key: str
    path: str | None = None
    expect: str = ""


def plan(stems: Sequence[str], paths: dict[str, str] | None = None) -> list[Job]:
    paths = paths or {}
    jobs, memo, seen = [], {}, {}
    for stem in stems:
        for index, case in enumerate(cases_of(stem, paths.get(stem))):
            cid = f"{stem}/{case.name}[{config_label(case)}]"
            if cid in seen:
                raise ValueError(f"two static cases of {stem} share the configuration {cid}: tell them apart "
                                 f"with a tag")
            seen[cid] = True
            jobs.append(Job(stem, index, cid, case_key(case, memo), paths.get(stem), case.expect))
    return jobs


# ----------------------------------------------------------------------------
# Compiling one case
# ----------------------------------------------------------------------------


def _bin(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_case(job: Job) -> dict:
    """Compile one case for sm_90 and measure it (runs in a worker process)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    case = cases_of(job.stem, job.path)[job.index]
    rep = StaticReport(job.stem, case.name, config_label(case), key=job.key,
                       num_warps=case.num_warps, num_stages=case.num_stages)
    signature = dict(case.signature)
    signature.update({k: "constexpr" for k in case.constexprs})
    # the arguments Triton's launcher specializes as multiples of 16 at run time
    attrs = {(case.kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in getattr(case, "divisible", ())}
    log = io.StringIO()
    try:
        # Triton runs ptxas with -v; ask it to print that log rather than run ptxas twice.
        with knobs.nvidia.scope(), redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(
                ASTSource(fn=case.kernel, signature=signature, constexprs=dict(case.constexprs), attrs=attrs),
                target=GPUTarget(*TARGET), options={"num_warps": case.num_warps, "num_stages": case.num_stages})
    except Exception as exc:  # the entry carries the reason; the check fails on it
        msg = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
        # Triton's compile errors put the source excerpt first and the reason last
        rep.error = f"{type(exc).__name__}: {' / '.join(dict.fromkeys(msg[:1] + msg[-2:]))}"[:400]
        return rep.record()
    rep.shared_bytes = int(compiled.metadata.shared)
    ttgir = compiled.asm.get("ttgir", "")
    rep.dots = len(re.findall(r"\btt\.dot\b|\bttng\.warp_group_dot\b|\btt\.dot_scaled\b", ttgir))
    sass = ""
    with tempfile.TemporaryDirectory() as tmp:
        ptxas_log = log.getvalue()
        if "spill" not in ptxas_log:  # Triton's cache answered: no ptxas ran in this process
            ptx = os.path.join(tmp, "k.ptx")
            Path(ptx).write_text(compiled.asm["ptx"])
            out = subprocess.run([_bin("ptxas"), "-v", f"--gpu-name={TARGET_LABEL}", ptx,
                                  "-o", os.path.join(tmp, "p.cubin")], capture_output=True, text=True)
            ptxas_log = out.stdout + out.stderr
        if rep.dots:  # only a kernel with tl.dot can hold tensor-core instructions
            cubin = os.path.join(tmp, "k.cubin")
            Path(cubin).write_bytes(compiled.asm["cubin"])
            sass = subprocess.run([_bin("cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    for k, v in parse_ptxas(ptxas_log).items():
        setattr(rep, k, v)
    rep.tensor_cores, rep.mma = tensor_core_kind(sass, rep.dots)
    rep.ctas_per_sm, rep.limiter = ctas_per_sm(rep.registers, rep.num_warps, rep.shared_bytes)
    rep.perf_notes = perf_notes(ptxas_log)
    rep.warnings = " | ".join(ln.strip() for ln in ptxas_log.splitlines() if "warning" in ln.lower())[:300]
    return rep.record()


# ----------------------------------------------------------------------------
# Parallel compiles with a watchdog that does not read the wall clock
# ----------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(ppid, own CPU seconds, CPU seconds of reaped children) from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2:].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / tick, (int(rest[13]) + int(rest[14])) / tick


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st:
                parents.setdefault(st[0], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU time of a process, its live descendants and its reaped children (None
    where /proc is not available)."""
    st = _stat(pid)
    if st is None:
        return None
    total = st[1] + st[2]
    for child in _descendants(pid):
        cst = _stat(child)
        if cst:
            total += cst[1] + cst[2]
    return total


def _kill_tree(pid: int) -> None:
    for p in [*_descendants(pid), pid] if os.path.isdir("/proc") else [pid]:
        with contextlib.suppress(OSError):  # already gone
            os.kill(p, signal.SIGKILL)


def _worker(conn, fn) -> None:
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            conn.send(fn(job))
        except BaseException as exc:  # noqa: BLE001 - reported per job
            conn.send({"error": f"{type(exc).__name__}: {exc}"[:300]})


def run_parallel(jobs: Sequence[Any], fn: Callable[[Any], dict], workers: int, *, name: Callable[[Any], str] = str,
                 cpu_limit: float = CPU_LIMIT_S, stall_s: float = STALL_S, poll_s: float = 2.0,
                 progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """``fn(job)`` for every job in ``workers`` processes; results in job order.

    A job fails (``{"error": ...}`` naming it) if its process tree uses more than
    ``cpu_limit`` CPU seconds, makes no CPU progress for ``stall_s`` seconds, or
    dies. ``fn`` must be importable where workers are spawned rather than forked."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    # fork where there is one: workers inherit the imported kernel modules (importing
    # torch and them costs each spawned worker seconds to a minute on a loaded machine)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    results: list[dict | None] = [None] * len(jobs)
    todo = deque(range(len(jobs)))
    done = 0

    class Slot:
        def __init__(self):
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_worker, args=(child, fn), daemon=True)
            self.proc.start()
            child.close()
            self.busy: int | None = None

        def give(self, i):
            self.busy, self.cpu0 = i, tree_cpu_seconds(self.proc.pid)
            self.last_cpu, self.last_change = self.cpu0, time.monotonic()
            self.conn.send(jobs[i])

    def finish(slot, result):
        nonlocal done
        results[slot.busy] = result
        slot.busy = None
        done += 1
        if progress:
            progress(done, len(jobs))

    def fail(slot, why):
        _kill_tree(slot.proc.pid)
        slot.proc.join()
        finish(slot, {"error": f"{name(jobs[slot.busy])}: {why}"})
        slots[slots.index(slot)] = Slot()

    slots = [Slot() for _ in range(max(1, min(workers, len(jobs))))]
    try:
        while todo or any(s.busy is not None for s in slots):
            for s in slots:
                if s.busy is None and todo:
                    s.give(todo.popleft())
            busy = [s for s in slots if s.busy is not None]
            wait([s.conn for s in busy] + [s.proc.sentinel for s in busy], timeout=poll_s)
            for s in busy:
                if s.conn.poll():
                    try:
                        finish(s, s.conn.recv())
                        continue
                    except (EOFError, OSError):  # the worker died mid-job
                        s.proc.join(timeout=5)
                if not s.proc.is_alive():
                    fail(s, f"compiler process died (exit code {s.proc.exitcode})")
                else:
                    cpu, now = tree_cpu_seconds(s.proc.pid), time.monotonic()
                    if cpu is None:
                        continue
                    if cpu - s.cpu0 > cpu_limit:
                        fail(s, f"stuck: used more than {cpu_limit:.0f} CPU seconds")
                    elif cpu > s.last_cpu + 0.01:
                        s.last_cpu, s.last_change = cpu, now
                    elif now - s.last_change > stall_s:
                        fail(s, f"stuck: no CPU progress for {stall_s:.0f} s")
    finally:
        for s in slots:
            with contextlib.suppress(OSError):  # a worker that died has no pipe left
                s.conn.send(None)
        for s in slots:
            s.proc.join(timeout=10)
            if s.proc.is_alive():
                _kill_tree(s.proc.pid)
    return results  # type: ignore[return-value]


# ----------------------------------------------------------------------------
# The table and the check
# ----------------------------------------------------------------------------


def load_table(path: Path = TABLE_PATH) -> dict[str, StaticReport]:
    if not Path(path).exists():
        return {}
    data = json.loads(Path(path).read_text())
    out = {}
    for e in data.get("entries", []):
        rep = StaticReport(**{k: v for k, v in e.items() if k in _FIELDS})
        rep.source = "table"
        out[rep.id] = rep
    return out


def write_table(reports: Iterable[StaticReport], path: Path = TABLE_PATH) -> None:
    """One entry per line, sorted: diffs and merges of the table stay readable."""
    import triton

    rows = sorted(reports, key=lambda r: (r.mechanism, r.kernel, r.config))
    body = ",\n".join("    " + json.dumps(r.record(), separators=(", ", ": ")) for r in rows)
    Path(path).write_text(
        "{\n"
        f'  "about": "static sm_90 record; rewritten by `make static`, read by tests/triton_ops/test_static_sm90.py",\n'
        f'  "target": "{TARGET_LABEL}", "triton": "{triton.__version__}", "schema": {SCHEMA},\n'
        f'  "entries": [\n{body}\n  ]\n}}\n')


@dataclass
class CheckResult:
    reports: list[StaticReport]
    new: list[str]          # launched configurations without an entry
    changed: list[str]      # entries whose key no longer matches
    orphaned: list[str]     # entries for configurations no longer launched
    compiled: int
    seconds: float

    unmet: list[str] = field(default_factory=list)   # "id: expected X, got Y"

    @property
    def problems(self) -> list[StaticReport]:
        return [r for r in self.reports if not r.ok]

    @property
    def stale(self) -> bool:
        return bool(self.new or self.changed or self.orphaned)

    def summary(self) -> str:
        lines = [f"{len(self.reports)} configurations: {len(self.reports) - self.compiled} from "
                 f"{TABLE_PATH.name}, {self.compiled} compiled for {TARGET_LABEL} in {self.seconds:.0f} s; "
                 f"{len(self.problems)} with problems"]
        lines += [f"  FAIL {r.id}: {r.problems()}" for r in self.problems]
        lines += [f"  FAIL {u}" for u in self.unmet]
        if self.stale:
            lines.append(f"table is stale ({len(self.new)} new, {len(self.changed)} changed, "
                         f"{len(self.orphaned)} no longer launched): run `make static` to refresh it and the docs")
            lines += [f"  {what} {cid}" for what, ids in (("new", self.new), ("changed", self.changed),
                                                          ("gone", self.orphaned)) for cid in ids[:20]]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return dict(reports=[r.record() | {"ok": r.ok, "source": r.source, "id": r.id} for r in self.reports],
                    new=self.new, changed=self.changed, orphaned=self.orphaned, unmet=self.unmet,
                    compiled=self.compiled,
                    seconds=self.seconds)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _stderr_progress(done: int, total: int) -> None:
    if done == total or done % 25 == 0:
        print(f"[static] compiled {done}/{total}", file=sys.stderr, flush=True)


def check(stems: Sequence[str], *, table_path: Path = TABLE_PATH, paths: dict[str, str] | None = None,
          workers: int | None = None, force: bool = False, write: bool = False, all_stems: bool = False,
          progress: Callable[[int, int], None] | None = _stderr_progress) -> CheckResult:
    """Check ``stems``: read unchanged entries from the table, compile the rest.

    ``write`` rewrites the table: the entries of ``stems`` are replaced by this run's
    (and, with ``all_stems``, entries of mechanisms no longer listed are dropped)."""
    t0 = time.monotonic()
    jobs = plan(stems, paths)
    table = load_table(table_path)
    live = {j.id for j in jobs}
    todo = [j for j in jobs if force or j.id not in table or table[j.id].key != j.key]
    new = [j.id for j in todo if j.id not in table]
    changed = [j.id for j in todo if j.id in table and table[j.id].key != j.key]
    mine = [cid for cid, r in table.items() if all_stems or r.mechanism in stems]
    orphaned = sorted(cid for cid in mine if cid not in live)
    workers = workers or _cores()
    fresh = run_parallel(todo, compile_case, workers, name=lambda j: j.id, progress=progress) if todo else []
    by_id = {}
    for job, res in zip(todo, fresh):
        rep = StaticReport(**{k: v for k, v in res.items() if k in _FIELDS}) if "mechanism" in res else \
            StaticReport(job.stem, job.id.split("/", 1)[1].split("[", 1)[0], job.id.split("[", 1)[1][:-1],
                         key=job.key, error=res.get("error", "no result"))
        by_id[job.id] = rep
    reports = [by_id.get(j.id) or table[j.id] for j in jobs]
    if write:
        kept = [r for cid, r in table.items() if cid not in mine]
        write_table(kept + reports, table_path)
        new, changed, orphaned = [], [], []
    return CheckResult(reports, new, changed, orphaned, len(todo), time.monotonic() - t0,
                       unmet_expectations(jobs, reports))


def unmet_expectations(jobs: Sequence[Job], reports: Sequence[StaticReport]) -> list[str]:
    """Configurations whose SASS lacks the tensor-core kind their case expects."""
    return [f"{j.id}: expected {j.expect}, got {r.tensor_cores or 'nothing'}"
            for j, r in zip(jobs, reports) if j.expect and r.tensor_cores != j.expect]


# ----------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------


def _span(values: list) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


def markdown(reports: Sequence[StaticReport]) -> str:
    """Per-configuration table (``python -m bench.static_sm90``)."""
    lines = ["| mechanism | kernel | config | TC | registers | spill/stack B | shared B | CTAs/SM | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        spill = f"{max(r.spill_stores, 0) + max(r.spill_loads, 0)}/{r.stack_bytes}"
        lines.append(f"| {r.mechanism} | {r.kernel} | {r.config} | {r.tensor_cores} | {r.registers} | {spill} | "
                     f"{r.shared_bytes} | {r.ctas_per_sm} ({r.limiter}) | {'ok' if r.ok else r.problems()} |")
    return "\n".join(lines)


def summary_markdown(reports: Sequence[StaticReport]) -> str:
    """Per kernel and dtype: the docs' static table (generated from the table)."""
    groups: dict[tuple, list[StaticReport]] = {}
    for r in reports:
        dtype = re.search(r"dtype=(\w+)", r.config)
        groups.setdefault((r.mechanism, r.kernel, dtype.group(1) if dtype else "-"), []).append(r)
    lines = ["| mechanism | kernel | dtype | configs | tensor cores | registers | spills B | shared KB (max) | "
             "CTAs/SM | occupancy | limited by |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (mech, kernel, dtype), rs in sorted(groups.items()):
        kinds = "/".join(sorted({r.tensor_cores for r in rs}))
        spills = max(max(r.spill_stores, 0) + max(r.spill_loads, 0) + max(r.stack_bytes, 0) for r in rs)
        occ = [round(100 * r.occupancy) for r in rs]
        limit = "/".join(sorted({r.limiter for r in rs}))
        lines.append(f"| {mech} | {kernel} | {dtype} | {len(rs)} | {kinds} | {_span([r.registers for r in rs])} | "
                     f"{spills} | {max(r.shared_bytes for r in rs) / 1024:.1f} | {_span([r.ctas_per_sm for r in rs])} "
                     f"| {_span(occ)} % | {limit} |")
    return "\n".join(lines)


def totals(reports: Sequence[StaticReport]) -> dict:
    by_mech: dict[str, int] = {}
    for r in reports:
        by_mech[r.mechanism] = by_mech.get(r.mechanism, 0) + 1
    kinds: dict[str, int] = {}
    for r in reports:
        kinds[r.tensor_cores] = kinds.get(r.tensor_cores, 0) + 1
    return dict(configs=len(reports), by_mechanism=by_mech, tensor_cores=kinds,
                failing=sum(not r.ok for r in reports), max_registers=max((r.registers for r in reports), default=0),
                max_shared=max((r.shared_bytes for r in reports), default=0),
                at_255=sum(r.registers >= 255 for r in reports),
                perf_notes=sorted({r.id for r in reports if r.perf_notes}))


DOCS_BEGIN = "<!-- static-sm90: generated by `make static` from bench/static_sm90.json; do not edit -->"
DOCS_END = "<!-- /static-sm90 -->"


def docs_section(reports: Sequence[StaticReport], triton_version: str | None = None) -> str:
    """The static section of docs/benchmarks.md, from the table alone (empty without one)."""
    if not reports:
        return ""
    if triton_version is None and TABLE_PATH.exists():
        triton_version = json.loads(TABLE_PATH.read_text()).get("triton", "?")
    t = totals(reports)
    kinds = t["tensor_cores"]
    per_mech = ", ".join(f"{m} {n}" for m, n in t["by_mechanism"].items())
    near = sorted({f"{r.mechanism}.{r.kernel}" for r in reports if r.registers >= 255})
    lines = [
        f"Triton {triton_version}, target {TARGET_LABEL}: {t['configs']:,} configurations ({per_mech}); "
        f"{t['failing']} with spills, stack, shared memory over 227 KB or a compile error. Largest shared "
        f"memory {t['max_shared'] / 1024:.1f} KB; most registers {t['max_registers']}.",
        "",
        "Tensor cores, per configuration: " + ", ".join(
            f"{kinds.get(k, 0)} {label}" for k, label in (
                ("HGMMA", "HGMMA (Hopper wgmma)"), ("HMMA", "HMMA (mma.sync, pre-Hopper)"),
                ("FMA", "FMA (`tl.dot` on CUDA cores: fp32 with exact \"ieee\" products)"),
                ("-", "without `tl.dot`"))) + ".",
        "",
        "CTAs/SM: blocks one SM holds at once given registers (65,536 per SM, allocated 256 per warp), "
        "shared memory (228 KB per SM, 1 KB reserved per block) and warps (64 per SM, 32 blocks at most); "
        "occupancy is resident warps over 64. Ranges span the configurations of a row (head dims, masks, "
        "flags).",
        "",
        summary_markdown(reports),
        "",
    ]
    notes = sorted({f"`{r.mechanism}.{r.kernel}`: {r.perf_notes}" for r in reports if r.perf_notes})
    if notes:
        lines += ["ptxas performance notes:", ""] + [f"- {n}" for n in notes] + [""]
    else:
        lines += ["ptxas printed no \"Potential Performance Loss\" note for any configuration.", ""]
    if near:
        lines += [f"At 255 registers without spilling in {t['at_255']} configurations ({', '.join(near)}): "
                  "a different Triton or ptxas could tip them into spills; the check will say so.", ""]
    return "\n".join(lines)


def update_docs(path: Path, reports: Sequence[StaticReport]) -> bool:
    """Replace the generated static section of ``path``; True if it changed."""
    text = Path(path).read_text()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ValueError(f"{path} has no {DOCS_BEGIN!r} ... {DOCS_END!r} section")
    head, rest = text.split(DOCS_BEGIN, 1)
    tail = rest.split(DOCS_END, 1)[1]
    new = f"{head}{DOCS_BEGIN}\n{docs_section(reports).strip()}\n{DOCS_END}{tail}"
    Path(path).write_text(new)
    return new != text


def main(argv: Sequence[str] | None = None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the static check compiles real kernels", file=sys.stderr)
        return 2
    from laminae.triton_ops.tour import MECHANISMS

    p = argparse.ArgumentParser(prog="python -m bench.static_sm90", description=__doc__.split("\n\n")[0])
    p.add_argument("stems", nargs="*", help=f"mechanisms (default: all of {MECHANISMS})")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--table", action="store_true", help="print every configuration (markdown)")
    p.add_argument("--write", action="store_true", help="rewrite the committed table with this run")
    p.add_argument("--force", action="store_true", help="compile every configuration, ignoring the table")
    p.add_argument("--strict", action="store_true", help="a stale table fails the check too")
    p.add_argument("--workers", type=int, default=None, help="compile processes (default: one per core)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.stems) - set(MECHANISMS))
    if unknown:
        p.error(f"unknown mechanisms {unknown}; add them to tour.MECHANISMS")
    stems = args.stems or MECHANISMS
    result = check(stems, workers=args.workers, force=args.force, write=args.write, all_stems=not args.stems)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        if args.table:
            print(markdown(result.reports))
        print(result.summary())
    failed = bool(result.problems) or bool(result.unmet) or (args.strict and result.stale)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
