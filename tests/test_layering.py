"""The package's layers, checked from the source: offsim's imports run one way, core <- policies <- search <-
analysis <- cli, with no cycle between modules and no upward arrow; offsim never imports torch or offexec."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("offsim.core", "offsim.policies", "offsim.search", "offsim.analysis", "offsim.cli")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import of ``path``, relative imports resolved."""
    tree = ast.parse(path.read_text())
    me = _module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out.append((base, id(node) in top))
    return out


def _layer(mod: str) -> int | None:
    for i, prefix in enumerate(LAYERS):
        if mod == prefix or mod.startswith(prefix + "."):
            return i
    return None


MODULES = sorted((ROOT / "offsim").rglob("*.py"))


def test_every_offsim_module_is_in_a_layer():
    loose = [_module_name(p) for p in MODULES if _layer(_module_name(p)) is None and _module_name(p) != "offsim"]
    assert not loose, f"modules outside the layers {LAYERS}: {loose}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_imports_point_down_only(path):
    me = _module_name(path)
    mine = _layer(me)
    for mod, _ in _imports(path):
        assert not mod.split(".")[0] in ("torch", "offexec", "experiments"), f"{me} imports {mod}"
        theirs = _layer(mod)
        if mine is None or theirs is None:
            continue  # the package facade (offsim/__init__) may import from any layer
        assert theirs <= mine, f"{me} (layer {LAYERS[mine]}) imports {mod} (layer {LAYERS[theirs]}): an upward arrow"


def test_no_import_cycles_between_modules():
    """Module-level imports of offsim modules form a DAG (function-level imports are checked for direction above)."""
    names = {_module_name(p): p for p in MODULES}
    graph = {}
    for name, path in names.items():
        deps = set()
        for mod, at_top in _imports(path):
            if not at_top or not mod.startswith("offsim"):
                continue
            while mod and mod not in names:  # `from offsim.core import costmodel` names the package
                mod = mod.rpartition(".")[0]
            if mod and mod != name:
                deps.add(mod)
        graph[name] = deps
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        for d in graph.get(n, ()):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack + [n, d]))
            if d not in state:
                visit(d, stack + [n])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [])
