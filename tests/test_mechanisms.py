"""Every declared mechanism (primitives/_mechanisms.py) is complete, and nothing that
looks like a mechanism goes undeclared: its module with the declared names, its
kernels with the declared ops, tour case and static cases, its two test files, its
benchmark, its page, and its row in README.md's and docs/index.md's tables (title and
link as declared, in the declared order)."""
from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from laminae.primitives import _mechanisms
from laminae.primitives._mechanisms import KINDS, MECHANISMS, Mechanism

ROOT = Path(__file__).resolve().parents[1]
# the two tables a reader finds the mechanisms in, and where their links point from there
TABLES = {"README.md": "docs/mechanisms", "docs/index.md": "mechanisms"}
ROW = re.compile(r"^\| `(\w+)` \| (.+) \| \[(\w+)\]\(((?:docs/)?mechanisms/\w+\.md)\) \|$")   # not the recipes


def _row(mechanism: Mechanism, pages: str) -> str:
    return f"| `{mechanism.stem}` | {mechanism.title} | [{mechanism.stem}]({pages}/{mechanism.stem}.md) |"


def _rows(table: str) -> list[str]:
    return [line for line in (ROOT / table).read_text().splitlines() if ROW.match(line)]


def _public(module) -> set[str]:
    return set(getattr(module, "__all__", ()))


def missing_pieces(mechanism: Mechanism, root: Path = ROOT) -> list[str]:
    """What a declared mechanism lacks; empty when it is complete."""
    stem, missing = mechanism.stem, []
    files = [f"primitives/{stem}.py", f"triton_ops/{stem}.py", f"tests/primitives/test_{stem}.py",
             f"tests/triton_ops/test_{stem}.py", f"bench/test_{stem}.py", f"docs/mechanisms/{stem}.md"]
    missing += [f"file {f}" for f in files if not (root / f).is_file()]
    if not mechanism.modules or not mechanism.references or not mechanism.ops:
        missing.append("a module, a reference and an op declared")
    missing += [f"kind {kind!r} of {name}" for name, kind in mechanism.modules.items() if kind not in KINDS]
    missing += [f"reference named *_reference: {r}" for r in mechanism.references if not r.endswith("_reference")]
    if (root / f"primitives/{stem}.py").is_file():
        module = importlib.import_module(f"laminae.primitives.{stem}")
        missing += [f"laminae.primitives.{stem}.{name} (in its __all__)" for name in mechanism.names
                    if name not in _public(module) or not hasattr(module, name)]
        classes = {name for name in _public(module)
                   if isinstance(getattr(module, name, None), type) and issubclass(getattr(module, name), torch.nn.Module)}
        missing += [f"a declaration of the module {name}" for name in sorted(classes - set(mechanism.modules))]
    if (root / f"triton_ops/{stem}.py").is_file():
        kernels = importlib.import_module(f"laminae.triton_ops.{stem}")
        missing += [f"laminae.triton_ops.{stem}.{name}" for name in (*mechanism.ops, "tour_case", "static_cases")
                    if not callable(getattr(kernels, name, None))]
    for table, pages in TABLES.items():
        if _row(mechanism, pages) not in _rows(table) and (root / table).is_file():
            missing.append(f"the row {_row(mechanism, pages)!r} in {table}")
    return missing


@pytest.mark.parametrize("mechanism", MECHANISMS, ids=lambda m: m.stem)
def test_every_declared_mechanism_is_complete(mechanism):
    assert not missing_pieces(mechanism), missing_pieces(mechanism)


def test_a_declaration_without_its_pieces_fails(monkeypatch):
    """The check finds every missing piece of a declared stem (here a stem nobody wrote),
    and of a real one that lost a piece: its page, or a declared op."""
    fake = Mechanism("nothing_here", "a mechanism nobody wrote", {"Nothing": "sequence block"},
                     ("nothing_here_reference",), ("nothing_here",))
    missing = missing_pieces(fake)
    assert sum(m.startswith("file ") for m in missing) == 6 and len(missing) == 8, missing
    laurel = _mechanisms.BY_STEM["laurel"]
    assert missing_pieces(dataclasses.replace(laurel, ops=("laurel", "laurel_twice"))) == [
        "laminae.triton_ops.laurel.laurel_twice"]
    assert missing_pieces(dataclasses.replace(laurel, title="LAuReL")) == [
        f"the row {_row(dataclasses.replace(laurel, title='LAuReL'), p)!r} in {t}" for t, p in TABLES.items()]
    assert missing_pieces(dataclasses.replace(laurel, modules={"LAuReL": "position-wise block"})) == [
        "a declaration of the module LAuReLBlock"]
    monkeypatch.setattr(Path, "is_file", lambda self: not self.name.endswith("laurel.md") and Path.exists(self))
    assert missing_pieces(laurel) == ["file docs/mechanisms/laurel.md"]


def test_nothing_that_looks_like_a_mechanism_is_undeclared():
    """A mechanism's file, page or table row without a declaration fails; the tables list
    the declared mechanisms in the declared order."""
    stems = [m.stem for m in MECHANISMS]
    assert len(set(stems)) == len(stems)
    for folder in ("primitives", "triton_ops", "docs/mechanisms"):
        found = {p.stem for p in (ROOT / folder).iterdir() if p.suffix in (".py", ".md") and not p.name[0] == "_"}
        assert found - {"tour", "testing"} == set(stems), folder
    for table, pages in TABLES.items():
        assert _rows(table) == [_row(m, pages) for m in MECHANISMS], f"{table}: one row per declaration, in order"


def test_exports_tour_and_test_lists_are_derived_from_the_declarations():
    import laminae.primitives as primitives
    import laminae.triton_ops as ops
    from laminae.triton_ops.tour import MECHANISMS as TOUR

    from . import _blocks, _mechanisms as cases, test_walkthrough

    declared = [name for m in MECHANISMS for name in m.names]
    assert set(declared) <= set(primitives.__all__) and len(primitives.__all__) == len(set(primitives.__all__))
    assert set(ops.__all__) == {op for m in MECHANISMS for op in m.ops} | {"flash_attention"}
    stems = [m.stem for m in MECHANISMS]
    assert TOUR == stems and [c.stem for c in cases.CASES] == stems
    assert [b.name for b in _blocks.BLOCKS if b not in _blocks.LAYERS] == [m.stem for m in MECHANISMS if m.decoding]
    assert set(test_walkthrough.WIRED) == set(stems)


def test_deriving_from_the_declarations_imports_no_triton():
    """The exports and the tour's list are read without loading a kernel: triton must
    still be importable after ``TRITON_INTERPRET`` is set (and costs nothing until used)."""
    code = ("import sys, laminae.primitives, laminae.triton_ops, laminae.triton_ops.tour; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
