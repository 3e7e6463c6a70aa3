"""The wheel alone is enough: built from this tree, installed without its dependencies
into a fresh virtual environment, it runs what the README and the docs advertise.

No download: the fresh environment finds torch, triton and the rest in the running
environment's site-packages through a ``.pth`` line. Such a line only adds the folder
to ``sys.path`` (the ``.pth`` files inside it, among them the running environment's
editable-install finder, are not processed), so ``laminae`` is the installed wheel's,
which the test asserts. Training runs with its default data and ``--backend triton``
without ``TRITON_INTERPRET`` in the environment (the trainer sets up the interpreter
on a machine without CUDA), and ``laminae-tour --recipes`` reads the packaged fixtures."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.packaging
# what a source tree holds besides the sources (a checkout's environments and outputs)
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
                                     ".pytest_cache", ".benchmarks", "runs", "results", "gpu-out", ".whl", ".gl")


def _run(cmd: list, cwd: Path, env: dict, timeout: int = 300) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} exited {done.returncode}:\n" \
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_installed_wheel_runs_what_the_docs_advertise(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = "1"
    source = tmp_path / "source"   # a copy, so no stale build/ folder can slip files into the wheel
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", tmp_path / "wheels", source], tmp_path, env)
    wheel = next((tmp_path / "wheels").glob("laminae-*.whl"))

    fresh = tmp_path / "fresh"
    _run([sys.executable, "-m", "venv", "--without-pip", fresh], tmp_path, env)
    python = fresh / "bin" / "python"
    fresh_site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           tmp_path, env).strip())
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
         tmp_path, env)
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (fresh_site / "_laminae_test_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))

    where = _run([python, "-c", "import importlib.metadata as m, laminae; print(laminae.__file__); "
                                "print(m.requires('laminae'))"], tmp_path, env)
    assert where.startswith(str(fresh_site)), where
    assert "safetensors>=0.4" in where   # training's checkpoints need it: a dependency, not an extra

    assert "--recipes" in _run([fresh / "bin" / "laminae-tour", "--help"], tmp_path, env)
    out = _run([python, "-m", "laminae.recipes.train", "--recipe", "shell_elastic", "--backend", "triton",
                "--steps", "1", "--batch-size", "1", "--seq-len", "8", "--set", "num_hidden_layers=1",
                "--out", tmp_path / "run"], tmp_path, env)
    assert "step     1  loss" in out and (tmp_path / "run" / "checkpoint.safetensors").exists(), out
    out = _run([fresh / "bin" / "laminae-tour", "--recipes", "spikewhale_off"], tmp_path, env)
    assert out.count("| ok") == 2, out
