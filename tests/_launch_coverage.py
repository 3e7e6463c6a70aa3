"""Which launch configurations the suite executes under the interpreter, against
every configuration the CUDA path can launch (each kernel's ``static_cases()``).

A bug that lives only in a 16-bit tile configuration ships green if the suite never
runs that configuration, so ``pytest --launch-coverage`` (``make test`` passes it)
records every interpreted launch and fails the session when a configuration is never
executed. A configuration is (kernel, dtype of its floating-point pointers, its
constexprs) with two kinds of constexpr left out:

- widths (``WIDTHS``): block sizes that follow from the problem's dimensions (the
  power of two a whole row, head dim or group is held in, and the rows that fill a
  fixed-size register tile with it); any width runs the same operations, masked;
- ``num_warps``/``num_stages``: the interpreter runs a program as one thread.

Each process writes what it launched to ``$LAMINAE_LAUNCH_DIR`` (one file per
pytest-xdist worker); the controller reads them all at the end.
"""
from __future__ import annotations

import inspect
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]

# Constexprs that only size a block from the problem's dimensions (see the module docstring).
WIDTHS = {
    "siamese_norm": {"BLOCK_D", "BLOCK_C"},
    "hrm_refinement": {"BLOCK_D", "BLOCK"},
    "xsa": {"BLOCK_R", "BLOCK_G", "BLOCK_D"},      # rows x group x head dim of one register tile
    "stack_memory": {"BLOCK_R", "BLOCK_S", "BLOCK_D", "BLOCK_W"},  # slots x head width (+1), rows to fill it
    "lucid_attention": {"BLOCK_D"},
}

# Configurations of the mechanisms whose kernels are being rebuilt that no test ran when
# this check was written (one "stem: configuration" a line): the rebuilt kernels' own
# tests run every configuration they declare, and a configuration not on the list fails.
ALLOWLIST = Path(__file__).with_name("launch_coverage_allowlist.txt")


def allowed() -> set[str]:
    if not ALLOWLIST.exists():
        return set()
    return {line.strip() for line in ALLOWLIST.read_text().splitlines() if line.strip() and not line.startswith("#")}


_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "bool": "i1", "int8": "i8", "uint8": "u8",
           "int16": "i16", "int32": "i32", "int64": "i64"}

_launches: set = set()
_signatures: dict = {}


def _python_fn(kernel):
    while hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


def _fn_id(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def install() -> None:
    """Record (kernel, constexprs, pointer dtypes) of every interpreted launch."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run
    if getattr(original, "_records_launches", False):
        return

    def run(self, *args, **kwargs):
        try:
            sig = _signatures.get(self.fn)
            if sig is None:
                sig = _signatures[self.fn] = inspect.signature(self.fn)
            params = sig.parameters
            bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
            const, ptrs = [], []
            for k, v in bound.arguments.items():
                if "constexpr" in str(params[k].annotation):
                    const.append((k, repr(v)))
                elif hasattr(v, "dtype") and hasattr(v, "data_ptr"):
                    ptrs.append((k, str(v.dtype).removeprefix("torch.")))
            _launches.add((_fn_id(self.fn), tuple(sorted(const)), tuple(sorted(ptrs))))
        except Exception:  # recording must never change what a test sees
            pass
        return original(self, *args, **kwargs)

    run._records_launches = True
    InterpretedFunction.run = run


def write(directory: str, worker: str) -> None:
    path = Path(directory) / f"launches-{worker}.json"
    path.write_text(json.dumps(sorted([fn, list(c), list(p)] for fn, c, p in _launches)))


def read(directory: str) -> list:
    out = []
    for path in Path(directory).glob("launches-*.json"):
        out += [(fn, dict(map(tuple, c)), dict(map(tuple, p))) for fn, c, p in json.loads(path.read_text())]
    return out


def configuration(stem: str, case) -> tuple:
    """The coverage unit of one static case: (kernel, dtype, constexprs that pick code)."""
    skip = WIDTHS.get(stem, set())
    const = tuple(sorted((k, repr(v)) for k, v in case.constexprs.items() if k not in skip))
    floats = sorted({t[1:] for t in case.signature.values() if t in ("*fp32", "*bf16", "*fp16")})
    return case.name, "/".join(floats), const


def static_configurations(stems=None) -> dict:
    """stem -> {configuration: [the static cases it stands for]}."""
    if str(_ROOT) not in sys.path:
        sys.path.insert(0, str(_ROOT))
    from bench import static_sm90
    from laminae.triton_ops.tour import MECHANISMS

    out = {}
    for stem in stems or MECHANISMS:
        groups = defaultdict(list)
        for case in static_sm90.cases_of(stem):
            groups[configuration(stem, case)].append(case)
        out[stem] = dict(groups)
    return out


def _executes(case, skip: set, launch) -> bool:
    _, const, ptrs = launch
    if any(const.get(k) != repr(v) for k, v in case.constexprs.items() if k not in skip):
        return False
    return all(f"*{_DTYPES.get(ptrs[k], ptrs[k])}" == t for k, t in case.signature.items()
               if t.startswith("*") and k in ptrs)


def coverage(launches: list, stems=None) -> dict:
    """stem -> (executed configurations, all configurations, the names of those never executed)."""
    by_fn = defaultdict(list)
    for launch in launches:
        by_fn[launch[0]].append(launch)
    out = {}
    for stem, groups in static_configurations(stems).items():
        skip = WIDTHS.get(stem, set())
        missing = []
        for key, cases in groups.items():
            if not any(_executes(case, skip, launch) for case in cases
                       for launch in by_fn[_fn_id(_python_fn(case.kernel))]):
                missing.append(f"{key[0]}[{key[1]}: " + ",".join(f"{k}={v}" for k, v in key[2]) + "]")
        out[stem] = (len(groups) - len(missing), len(groups), sorted(missing))
    return out


def summary(cov: dict, allow: set[str] | None = None) -> tuple[list[str], list[str]]:
    """(one line per stem, the configurations that fail the session): a configuration
    that never ran and is not allow-listed, and an allow-list line of a checked stem
    that names no configuration left unrun (it ran, or no longer exists), so the list
    only ever shrinks to what is really missing."""
    allow = allowed() if allow is None else allow
    lines, failures = [], []
    for stem, (done, total, missing) in cov.items():
        listed = [m for m in missing if f"{stem}: {m}" in allow]
        note = f" ({len(listed)} more on the allow-list)" if listed else ""
        lines.append(f"{stem:26s} {done:4d} / {total:4d} launch configurations executed{note}")
        failures += [f"{stem}: {m}" for m in missing if f"{stem}: {m}" not in allow]
        unrun = {f"{stem}: {m}" for m in missing}
        failures += [f"{line}  (allow-listed but not missing: delete the line)" for line in sorted(allow)
                     if line.startswith(f"{stem}: ") and line not in unrun]
    return lines, failures


def directory() -> str | None:
    return os.environ.get("LAMINAE_LAUNCH_DIR")
