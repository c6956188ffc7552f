"""The package's layering, enforced: model <- run <- experiments <- cli, no import cycles, and no
module importing another module's private (underscore) names.

Every import statement counts, including the ones inside functions: a lazy import hides a
dependency from the reader, not from the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lmlab"
LAYERS = {"model": 0, "run": 1, "experiments": 2, "cli": 3}


# ============================================================== the checker
def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root`` (a package's __init__ is the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def layer(module: str) -> str:
    """model, run, experiments or cli: the second component of the dotted name decides (``python -m lmlab``,
    lmlab.__main__, is the command too)."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] == "__main__":
        return "cli"
    return parts[1] if len(parts) > 1 and parts[1] in ("run", "experiments", "cli") else "model"


def imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported package-internal module, names taken from it, line) for every import in ``path``."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    root = next(iter(modules)).split(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == root]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != root:
                continue
            names = [a.name for a in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            found += [(m, [], node.lineno) for m in submodules]
            rest = [n for n in names if f"{target}.{n}" not in modules]
            if rest or not submodules:
                found.append((target, rest, node.lineno))
    return found


def private_attributes(path: Path, module_aliases: set[str]) -> list[tuple[str, int]]:
    """``alias._name`` uses where ``alias`` is an imported package module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            out.append((f"{node.value.id}.{node.attr}", node.lineno))
    return out


def module_aliases(path: Path, modules: dict[str, Path], module: str) -> set[str]:
    aliases = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(
                package.split(".")[: len(package.split(".")) - node.level + 1] + ([node.module] if node.module else [])
            )
            aliases |= {a.asname or a.name for a in node.names if f"{base}.{a.name}" in modules}
    return aliases


def problems(root: Path, package: str) -> list[str]:
    """Every layering violation, cycle and private import under ``root``, as readable lines."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    out = []
    for module, path in modules.items():
        for target, names, line in imports(module, path, modules):
            where = f"{path.relative_to(root.parent)}:{line}"
            if target not in modules:
                continue
            if target != module:
                graph[module].add(target)
            if LAYERS[layer(module)] < LAYERS[layer(target)]:
                out.append(f"{where}: {module} ({layer(module)}) imports {target} ({layer(target)}), a layer above it")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != module:
                out.append(f"{where}: {module} imports private name(s) {private} from {target}")
        out += [f"{path.relative_to(root.parent)}:{line}: {module} uses private {name} of another module"
                for name, line in private_attributes(path, module_aliases(path, modules, module))]
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component) + [sorted(component)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# ============================================================== the package
def test_lmlab_layers_cycles_and_private_names():
    assert not problems(PACKAGE, "lmlab"), "\n".join(problems(PACKAGE, "lmlab"))


def test_the_three_layers_are_packages_and_the_model_files_stay_on_top():
    modules = module_names(PACKAGE, "lmlab")
    for name in ("schema", "config", "norm", "positions", "attention", "feedforward", "moe", "model", "generate", "hf"):
        assert f"lmlab.{name}" in modules and layer(f"lmlab.{name}") == "model"
    assert {layer(m) for m in modules} == set(LAYERS)
    assert any(m.startswith("lmlab.run.") for m in modules) and any(m.startswith("lmlab.experiments.") for m in modules)


# ============================================================== the checker catches what it should
def write_package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for name, text in {"__init__.py": "", "run/__init__.py": "", "experiments/__init__.py": "", **files}.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


@pytest.mark.parametrize("files, expected", [
    ({"a.py": "from . import b\n", "b.py": "def f():\n    from .a import x\n"},
     "import cycle: pkg.a -> pkg.b -> pkg.a"),
    ({"model.py": "def f():\n    from .run.trainer import Trainer\n", "run/trainer.py": ""}, "a layer above it"),
    ({"run/x.py": "from ..experiments import sweep\n", "experiments/sweep.py": ""}, "a layer above it"),
    ({"run/x.py": "from ..model import _randn\n", "model.py": ""}, "private name(s) ['_randn']"),
    ({"run/x.py": "from . import y\ny._helper()\n", "run/y.py": ""}, "uses private y._helper"),
])
def test_the_checker_finds_cycles_upward_imports_and_private_names(tmp_path, files, expected):
    found = problems(write_package(tmp_path, files), "pkg")
    assert any(expected in p for p in found), found


def test_the_checker_accepts_downward_imports(tmp_path):
    pkg = write_package(tmp_path, {"model.py": "import torch\n", "run/trainer.py": "from ..model import Model\n",
                                   "experiments/sweep.py": "from ..run.trainer import Trainer\nfrom ..model import M\n",
                                   "cli.py": "from .experiments import sweep\nfrom .run import trainer\n"})
    assert problems(pkg, "pkg") == []


def test_no_class_is_over_350_lines():
    """A class is a few screens at most (STYLE.md): the trainer's setup, step, evaluation, checkpointing
    and logging are pieces it calls, not code it holds."""
    big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 350:
                big.append(f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not big, f"classes over 350 lines: {big}"
