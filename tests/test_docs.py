"""Every fenced ``python`` block in README.md and docs/**/*.md runs.

Pages are discovered, not listed, so a new mechanism page is tested the day it
lands. The blocks of one page run in order in one namespace (a later block may use
names from an earlier one), on CPU. A block that is an API sketch, not a program, is
marked with the HTML comment ``<!-- sketch -->`` on the line just above its fence;
it must still be valid Python, and its imports run (every name the docs import is
exported where they import it).
"""
import ast
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"(?P<marker><!--\s*sketch\s*-->\s*\n)?^```python[^\n]*\n(?P<code>.*?)^```", re.S | re.M)


def blocks(page: pathlib.Path):
    text = page.read_text()
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start("code")) + 1
        yield line, match.group("code"), bool(match.group("marker"))


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists() and any(blocks(p))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page):
    namespace = {"__name__": f"doc:{page.name}"}
    for line, code, sketch in blocks(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        compiled = compile(code, where, "exec")
        if sketch:
            imports = [node for node in ast.parse(code).body if isinstance(node, (ast.Import, ast.ImportFrom))]
            exec(compile(ast.Module(body=imports, type_ignores=[]), where, "exec"), {})  # noqa: S102
            continue
        torch.manual_seed(0)
        exec(compiled, namespace)  # noqa: S102 - the docs are this repository's own
