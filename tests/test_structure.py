"""The package's shape: a command layer apart from the library, no import cycles, no private names
shared across modules, no oversized functions."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

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


#: The applications: packages built on the library, which the library never imports.
APPLICATIONS = ("cgavit.train", "cgavit.bench", "cgavit.analysis", "cgavit.explorer", "cgavit.detection", "cgavit.cli",
                "cgavit.__main__")


def _is_application(module: str) -> bool:
    return any(module == app or module.startswith(app + ".") for app in APPLICATIONS)


def test_the_library_never_imports_an_application():
    """The model core (cgavit/*.py), deploy/ and kernels/ stand without train, bench, analysis,
    explorer, detection and the command layer, at any depth of the import graph."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for src, dst, _ in _imports(modules):
        graph[src].add(dst)
    library = [m for m in modules if m != "cgavit" and not _is_application(m)]
    for start in library:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph[todo.pop()]:
                assert not _is_application(nxt), f"{start} reaches the application module {nxt}"
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)


def _extra_requirements(extras: dict[str, list[str]], name: str) -> set[str]:
    """The distribution names an extra installs, its nested ``cgavit[...]`` extras included."""
    out: set[str] = set()
    for req in extras[name]:
        base = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower()
        if base == "cgavit":
            for inner in re.search(r"\[(.*)\]", req).group(1).split(","):
                out |= _extra_requirements(extras, inner.strip())
        else:
            out.add(base)
    return out


def test_the_deploy_extra_brings_no_training_stack():
    extras = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    deploy = _extra_requirements(extras, "deploy")
    assert {"onnxruntime", "safetensors"} <= deploy
    assert not deploy & {"timm", "scikit-learn", "matplotlib", "tqdm"}, deploy


_WITHOUT_TRAINING_STACK = """
import sys
for name in ("timm", "sklearn", "matplotlib", "tqdm", "PIL", "torchvision"):
    sys.modules[name] = None  # importing it raises ImportError, as if it were not installed
import torch, cgavit
model = cgavit.create_model("efficientvit_m0", num_classes=3, img_size=64, embed_dim=(16, 32, 48), depth=(1, 1, 1),
                            num_heads=(2, 2, 2), kernels=(3, 3))
path = cgavit.save_weights(model, sys.argv[1])
loaded, info = cgavit.load_model(path)
fast = cgavit.optimize(loaded, torch.randn(2, 3, 64, 64))
print(type(fast).__name__, tuple(fast(torch.randn(1, 3, 64, 64)).shape))
"""


def test_load_and_deploy_run_without_the_training_stack(tmp_path):
    """What ``pip install 'cgavit[deploy]'`` has: torch, safetensors, ONNX Runtime; no timm, PIL,
    matplotlib, scikit-learn, tqdm or torchvision."""
    pytest.importorskip("onnxruntime")
    run = subprocess.run([sys.executable, "-c", _WITHOUT_TRAINING_STACK, str(tmp_path / "w.safetensors")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["OnnxModule", "(1,", "3)"]


def test_the_model_core_imports_with_torch_alone():
    """``pip install cgavit`` depends on torch only: importing the package and building a model must
    not need numpy, PIL or safetensors (each comes with an extra)."""
    code = ("import sys\nfor name in ('numpy', 'PIL', 'safetensors', 'onnxruntime', 'openvino', 'timm'):\n"
            "    sys.modules[name] = None\nimport torch, cgavit\n"
            "m = cgavit.create_model('m0', num_classes=2, img_size=64).eval()\nprint(tuple(m(torch.randn(1, 3, 64, 64)).shape))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "(1, 2)", run.stderr[-2000:]
