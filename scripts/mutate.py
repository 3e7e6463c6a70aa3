#!/usr/bin/env python3
"""Plant small bugs in a mechanism, one at a time, and check that its tests catch each.

    python scripts/mutate.py stack_memory [more stems] [--jobs 1] [--only 3,7] [--json out.json]
    python scripts/mutate.py mosrah derf --check     # stale mutants only, no test run

A mutant list is ``scripts/mutants/<stem>.toml``: one ``[[mutant]]`` table per bug, with
``file`` (relative to the repository root), ``old`` (exact text that occurs exactly once
in that file, unless ``occurrence = n`` picks the n-th, counted from 1), ``new``, and
optionally ``why`` (what it breaks) and ``equivalent`` (the argument why no test can
catch it). A top-level ``tests`` list replaces the default selection; ``keyword_tests``
lists files of which only the cases naming the stem run (``keyword`` overrides the
stem there).

Mutants are planted in a scratch copy of the repository (the files ``git ls-files``
lists, copied as they are in the working tree, committed or not); the working tree is
never written. The copy is made importable as ``laminae`` by a ``sitecustomize`` put
first on ``PYTHONPATH`` that maps the package directories of the copy's pyproject.toml
in front of the editable install's finder, and every run checks that the modules it
imported came from the copy. Bytecode is not written, so a mutant of the same length as
the original can never run as a stale ``.pyc``.

Each mutant's outcome: ``caught`` (the selection failed, errored or timed out),
``survived``, ``equivalent`` (survived and argued equivalent), ``stale`` (its ``old``
text is not in the file, or is ambiguous: the list is out of date, which is reported
as loudly as a survivor). The score is caught / (caught + survived). Exit status 0 only
when nothing survived unargued and nothing is stale.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "scripts" / "mutants"

# Runs first in every Python process of a scratch run (PYTHONPATH): the scratch copy's
# packages win over the editable install, whose finder maps `laminae` to the working tree.
SITECUSTOMIZE = r'''
import importlib.abc, importlib.machinery, importlib.util, json, os, sys

_MAP = json.loads(os.environ["LAMINAE_MUTATE_MAP"])


class _ScratchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        where = _MAP.get(fullname)
        if where is None:
            return None
        init = os.path.join(where, "__init__.py")
        if os.path.exists(init):
            return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[where])
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [where]
        return spec


sys.meta_path.insert(0, _ScratchFinder())
'''

# A pytest plugin: in the files named in LAMINAE_MUTATE_KEYWORD, keep only the cases
# whose id names the stem (as `-k` would, but for those files only, in the same run).
PLUGIN = r'''
import json, os

_KEYWORD = json.loads(os.environ.get("LAMINAE_MUTATE_KEYWORD", "{}"))


def pytest_configure(config):
    # A mutant is caught when an example fails; shrinking that example through the
    # interpreter can take minutes and tells nothing more (the profile is otherwise kept).
    try:
        from hypothesis import Phase, settings
    except ImportError:
        return
    current = settings.default
    settings.register_profile("mutate", settings(current, phases=[p for p in current.phases if p != Phase.shrink]))
    settings.load_profile("mutate")


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        words = _KEYWORD.get(item.nodeid.split("::")[0])
        if words is None or any(w in item.nodeid.lower() for w in words):
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_sessionfinish(session, exitstatus):
    # every laminae module this run imported must come from the scratch copy
    import sys
    root = os.path.realpath(os.environ["LAMINAE_MUTATE_ROOT"])
    strays = sorted(name for name, mod in list(sys.modules.items())
                    if (name == "laminae" or name.startswith("laminae."))
                    and getattr(mod, "__file__", None)
                    and not os.path.realpath(mod.__file__).startswith(root + os.sep))
    if strays:
        print(f"\nmutate: modules imported from outside the scratch copy: {strays}")
        session.exitstatus = 99
'''


@dataclass
class Mutant:
    id: str
    file: str
    old: str
    new: str
    why: str = ""
    equivalent: str = ""
    occurrence: int = 0


@dataclass
class Outcome:
    id: str
    status: str            # caught / survived / equivalent / stale
    detail: str = ""
    seconds: float = 0.0
    mutant: dict = field(default_factory=dict)


@dataclass
class Plan:
    stem: str
    mutants: list
    tests: list
    keyword_tests: list
    keyword: list


def load_plan(stem: str, root: pathlib.Path = ROOT, mutants_dir: pathlib.Path | None = None) -> Plan:
    path = (mutants_dir or root / "scripts" / "mutants") / f"{stem}.toml"
    data = tomllib.loads(path.read_text())
    mutants = []
    for i, entry in enumerate(data.get("mutant", []), 1):
        unknown = set(entry) - {"file", "old", "new", "why", "equivalent", "occurrence", "name"}
        if unknown or not {"file", "old", "new"} <= set(entry):
            raise SystemExit(f"{path}: mutant {i}: needs file, old, new (unknown keys {sorted(unknown)})")
        if entry["old"] == entry["new"]:
            raise SystemExit(f"{path}: mutant {i}: old and new are the same text")
        mutants.append(Mutant(id=f"{stem}-{i}" + (f"-{entry['name']}" if "name" in entry else ""),
                              file=entry["file"], old=entry["old"], new=entry["new"], why=entry.get("why", ""),
                              equivalent=entry.get("equivalent", ""), occurrence=entry.get("occurrence", 0)))
    tests = data.get("tests", [f"tests/triton_ops/test_{stem}.py", f"tests/primitives/test_{stem}.py"])
    keyword_tests = data.get("keyword_tests", ["tests/triton_ops/test_float64_truth.py",
                                               "tests/triton_ops/test_single_key_rows.py"])
    keyword = data.get("keyword", [stem, stem.replace("_", " ")])
    keyword = [keyword] if isinstance(keyword, str) else keyword
    return Plan(stem, mutants, [t for t in tests if (root / t).exists()],
                [t for t in keyword_tests if (root / t).exists()], [k.lower() for k in keyword])


def mutated_text(text: str, mutant: Mutant) -> tuple[str | None, str]:
    """The file's text with the mutant planted, or None and why it does not apply."""
    count = text.count(mutant.old)
    if count == 0:
        return None, "old text not found"
    if mutant.occurrence:
        if mutant.occurrence > count:
            return None, f"occurrence {mutant.occurrence} asked, old text occurs {count} times"
        start = -1
        for _ in range(mutant.occurrence):
            start = text.index(mutant.old, start + 1)
    elif count > 1:
        return None, f"old text occurs {count} times (give occurrence = n)"
    else:
        start = text.index(mutant.old)
    return text[:start] + mutant.new + text[start + len(mutant.old):], ""


def repository_files(root: pathlib.Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, check=True, capture_output=True).stdout.decode()
    return [f for f in out.split("\0") if f and (root / f).is_file()]


def make_scratch(root: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A copy of the repository's files under into/repo and the import shims under into/site."""
    repo, site = into / "repo", into / "site"
    for rel in repository_files(root):
        dest = repo / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest)
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (site / "_laminae_mutate_plugin.py").write_text(PLUGIN)
    return repo


def package_map(repo: pathlib.Path) -> dict[str, str]:
    data = tomllib.loads((repo / "pyproject.toml").read_text())
    dirs = data["tool"]["setuptools"]["package-dir"]
    return {name: str((repo / where).resolve()) for name, where in dirs.items()}


def scratch_env(repo: pathlib.Path, plan: Plan) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo.parent / "site"), str(repo)]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["LAMINAE_MUTATE_MAP"] = json.dumps(package_map(repo))
    env["LAMINAE_MUTATE_ROOT"] = str(repo)
    env["LAMINAE_MUTATE_KEYWORD"] = json.dumps({t: plan.keyword for t in plan.keyword_tests})
    env.setdefault("HYPOTHESIS_PROFILE", "ci")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    return env


def run_selection(repo: pathlib.Path, plan: Plan, timeout: float | None) -> tuple[int | str, float, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "_laminae_mutate_plugin",
           "--rootdir", str(repo), *plan.tests, *plan.keyword_tests]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=repo, env=scratch_env(repo, plan), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - start, ""
    return done.returncode, time.perf_counter() - start, done.stdout + done.stderr


def summary_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1].strip("= ") if lines else ""


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0]
    return summary_line(output)


def try_mutant(repo: pathlib.Path, plan: Plan, mutant: Mutant, timeout: float | None) -> Outcome:
    target = repo / mutant.file
    if not target.is_file():
        return Outcome(mutant.id, "stale", f"{mutant.file}: no such file", mutant=asdict(mutant))
    original = target.read_text()
    text, why_not = mutated_text(original, mutant)
    if text is None:
        return Outcome(mutant.id, "stale", f"{mutant.file}: {why_not}", mutant=asdict(mutant))
    target.write_text(text)
    try:
        rc, seconds, output = run_selection(repo, plan, timeout)
    finally:
        target.write_text(original)
    if rc == 99:
        raise SystemExit(f"{mutant.id}: the run imported laminae from outside the scratch copy\n{output[-3000:]}")
    if rc == 0:
        status = "equivalent" if mutant.equivalent else "survived"
        return Outcome(mutant.id, status, summary_line(output), seconds, asdict(mutant))
    if rc == 5:
        raise SystemExit(f"{mutant.id}: the selection collected no tests\n{output[-3000:]}")
    if rc == "timeout":
        detail = "timed out"
    elif rc < 0:
        detail = f"crashed (signal {-rc})"
    else:
        detail = first_failure(output) if rc == 1 else f"exit {rc}: " + summary_line(output)
    return Outcome(mutant.id, "caught", detail, seconds, asdict(mutant))


def check_lists(stems: list[str], root: pathlib.Path) -> int:
    """Print every mutant whose ``old`` text no longer applies; 1 if any, else 0."""
    stale = 0
    for stem in stems:
        for mutant in load_plan(stem, root).mutants:
            target = root / mutant.file
            why = "no such file" if not target.is_file() else mutated_text(target.read_text(), mutant)[1]
            if why:
                stale += 1
                print(f"STALE: {mutant.id} {mutant.file}: {why}")
        print(f"{stem}: checked", flush=True)
    return 1 if stale else 0


def baseline(repo: pathlib.Path, plan: Plan) -> float:
    rc, seconds, output = run_selection(repo, plan, None)
    if rc != 0:
        raise SystemExit(f"{plan.stem}: the unmutated selection does not pass (exit {rc}); "
                         f"fix that first\n{output[-4000:]}")
    print(f"{plan.stem}: baseline {summary_line(output)} ({seconds:.0f} s): {' '.join(plan.tests + plan.keyword_tests)}"
          f" (-k {'/'.join(plan.keyword)} in the last {len(plan.keyword_tests)})", flush=True)
    return seconds


def run_stem(plan: Plan, jobs: int, root: pathlib.Path, timeout: float | None) -> list[Outcome]:
    with tempfile.TemporaryDirectory(prefix=f"mutate-{plan.stem}-") as tmp:
        repos = [make_scratch(root, pathlib.Path(tmp) / f"copy{j}") for j in range(max(1, jobs))]
        base = baseline(repos[0], plan)
        limit = timeout if timeout is not None else max(120.0, 5 * base)
        free = list(repos)
        outcomes: list[Outcome] = []

        def one(mutant: Mutant) -> Outcome:
            repo = free.pop()
            try:
                return try_mutant(repo, plan, mutant, limit)
            finally:
                free.append(repo)

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(repos)) as pool:
            for outcome in pool.map(one, plan.mutants):
                print(f"  {outcome.id:28s} {outcome.status:10s} {outcome.seconds:6.1f} s  {outcome.detail}", flush=True)
                outcomes.append(outcome)
        return outcomes


def score(outcomes: list[Outcome]) -> dict[str, int | float | None]:
    counts = {s: sum(o.status == s for o in outcomes) for s in ("caught", "survived", "equivalent", "stale")}
    judged = counts["caught"] + counts["survived"]
    counts["score"] = round(100 * counts["caught"] / judged, 1) if judged else None
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stems", nargs="+", help="mechanisms whose scripts/mutants/<stem>.toml to run")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy (default 1)")
    parser.add_argument("--only", default="", help="comma-separated mutant numbers to run (1-based)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per mutant before it counts as caught (default 5 x baseline, at least 120)")
    parser.add_argument("--json", type=pathlib.Path, help="write every outcome here")
    parser.add_argument("--check", action="store_true", help="only report stale mutants (no tests run)")
    parser.add_argument("--root", type=pathlib.Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.check:
        return check_lists(args.stems, root)
    results: dict[str, dict] = {}
    for stem in args.stems:
        plan = load_plan(stem, root)
        if args.only:
            wanted = {int(x) for x in args.only.split(",")}
            plan.mutants = [m for i, m in enumerate(plan.mutants, 1) if i in wanted]
        outcomes = run_stem(plan, args.jobs, root, args.timeout)
        results[stem] = {"score": score(outcomes), "outcomes": [asdict(o) for o in outcomes]}
    print("\nstem                      caught survived equivalent stale  score")
    bad = False
    for stem, result in results.items():
        s = result["score"]
        bad |= bool(s["survived"] or s["stale"])
        shown = "-" if s["score"] is None else f"{s['score']:.1f} %"
        print(f"{stem:25s} {s['caught']:6d} {s['survived']:8d} {s['equivalent']:10d} {s['stale']:5d}  {shown}")
        for o in result["outcomes"]:
            if o["status"] in ("survived", "stale"):
                print(f"  {o['status'].upper()}: {o['id']} {o['mutant']['file']}: {o['detail']}"
                      + (f" ({o['mutant']['why']})" if o["mutant"]["why"] else ""))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
