"""The package's shape: a command layer apart from the library, no import cycles, no private names
shared across modules, no oversized functions."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "cgavit"
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(modules: dict[str, Path]):
    """(importer, imported module, imported names) for every import of our own modules, at any depth."""
    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_pkg, node)
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:
                        yield mod, sub, []
                    elif target in modules:
                        yield mod, target, [alias.name]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        yield mod, alias.name, []


def _imports_argparse(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse":
            return True
    return False


def test_argparse_lives_only_in_the_command_layer():
    """Only cgavit/cli imports argparse. (weights.py names "argparse.Namespace" in a string: the class
    DeiT-style checkpoints pickle their options as, which it reads as plain data.)"""
    users = sorted(str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py") if _imports_argparse(p))
    assert users and all(u.startswith("cgavit/cli/") for u in users), users


def test_import_graph_has_no_cycle():
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for src, dst, _ in _imports(modules):
        # a package's __init__ importing its own submodules is how packages export names
        if src != dst and not dst.startswith(src + "."):
            graph[src].add(dst)
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, stack: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle.extend(stack[stack.index(nxt):] + [node, nxt] if nxt in stack else [node, nxt])
                return True
            if state.get(nxt) is None and visit(nxt, stack + [node]):
                return True
        state[node] = 2
        return False

    for m in sorted(graph):
        if state.get(m) is None and visit(m, []):
            break
    assert not cycle, " -> ".join(cycle)


def test_no_private_name_is_imported_from_another_module():
    bad = [(src, dst, n) for src, dst, names in _imports(_modules()) for n in names if n.startswith("_")]
    assert not bad, bad


def test_our_modules_are_imported_at_module_top():
    late = []
    for mod, path in _modules().items():
        tree = ast.parse(path.read_text())
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("cgavit")):
                    late.append(f"{mod}.{fn.name}")
    assert not late, late


def test_functions_are_short():
    """No function over about 60 lines, except flat argparse registration tables."""
    long = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and not (mod.startswith("cgavit.cli") and node.name.startswith("register")):
                    long.append(f"{mod}.{node.name} ({n})")
    assert not long, long
