"""The cast policy (docs/protocol.md): every block casts through the shared helpers of
``primitives/_validation.py`` (``match_activation_dtypes``, ``check_param_dtype``,
``without_autocast``) and none by hand. A scan of the source of every module class
under primitives/ fails an autocast switched off by hand, an input's dtype compared by
hand with a parameter's (``check_param_dtype`` is the one check), and a tensor cast to
the module's own parameter dtype (``x.to(self.proj.weight.dtype)``, ``x.type_as(self.w)``,
``x.to(next(self.parameters()).dtype)``, or through a local bound to such a parameter),
which silently turns a wrong-dtype input into a right one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import laminae.primitives as primitives

ROOT = Path(primitives.__file__).resolve().parent
HELPERS = ROOT / "_validation.py"          # where the one autocast switch lives

# (file relative to primitives/, Class.method, what) → why the cast is not an activation cast
ALLOWED: dict[tuple[str, str, str], str] = {
    ("spelling_bee.py", "SpellingBeeEmbedding.bake_inference_table",
     "spelling_vectors(ids, weight, self.byte_ids, self.byte_len, **self._options()).to(weight.dtype)"):
        "stores a table computed from the parameters alone in their dtype (no activation is cast)",
}


def _self_chain(node: ast.AST, params: set[str]) -> bool:
    """``self.a.b…`` or ``next(self.parameters())``, or a local bound to one of them."""
    while isinstance(node, ast.Attribute) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                                              and node.func.attr in ("parameters", "buffers")):
        node = node.value if isinstance(node, ast.Attribute) else node.func.value
    if isinstance(node, ast.Name):
        return node.id == "self" or node.id in params
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "next"
            and len(node.args) == 1 and _self_chain(node.args[0], params))


def _param_dtype(node: ast.AST, params: set[str]) -> bool:
    """``<self chain>.dtype``."""
    return isinstance(node, ast.Attribute) and node.attr == "dtype" and _self_chain(node.value, params)


def _autocast_off(call: ast.Call) -> bool:
    name = ast.unparse(call.func)
    return name.endswith("autocast") and any(
        kw.arg == "enabled" and isinstance(kw.value, ast.Constant) and kw.value.value is False
        for kw in call.keywords)


def hand_casts(source: str) -> list[tuple[str, str]]:
    """``(Class.method or <module>, the offending expression)`` for each hand cast in
    ``source``: an autocast switched off by hand anywhere, and, in the methods of a class
    that has a ``forward``, a cast to the module's own parameter dtype."""
    tree = ast.parse(source)
    found = [("<module>", ast.unparse(n)) for n in ast.walk(tree) if isinstance(n, ast.Call) and _autocast_off(n)]
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        methods = [f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        if not any(f.name == "forward" for f in methods):
            continue
        for fn in methods:
            params: set[str] = set()
            for node in ast.walk(fn):
                if (isinstance(node, ast.Assign) and len(node.targets) == 1
                        and isinstance(node.targets[0], ast.Name) and _self_chain(node.value, set())
                        and isinstance(node.value, (ast.Attribute, ast.Call))):
                    params.add(node.targets[0].id)
            for node in ast.walk(fn):
                if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
                    sides = (node.left, node.comparators[0])
                    if any(_param_dtype(a, params) for a in sides) and all(
                            isinstance(a, ast.Attribute) and a.attr == "dtype" for a in sides):
                        found.append((f"{cls.name}.{fn.name}", ast.unparse(node)))
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                args = list(node.args) + [kw.value for kw in node.keywords if kw.arg == "dtype"]
                if ((node.func.attr in ("to", "type") and any(_param_dtype(a, params) for a in args))
                        or (node.func.attr == "type_as" and any(_self_chain(a, params) for a in node.args))):
                    found.append((f"{cls.name}.{fn.name}", ast.unparse(node)))
    return found


def _sources() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p != HELPERS)


def test_no_block_casts_by_hand():
    seen, bad = set(), []
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        for where, expr in hand_casts(path.read_text()):
            seen.add((rel, where, expr))
            if (rel, where, expr) not in ALLOWED:
                bad.append(f"{rel}: {where}: {expr}")
    assert not bad, ("cast by hand instead of through match_activation_dtypes / check_param_dtype / "
                     "without_autocast:\n  " + "\n  ".join(bad))
    stale = set(ALLOWED) - seen
    assert not stale, f"allow-list entries that no longer match anything: {sorted(stale)}"


PLANTED = [
    ("autocast off by hand", """
import torch
class Block(torch.nn.Module):
    def forward(self, x):
        with torch.autocast(device_type=x.device.type, enabled=False):
            return x
"""),
    ("input cast to a weight's dtype", """
class Block(nn.Module):
    def forward(self, x):
        return self.proj(x.to(self.proj.weight.dtype))
"""),
    ("cast through a local bound to a parameter", """
class Block(nn.Module):
    def forward(self, x):
        w = self.weight
        return x.to(dtype=w.dtype) @ w
"""),
    ("dtype check written by hand", """
class Block(nn.Module):
    def forward(self, x):
        if x.dtype != self.proj.weight.dtype:
            raise DTypeError("x")
        return self.proj(x)
"""),
    ("type_as a parameter", """
class Block(nn.Module):
    def forward(self, x):
        return x.type_as(self.gate) * self.gate
"""),
    ("cast to the first parameter's dtype", """
class Block(nn.Module):
    def _inner(self, x):
        return x.to(next(self.parameters()).dtype)
    def forward(self, x):
        return self._inner(x)
"""),
]


@pytest.mark.parametrize("case, source", PLANTED, ids=[c for c, _ in PLANTED])
def test_the_scan_finds_a_planted_hand_cast(case, source):
    assert hand_casts(source), case


def test_the_scan_passes_the_shared_helpers_and_casts_back_to_the_input_dtype():
    source = """
class Block(nn.Module):
    def forward(self, x, y):
        check_param_dtype("x", x, self.proj.weight)
        x, y = match_activation_dtypes(x=x, y=y)
        with without_autocast(x.device.type):
            out = self.proj(x.float()) + y
        return out.to(x.dtype)
"""
    assert hand_casts(source) == []
