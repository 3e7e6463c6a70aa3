"""Every kernel configuration compiles for sm_90 with no spills and shared memory
within one H200 block's budget. Runs on any machine: Triton compiles for a GPU
target without a GPU. A subprocess, because the suite's kernels are interpreted."""
import json
import os
import subprocess
import sys

import pytest

from laminae.triton_ops.tour import MECHANISMS


@pytest.mark.static
def test_every_kernel_configuration_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "laminae.triton_ops._static", "--json", *MECHANISMS],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.stdout.strip(), f"static check produced no output:\n{proc.stderr[-3000:]}"
    reports = json.loads(proc.stdout)
    assert {r["mechanism"] for r in reports} == set(MECHANISMS)
    bad = [f"{r['mechanism']}.{r['kernel']} [{r['config']}]: error={r['error']!r} stack={r['stack_bytes']} "
           f"spills={r['spill_stores']}/{r['spill_loads']} shared={r['shared_bytes']}" for r in reports if not r["ok"]]
    assert not bad, "kernels failing the sm_90 check:\n" + "\n".join(bad)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.static
def test_static_check_catches_a_bad_kernel(tmp_path):
    """The check itself can fail: a tl.dot with a 8-wide operand does not compile for sm_90."""
    src = tmp_path / "badkern.py"
    src.write_text(
        "import triton, triton.language as tl\n"
        "from laminae.triton_ops._common import StaticCase\n"
        "@triton.jit\n"
        "def k(a, o, B: tl.constexpr):\n"
        "    r = tl.arange(0, B)\n"
        "    x = tl.load(a + r[:, None] * B + r[None, :])\n"
        "    tl.store(o + r[:, None] * B + r[None, :], tl.dot(x, x))\n"
        "def static_cases():\n"
        "    yield StaticCase('bad', k, dict(a='*fp32', o='*fp32'), dict(B=8))\n"
    )
    code = ("import sys, laminae.triton_ops as t; sys.path.insert(0, %r); import badkern; "
            "sys.modules['laminae.triton_ops.badkern'] = badkern; "
            "from laminae.triton_ops._static import _compile_one; r = _compile_one(('badkern', 0)); "
            "print('OK' if r.ok else 'BAD:' + r.problems())" % str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.startswith("BAD:"), out.stdout + out.stderr[-2000:]
