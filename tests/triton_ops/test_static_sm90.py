"""The static sm_90 check: every kernel configuration compiles for Hopper with no
spills and shared memory within one block's budget, read from the committed table
where nothing changed and compiled in the same run where something did.

Keys are computed in this (interpreted) process; compiles run in a subprocess
with ``TRITON_INTERPRET`` unset, because the suite's kernels are interpreted."""
import json
from dataclasses import replace as dataclasses_replace
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest

from laminae.triton_ops._common import StaticCase
from laminae.triton_ops.tour import MECHANISMS

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))

from bench import static_sm90 as _static  # noqa: E402  (tooling beside the package, run from the root)

_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
_OPS = _ROOT / "triton_ops"


def _report(d: dict) -> _static.StaticReport:
    rep = _static.StaticReport(**{k: v for k, v in d.items() if k in _static._FIELDS})
    rep.source = d.get("source", "compiled")
    return rep


@pytest.mark.static
def test_every_kernel_configuration_is_clean_on_sm90():
    jobs = _static.plan(MECHANISMS)
    table = _static.load_table()
    todo = sorted({j.stem for j in jobs if j.id not in table or table[j.id].key != j.key})
    reports = {j.id: table[j.id] for j in jobs if j.stem not in todo}
    compiled = 0
    if todo:  # something changed since `make static`: compile it now (only what changed)
        proc = subprocess.run([sys.executable, "-m", "bench.static_sm90", "--json", *todo],
                              capture_output=True, text=True, env=_ENV, cwd=_ROOT)
        assert proc.stdout.strip(), f"static check produced no output:\n{proc.stderr[-3000:]}"
        out = json.loads(proc.stdout)
        compiled = out["compiled"]
        reports.update({r["id"]: _report(r) for r in out["reports"]})
    assert set(reports) == {j.id for j in jobs}
    assert {r.mechanism for r in reports.values()} == set(MECHANISMS)
    bad = [f"{cid}: {r.problems()}" for cid, r in reports.items() if not r.ok]
    assert not bad, "kernels failing the sm_90 check:\n" + "\n".join(bad)
    unmet = _static.unmet_expectations(jobs, [reports[j.id] for j in jobs])
    assert not unmet, "kernels built without the tensor-core instructions they promise:\n" + "\n".join(unmet)
    gone = sorted(set(table) - set(reports))
    if compiled or gone:
        if os.environ.get("LAMINAE_STATIC_STRICT") == "1":
            pytest.fail(f"static sm_90 table is stale: run `make static` ({todo + gone})"[:2000])
        warnings.warn(f"static sm_90 table is stale ({compiled} configurations compiled in this run, "
                      f"{len(gone)} entries no longer launched, e.g. {(todo + gone)[:3]}): all clean, "
                      f"but run `make static` to refresh bench/static_sm90.json and the docs")


def test_docs_static_section_is_generated_from_the_table():
    text = (_ROOT / "docs" / "benchmarks.md").read_text()
    begin, end = _static.DOCS_BEGIN, _static.DOCS_END
    assert begin in text and end in text
    section = text[text.index(begin) + len(begin):text.index(end)]
    assert section.strip() == _static.docs_section(list(_static.load_table().values())).strip()


# ----------------------------------------------------------------------------
# Keys: what changes them and what does not
# ----------------------------------------------------------------------------


def _keys(stems):
    return {j.id: j.key for j in _static.plan(stems)}


def _edit_source(kernel, old: str, new: str):
    jit = _static._unwrap(kernel)
    original = jit.src
    assert original.count(old) == 1, old
    jit._unsafe_update_src(original.replace(old, new))
    return lambda: jit._unsafe_update_src(original)


_PROBE = textwrap.dedent("""
    import triton, triton.language as tl
    from laminae.triton_ops import _flash
    from laminae.triton_ops._common import StaticCase
    from laminae.triton_ops._flash import _visible

    @triton.jit
    def _local(rows, cols, mask_ptr):
        return _flash._visible(rows, cols, 4, 4, mask_ptr, 0, False)  # attribute access, one call down

    @triton.jit
    def by_name(mask_ptr, o_ptr):
        r = tl.arange(0, 16)
        tl.store(o_ptr + r, tl.sum(_visible(r, r, 4, 4, mask_ptr, 0, False).to(tl.int32), 1))

    @triton.jit
    def transitive(mask_ptr, o_ptr):
        r = tl.arange(0, 16)
        tl.store(o_ptr + r, tl.sum(_local(r, r, mask_ptr).to(tl.int32), 1))

    @triton.jit
    def unrelated(mask_ptr, o_ptr):
        tl.store(o_ptr + tl.arange(0, 16), 1)

    def static_cases():
        for name, k in (("by_name", by_name), ("transitive", transitive), ("unrelated", unrelated)):
            yield StaticCase(name, k, dict(mask_ptr="*i8", o_ptr="*i32"), {})
""")


def test_editing_a_shared_jit_helper_changes_the_key_of_every_kernel_that_calls_it(tmp_path):
    from laminae.triton_ops import _flash, derf

    (tmp_path / "probe.py").write_text(_PROBE)
    paths = {"probe": str(tmp_path / "probe.py")}
    stems = ["laurel", "derf", "affine_scaled_attention", "probe"]

    def keys():
        return {j.id: j.key for j in _static.plan(stems, paths)}

    before = keys()
    restore = _edit_source(_flash._visible, "keep = ", "keep = 0 + ")  # a helper in _flash.py
    try:
        after = keys()
    finally:
        restore()
    changed = {cid.split("[")[0] for cid in before if before[cid] != after[cid]}
    assert changed == {"probe/by_name", "probe/transitive", "affine_scaled_attention/flash_fwd",
                       "affine_scaled_attention/flash_bwd_dq", "affine_scaled_attention/flash_bwd_dkdv",
                       "affine_scaled_attention/flash_decode"}

    restore = _edit_source(derf._erf_plus_one_half, "1.0 + 0.5 * x", "1.0 + x * 0.5")  # in the kernel's own file
    try:
        after = keys()
    finally:
        restore()
    changed = {cid.split("[")[0] for cid in before if before[cid] != after[cid]}
    assert changed == {"derf/derf_fwd", "derf/derf_bwd_dkdv", "derf/derf_bwd_dq", "derf/derf_gate_fwd",
                       "derf/derf_gate_bwd"}
    assert keys() == before  # restored: the same keys again


def test_keys_depend_on_launch_settings_and_not_on_line_numbers():
    case = next(iter(_static.cases_of("laurel")))
    memo = {}
    key = _static.case_key(case, memo)
    import dataclasses

    assert _static.case_key(dataclasses.replace(case, num_stages=case.num_stages + 1), memo) != key
    assert _static.case_key(dataclasses.replace(case, num_warps=case.num_warps * 2), memo) != key
    assert _static.case_key(dataclasses.replace(case, constexprs={**case.constexprs, "BLOCK_M": 64}), memo) != key
    assert _static.case_key(dataclasses.replace(case, signature={**case.signature, "f_ptr": "*fp16"}), memo) != key
    jit = _static._unwrap(case.kernel)
    line = jit.starting_line_number
    try:
        jit.starting_line_number = line + 40
        assert _static.case_key(case, {}) == key
    finally:
        jit.starting_line_number = line


@pytest.mark.static
def test_keys_are_the_same_with_and_without_the_interpreter(edited_run):
    """The table is written by the compiler's process and read by this interpreted one."""
    assert edited_run["laurel_keys"] == _keys(["laurel"])


def test_static_case_defaults_are_tritons_launch_defaults():
    """A case that omits num_warps/num_stages must describe a launch that omits them."""
    from triton.backends.nvidia.compiler import CUDAOptions

    case = StaticCase("k", None, {}, {})
    assert (case.num_warps, case.num_stages) == (CUDAOptions.num_warps, CUDAOptions.num_stages)


# ----------------------------------------------------------------------------
# A changed kernel is recompiled and judged in the same run
# ----------------------------------------------------------------------------

_EDITED = textwrap.dedent("""
    import json, sys
    from bench import static_sm90 as _static
    copy, table, bad = sys.argv[1:4]
    entries = [r for r in _static.load_table().values() if r.mechanism == "derf"]
    for r in entries:
        r.mechanism = "derf_copy"
    entries.append(_static.StaticReport("derf_copy", "gone_kernel", "BLOCK=16,warps=4,stages=3", key="0"))
    _static.write_table(entries, table)
    res = _static.check(["derf_copy"], table_path=table, paths={"derf_copy": copy}, progress=None)
    job = _static.Job("badkern", 0, "badkern/bad", "", bad)
    laurel = {j.id: j.key for j in _static.plan(["laurel"])}
    print(json.dumps(dict(check=res.to_json(), summary=res.summary(), bad=_static.compile_case(job),
                          laurel_keys=laurel)))
""")


@pytest.fixture(scope="module")
def edited_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("static")
    src = (_OPS / "derf.py").read_text()
    fwd_old = "    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)\n"
    bwd_old = "    num_p = tl.num_programs(0)\n"
    assert src.count(fwd_old) == 1 and src.count(bwd_old) == 1
    src = src.replace(fwd_old, "    rows = tl.arange(0, BLOCK_R) + pid_r.to(tl.int64) * BLOCK_R\n")  # same math
    src = src.replace(bwd_old, bwd_old + '    tl.static_assert(BLOCK_F > 4096, "planted")\n')  # cannot compile
    (tmp / "derf_copy.py").write_text(src)
    (tmp / "badkern.py").write_text(textwrap.dedent("""
        import triton, triton.language as tl
        from laminae.triton_ops._common import StaticCase
        @triton.jit
        def k(a, o, B: tl.constexpr):
            r = tl.arange(0, B)
            x = tl.load(a + r[:, None] * B + r[None, :])
            tl.store(o + r[:, None] * B + r[None, :], tl.dot(x, x))
        def static_cases():
            yield StaticCase("bad", k, dict(a="*fp32", o="*fp32"), dict(B=8))
    """))
    out = subprocess.run([sys.executable, "-c", _EDITED, str(tmp / "derf_copy.py"), str(tmp / "t.json"),
                          str(tmp / "badkern.py")], capture_output=True, text=True, env=_ENV, cwd=_ROOT)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.static
def test_a_changed_kernel_is_recompiled_and_checked_in_the_same_run(edited_run):
    res = edited_run["check"]
    by_kernel: dict[str, set] = {}
    for r in res["reports"]:
        by_kernel.setdefault(r["kernel"], set()).add(r["source"])
    committed = _static.load_table()
    stale_in_derf = {j.id.replace("derf/", "derf_copy/") for j in _static.plan(["derf"])
                     if j.id not in committed or committed[j.id].key != j.key}
    compiled = {r["id"] for r in res["reports"] if r["source"] == "compiled"}
    edited = {r["id"] for r in res["reports"] if r["kernel"] in ("derf_gate_fwd", "derf_gate_bwd")}
    assert len(edited) == 6 and compiled == edited | stale_in_derf  # only the edited kernels compiled
    assert set(res["changed"]) >= edited
    ok = {r["id"]: r["ok"] for r in res["reports"]}
    assert all(ok[i] for i in edited if "gate_fwd" in i)  # changed and clean: passes
    assert not any(ok[i] for i in edited if "gate_bwd" in i)  # changed and broken: fails, named
    assert all("planted" in r["error"] for r in res["reports"] if r["kernel"] == "derf_gate_bwd")
    assert [c for c in res["orphaned"] if "gone_kernel" in c]
    assert "make static" in edited_run["summary"] and "FAIL derf_copy/derf_gate_bwd" in edited_run["summary"]


@pytest.mark.static
def test_the_check_catches_a_kernel_the_gpu_compiler_rejects(edited_run):
    """The interpreter runs a tl.dot with an 8-wide operand; sm_90 does not compile it."""
    bad = _report(edited_run["bad"])
    assert not bad.ok and bad.error


# ----------------------------------------------------------------------------
# What is read from ptxas and cuobjdump
# ----------------------------------------------------------------------------


def test_ctas_per_sm_from_registers_shared_memory_and_warps():
    assert _static.ctas_per_sm(255, 4, 0) == (2, "registers")  # 256 regs x 128 threads = 32K of 64K
    assert _static.ctas_per_sm(32, 4, 0) == (16, "warps")  # 64 warps / 4
    assert _static.ctas_per_sm(32, 1, 0) == (32, "blocks")
    assert _static.ctas_per_sm(64, 4, 100 * 1024) == (2, "shared")  # (100 KB + 1 KB) x 2 <= 228 KB
    assert _static.ctas_per_sm(64, 4, 113 * 1024) == (2, "shared")
    assert _static.ctas_per_sm(64, 4, 114 * 1024) == (1, "shared")
    assert _static.ctas_per_sm(64, 4, 228 * 1024)[0] == 0  # over a block's 227 KB: does not launch
    assert _static.ctas_per_sm(168, 8, 0) == (1, "registers")  # 168 x 256 threads = 43K


def test_a_case_that_expects_hgmma_fails_on_mma_sync():
    job = _static.Job("x", 0, "x/k[a]", "key", expect="HGMMA")
    hmma = _static.StaticReport("x", "k", "a", tensor_cores="HMMA")
    assert _static.unmet_expectations([job], [hmma]) == ["x/k[a]: expected HGMMA, got HMMA"]
    assert _static.unmet_expectations([job], [dataclasses_replace(hmma, tensor_cores="HGMMA")]) == []


def test_tensor_core_kind_from_sass():
    hopper = "        /*0a50*/  HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;\n   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;"
    assert _static.tensor_core_kind(hopper, 1) == ("HGMMA", "HGMMA.64x64x16.F32.BF16 HMMA.16816.F32.BF16")
    assert _static.tensor_core_kind("  HMMA.1688.F32.TF32 R4, R8, R12, R4 ;", 2)[0] == "HMMA"
    assert _static.tensor_core_kind("  FFMA R4, R8, R12, R4 ;", 1) == ("FMA", "")
    assert _static.tensor_core_kind("  FFMA R4, R8, R12, R4 ;", 0) == ("-", "")


def test_ptxas_performance_notes_and_spills_are_read():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
           "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized "
           "due to the presence of Extern calls in the function 'k'.\n"
           "ptxas info    : Function properties for k\n"
           "    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 8 bytes cumulative stack size\n")
    assert "C7515" in _static.perf_notes(log)
    assert _static.parse_ptxas(log) == dict(stack_bytes=8, spill_stores=12, spill_loads=16, registers=255)
    rep = _static.StaticReport("m", "k", "c", registers=255, stack_bytes=8, spill_stores=12, spill_loads=16,
                               shared_bytes=0)
    assert not rep.ok and "spills 12/16" in rep.problems()


# ----------------------------------------------------------------------------
# The parallel runner: a stuck compile fails with its name, never a busy machine
# ----------------------------------------------------------------------------


def _job(kind):
    import time

    if kind == "sleep":  # blocked: no CPU progress
        time.sleep(3600)
    if kind == "spin":  # busy forever
        while True:
            pass
    if kind == "die":
        os._exit(3)
    return {"done": kind}


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the watchdog reads /proc")
def test_parallel_runner_names_stuck_jobs_and_keeps_going():
    jobs = ["a", "sleep", "spin", "die", "b"]
    out = _static.run_parallel(jobs, _job, workers=2, name=lambda j: f"kernel-{j}", cpu_limit=1.0, stall_s=2.0,
                               poll_s=0.2)
    assert out[0] == {"done": "a"} and out[4] == {"done": "b"}
    assert "kernel-sleep" in out[1]["error"] and "no CPU progress" in out[1]["error"]
    assert "kernel-spin" in out[2]["error"] and "CPU seconds" in out[2]["error"]
    assert "kernel-die" in out[3]["error"] and "died" in out[3]["error"]


# ----------------------------------------------------------------------------
# The cases describe the launches the code really makes
# ----------------------------------------------------------------------------

_PTR = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "i8", "uint8": "u8", "int16": "i16", "int32": "i32",
        "int64": "i64", "bool": "i1"}


class _Launch(NamedTuple):
    fn: object
    const: dict
    ptrs: dict  # pointer argument -> dtype
    warps: int
    stages: int
    aligned: frozenset  # pointers at a 16-byte-aligned address
    ints16: frozenset  # integers that are multiples of 16


@pytest.fixture(scope="module")
def tour_launches():
    """Every launch of the tour (forward and backward of each mechanism), with what
    Triton's launcher would specialise as 16-divisible, and the static cases by kernel."""
    import inspect

    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from laminae.triton_ops._parity import _run

    launches = []
    original = InterpretedFunction.run
    execute = [False]

    def run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        bound = inspect.signature(self.fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
        runtime = {k: v for k, v in bound.arguments.items() if "constexpr" not in str(params[k].annotation)}
        launches.append(_Launch(
            self.fn, {k: v for k, v in bound.arguments.items() if "constexpr" in str(params[k].annotation)},
            {k: _PTR.get(str(v.dtype).removeprefix("torch."), "?") for k, v in runtime.items()
             if isinstance(v, torch.Tensor)},
            kwargs.get("num_warps", 4), kwargs.get("num_stages", 3),
            frozenset(k for k, v in runtime.items() if isinstance(v, torch.Tensor) and v.data_ptr() % 16 == 0),
            frozenset(k for k, v in runtime.items() if type(v) is int and v % 16 == 0)))
        if execute[0]:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    cases = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InterpretedFunction, "run", run)
        for stem in MECHANISMS:
            for case in _static.cases_of(stem):
                cases.setdefault(case.kernel.fn, []).append(case)
            module = __import__(f"laminae.triton_ops.{stem}", fromlist=["tour_case"])
            tours = module.tour_case(torch.device("cpu"))
            for tour in tours if isinstance(tours, (list, tuple)) else [tours]:
                # Launch settings follow from shapes and dtypes, so the kernels are skipped
                # (the interpreter would take minutes); a case whose host code trips over
                # the unwritten outputs runs again with the kernels.
                try:
                    execute[0] = False
                    _run(tour.op, tour.inputs, tour.grad_names, None, 0, None)
                except Exception:
                    execute[0] = True
                    _run(tour.op, tour.inputs, tour.grad_names, None, 0, None)
    assert launches
    return launches, cases


def _describes(case, launch: _Launch) -> bool:
    return (all(case.constexprs.get(k) == v for k, v in launch.const.items())
            and (case.num_warps, case.num_stages) == (launch.warps, launch.stages)
            and all(case.signature.get(k, f"*{d}") == f"*{d}" for k, d in launch.ptrs.items()))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records launches in the interpreter")
def test_static_cases_describe_the_launches_each_tour_case_makes(tour_launches):
    """Every launch of the tour is a static case: same kernel, constexprs, num_warps,
    num_stages (Triton's defaults where the launch passes none) and pointer dtypes. A
    case that lies about its launch would put the wrong compile in the table."""
    launches, cases = tour_launches
    lies = [f"{la.fn.__name__} {la.const} warps={la.warps} stages={la.stages} {la.ptrs}"
            for la in launches if not any(_describes(c, la) for c in cases.get(la.fn, []))]
    assert not lies, "launches no static case describes:\n" + "\n".join(sorted(set(lies)))


# Pointers a launch may pass as a view at an offset (a step of a stacked tensor, whose
# offset is a multiple of the varying row count; a q/k/v slice of a fused projection,
# taken with its strides), aligned for some inputs only: their cases do not declare them.
_OFFSET_VIEWS = {
    "derf._derf_fwd_kernel": {"q_ptr", "k_ptr", "v_ptr"},
    "derf._derf_bwd_dq_kernel": {"q_ptr", "k_ptr", "v_ptr", "do_ptr"},
    "derf._derf_bwd_dkdv_kernel": {"q_ptr", "k_ptr", "v_ptr", "do_ptr"},
    "derf._derf_bwd_delta_kernel": {"do_ptr"},
    "engram._engram_fwd_kernel": {f"t{i}" for i in range(8)},  # heads of a stacked [H, T, D] table
    "hrm_refinement._hrm_row_fwd_kernel": {"h_prev_ptr", "h_ptr", "rstd_ptr"},  # states[t], rstd[t]
    "hrm_refinement._hrm_row_bwd_kernel": {"h_ptr", "rstd_ptr", "g_ptr"},  # states[t], rstd[t], g_states[t]
    "hrm_refinement._silu_bwd_kernel": {"z_ptr", "rstd_ptr", "part_ptr"},  # z[t], rstd[t], gate_part[t]
}

# Kernels whose static cases do not yet declare every pointer their launch passes
# aligned (so the table holds a binary compiled without that specialisation): none.
_ALIGNMENT_PENDING: set[str] = set()


def _kernel_key(fn) -> str:
    return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records launches in the interpreter")
def test_static_cases_compile_the_alignment_each_tour_launch_gets(tour_launches):
    """Triton's launcher compiles a pointer at a 16-byte-aligned address as 16-divisible
    (and vectorises its loads), so the binary that runs differs from one compiled without
    ``divisible``: the cases of a kernel must declare every pointer its tour launch passed
    aligned, but for offset views (``_OFFSET_VIEWS``). Integers that are multiples of 16
    are named in the message only: at the tour's small shapes that says nothing about the
    shapes a case describes."""
    launches, cases = tour_launches
    missing = {}
    for la in launches:
        # the tour runs fp32 at small shapes, while some kernels declare alignment only
        # for the 16-bit configurations it never reaches: the cases of the launch that
        # declare anything, else every case of the kernel that does, are asked
        matching = [c for c in cases.get(la.fn, []) if _describes(c, la)]
        pool = [c for c in matching if c.divisible] or [c for c in cases.get(la.fn, []) if c.divisible]
        declared = set().union(*(c.divisible for c in pool)) if pool else set()
        key = _kernel_key(la.fn)
        need = la.aligned - _OFFSET_VIEWS.get(key, set())
        if matching and not need <= declared:
            missing[key] = (f"{key}: aligned pointers no case declares {sorted(need - declared)} "
                            f"(integers divisible by 16 at this launch: {sorted(la.ints16 - declared)})")
    new = sorted(v for k, v in missing.items() if k not in _ALIGNMENT_PENDING)
    assert not new, "static cases compiled without the alignment their launch has:\n" + "\n".join(new)
    launched = {_kernel_key(la.fn) for la in launches}
    done = sorted((_ALIGNMENT_PENDING & launched) - set(missing))
    assert not done, f"declare alignment now complete, take these off _ALIGNMENT_PENDING: {done}"
