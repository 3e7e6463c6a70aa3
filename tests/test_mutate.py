"""scripts/mutate.py on a tiny fake repository: mutants land in a scratch copy that is
what the tests import (never the working tree), each outcome is classified, a stale
mutant is reported, and only the stem's cases of the shared files run."""
import importlib.util
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
mutate = importlib.util.module_from_spec(_spec)
sys.modules["mutate"] = mutate       # dataclasses resolve the module's annotations through it
_spec.loader.exec_module(mutate)

MODULE = textwrap.dedent("""\
    def add(a, b):
        return a + b


    def untested(a):
        return a * 2
""")

MUTANTS = textwrap.dedent('''\
    [[mutant]]
    file = "pkg/fake.py"
    old = "return a + b"
    new = "return a - b"

    [[mutant]]
    file = "pkg/fake.py"
    old = "return a * 2"
    new = "return a * 3"
    why = "no test calls it"

    [[mutant]]
    file = "pkg/fake.py"
    old = "return a + b"
    new = "return b + a"
    equivalent = "addition commutes"

    [[mutant]]
    file = "pkg/fake.py"
    old = "return a ** b"
    new = "return a"
''')


def _fake_repository(root: pathlib.Path) -> None:
    files = {
        "pyproject.toml": '[tool.setuptools]\npackage-dir = { "laminae" = "pkg", "laminae.triton_ops" = "pkg" }\n',
        "pkg/__init__.py": "",
        "pkg/fake.py": MODULE,
        "tests/__init__.py": "",
        "tests/triton_ops/__init__.py": "",
        "tests/triton_ops/test_fake.py": "from laminae.fake import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
        # a shared file: only the cases naming the stem may run
        "tests/triton_ops/test_float64_truth.py":
            "import pytest\n\n\n@pytest.mark.parametrize('stem', ['fake', 'other'])\n"
            "def test_truth(stem):\n    assert stem == 'fake'\n",
        "scripts/mutants/fake.toml": MUTANTS,
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)


def test_outcomes_on_a_fake_repository(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")   # the fake's runs need no plugin: faster
    _fake_repository(tmp_path)
    out = tmp_path / "out.json"
    status = mutate.main(["fake", "--root", str(tmp_path), "--json", str(out), "--timeout", "120"])
    result = json.loads(out.read_text())["fake"]
    assert [o["status"] for o in result["outcomes"]] == ["caught", "survived", "equivalent", "stale"]
    assert result["score"] == {"caught": 1, "survived": 1, "equivalent": 1, "stale": 1, "score": 50.0}
    assert status == 1                                   # a survivor and a stale mutant fail the run
    assert (tmp_path / "pkg" / "fake.py").read_text() == MODULE   # the working tree is never written
    printed = capsys.readouterr().out
    assert "STALE: fake-4" in printed and "SURVIVED: fake-2" in printed


def test_check_reports_stale_mutants_without_running(tmp_path, capsys):
    _fake_repository(tmp_path)
    assert mutate.main(["fake", "--check", "--root", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines() == ["STALE: fake-4 pkg/fake.py: old text not found", "fake: checked"]
    (tmp_path / "scripts" / "mutants" / "fake.toml").write_text(MUTANTS.split("\n\n[[mutant]]")[0])
    assert mutate.main(["fake", "--check", "--root", str(tmp_path)]) == 0


def test_planting_text():
    mutant = mutate.Mutant("m", "f.py", old="x", new="y")
    assert mutate.mutated_text("axbxc", mutant)[0] is None          # ambiguous without occurrence
    mutant.occurrence = 2
    assert mutate.mutated_text("axbxc", mutant)[0] == "axbyc"
    mutant.occurrence = 3
    assert mutate.mutated_text("axbxc", mutant)[0] is None
    assert mutate.mutated_text("abc", mutate.Mutant("m", "f.py", old="z", new="y"))[1] == "old text not found"


def test_no_mutant_is_stale():
    """Every mutant's text is still in its file (once, or at its ``occurrence``): a
    kernel rewritten without its list following fails here, not only when someone next
    runs the script (two of affine-scaled attention's went stale that way)."""
    stale = []
    for path in sorted((ROOT / "scripts" / "mutants").glob("*.toml")):
        for m in mutate.load_plan(path.stem).mutants:
            text = (ROOT / m.file).read_text()
            planted, why = mutate.mutated_text(text, m)
            if planted is None:
                stale.append(f"{m.id} ({m.file}): {why}")
    assert not stale, "mutants whose text is no longer in the code:\n" + "\n".join(stale)


def test_every_mechanism_has_a_list():
    from laminae.triton_ops.tour import MECHANISMS

    missing = [s for s in MECHANISMS if not (ROOT / "scripts" / "mutants" / f"{s}.toml").exists()]
    assert not missing, f"mechanisms without a mutant list in scripts/mutants: {missing}"
    for stem in MECHANISMS:
        plan = mutate.load_plan(stem)
        assert len(plan.mutants) >= 5, f"{stem}: {len(plan.mutants)} mutants, want at least 5"
        assert all((ROOT / m.file).is_file() for m in plan.mutants), stem
