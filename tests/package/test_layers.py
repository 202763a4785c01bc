"""The package's shape holds: layers, no import circles, one path per module, short files.

Every module under ``twinkle_metrics/`` and ``parallel/`` is read with ``ast``; every import
in it counts, wherever it stands (module level, inside a function, under
``TYPE_CHECKING``), absolute or relative. The layer order is the one the docstring of
``twinkle_metrics/__init__.py`` draws; ``TIERS`` below must match it.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple

REPO = Path(__file__).resolve().parents[2]
LIBRARY = ("twinkle_metrics", "parallel")
#: the repository's own code that ships without the library: never imported by it
OUTSIDE = ("benchmarks", "tests", "launch")
#: top to bottom; a package imports only packages of the tiers below its own (so the two
#: packages of one tier never import each other); ``parallel`` is the top-level package
TIERS = (("integrations", "testing"), ("metrics",), ("kernels",), ("stats",), ("core",), ("comm",), ("inputs",),
         ("parallel",))
#: ``twinkle_metrics/__init__.py`` gathers the public names: above every layer, imported by none
TOP = "twinkle_metrics"
MAX_LINES = 500
#: import circles still in the code, each exactly as found; nothing else may be added here


# ------------------------------------------------------------------------ the checker
class Import(NamedTuple):
    module: str   # the importing module
    line: int
    target: str   # the module imported (a library module), or the name as written (outside code)


def find_modules(root: Path, packages: Sequence[str] = LIBRARY) -> Dict[str, Tuple[Path, bool]]:
    """``{dotted name: (path, is a package)}`` of every ``.py`` file under ``packages``."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _longest_module(name: str, modules) -> Optional[str]:
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def imports_in(name: str, path: Path, is_package: bool, modules) -> List[Import]:
    """Every import of ``name`` (anywhere in its file) of a library module, or of outside
    code (``OUTSIDE``); other imports (torch, the standard library) are left out."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            written = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[:len(name.split(".")) - node.level + is_package]
                if len(base) < 1:
                    raise ValueError(f"{path}:{node.lineno}: relative import beyond the top package")
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name``, mod
            written = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
        else:
            continue
        for target in written:
            if target.split(".")[0] in OUTSIDE:
                out.append(Import(name, node.lineno, target))
            elif target.split(".")[0] in LIBRARY:
                found = _longest_module(target, modules)
                if found is not None and found != name:
                    out.append(Import(name, node.lineno, found))
    return out


def all_imports(root: Path = REPO, packages: Sequence[str] = LIBRARY) -> Tuple[Dict, List[Import]]:
    modules = find_modules(root, packages)
    found = [i for name, (path, pkg) in modules.items() for i in imports_in(name, path, pkg, modules)]
    return modules, found


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "twinkle_metrics":
        return parts[0]
    return parts[1] if len(parts) > 1 else TOP


def tier_of(layer: str) -> Optional[int]:
    if layer == TOP:
        return -1
    return next((i for i, tier in enumerate(TIERS) if layer in tier), None)


def layer_violations(modules, imports: Iterable[Import], root: Path = REPO) -> List[str]:
    """(a) imports of a layer not below the importer's, (b) imports of outside code."""
    out = []
    for name, (path, _) in modules.items():
        if tier_of(layer_of(name)) is None:
            out.append(f"{path.relative_to(root)}: package {layer_of(name)!r} has no place in the layer order")
    for imp in imports:
        where = f"{modules[imp.module][0].relative_to(root)}:{imp.line}"
        if imp.target.split(".")[0] in OUTSIDE:
            out.append(f"{where}: {imp.module} imports {imp.target} (outside the library)")
            continue
        mine, theirs = layer_of(imp.module), layer_of(imp.target)
        if mine == theirs:
            continue
        a, b = tier_of(mine), tier_of(theirs)
        if a is not None and b is not None and b <= a:
            out.append(f"{where}: {imp.module} ({mine}) imports {imp.target} ({theirs}), which is not below it")
    return out


def cycles(imports: Iterable[Import]) -> List[List[str]]:
    """One circle per strongly connected group of modules (Tarjan), as ``[a, b, ..., a]``
    (``knots`` gives each whole group)."""
    return [_circle(group, graph) for group, graph in _knots(imports)]


def knots(imports: Iterable[Import]) -> List[Set[str]]:
    """The strongly connected groups of more than one module: every module of a group
    reaches every other through imports."""
    return [group for group, _ in _knots(imports)]


def _knots(imports: Iterable[Import]):
    graph: Dict[str, Set[str]] = {}
    for imp in imports:
        if imp.target.split(".")[0] in LIBRARY:
            graph.setdefault(imp.module, set()).add(imp.target)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    groups: List[Set[str]] = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [(group, graph) for group in groups]


def _circle(group: Set[str], graph) -> List[str]:
    """A shortest circle through the first module of ``group`` (breadth-first inside it)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ()) & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def long_files(root: Path = REPO, packages: Sequence[str] = LIBRARY, limit: int = MAX_LINES) -> List[str]:
    out = []
    for package in packages:
        for path in sorted((root / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                n = path.read_bytes().count(b"\n")
                if n > limit:
                    out.append(f"{path.relative_to(root)}: {n} lines")
    return out


# -------------------------------------------------------------------- the library
def test_the_docstring_draws_the_order_the_test_checks():
    import twinkle_metrics

    drawn = re.findall(r"^    (\w+)/?\s", twinkle_metrics.__doc__, re.M)
    assert drawn == [layer for tier in TIERS for layer in tier]


def test_each_layer_imports_only_the_layers_below_it_and_no_outside_code():
    modules, imports = all_imports()
    assert len(modules) > 50 and len(imports) > 200  # the walk saw the package
    problems = layer_violations(modules, imports)
    assert not problems, "layer order broken:\n" + "\n".join(problems)


def test_no_import_circle_among_library_modules():
    _, imports = all_imports()
    found = list(zip(cycles(imports), knots(imports)))
    assert not found, "import circles:\n" + "\n".join(
        " -> ".join(c) + (f"  (one of the circles among {sorted(k)})" if len(k) > len(c) - 1 else "")
        for c, k in found)


def test_no_library_file_over_500_lines():
    too_long = long_files()
    assert not too_long, f"files over {MAX_LINES} lines:\n" + "\n".join(too_long)


# ------------------------------------------------ the checker catches what it claims
def _tree(tmp_path: Path, files: Dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in LIBRARY:
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").touch()
    return tmp_path


def test_checker_sees_imports_inside_functions_and_relative_ones(tmp_path):
    root = _tree(tmp_path, {
        "twinkle_metrics/core/__init__.py": "",
        "twinkle_metrics/core/state.py": "def f():\n    from twinkle_metrics.metrics import loss\n",
        "twinkle_metrics/core/metric.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from ..kernels import argmax\n",
        "twinkle_metrics/comm/__init__.py": "from . import fused\n",
        "twinkle_metrics/comm/fused.py": "import twinkle_metrics.core.state as s\n",
        "twinkle_metrics/metrics/__init__.py": "",
        "twinkle_metrics/metrics/loss.py": "from twinkle_metrics.core import state\n",
        "twinkle_metrics/kernels/__init__.py": "",
        "twinkle_metrics/kernels/argmax.py": "from parallel import groups\n",
        "parallel/groups.py": "def g():\n    import benchmarks.common\n",
    })
    modules, imports = all_imports(root)
    problems = layer_violations(modules, imports, root)
    assert sorted(problems) == sorted([
        "twinkle_metrics/core/state.py:2: twinkle_metrics.core.state (core) imports "
        "twinkle_metrics.metrics.loss (metrics), which is not below it",
        "twinkle_metrics/core/metric.py:3: twinkle_metrics.core.metric (core) imports "
        "twinkle_metrics.kernels.argmax (kernels), which is not below it",
        "twinkle_metrics/comm/fused.py:1: twinkle_metrics.comm.fused (comm) imports "
        "twinkle_metrics.core.state (core), which is not below it",
        "parallel/groups.py:2: parallel.groups imports benchmarks.common (outside the library)",
    ])
    assert cycles(imports) == [["twinkle_metrics.core.state", "twinkle_metrics.metrics.loss",
                                "twinkle_metrics.core.state"]]


def test_checker_flags_the_top_module_a_package_without_a_layer_and_both_of_one_tier(tmp_path):
    root = _tree(tmp_path, {
        "twinkle_metrics/integrations/factory.py": "def f():\n    import twinkle_metrics\n",
        "twinkle_metrics/testing/guard.py": "from twinkle_metrics.integrations import factory\n",
        "twinkle_metrics/plot.py": "from twinkle_metrics.integrations.factory import f\n",
    })
    modules, imports = all_imports(root)
    problems = layer_violations(modules, imports, root)
    assert sorted(problems) == sorted([
        "twinkle_metrics/plot.py: package 'plot' has no place in the layer order",
        "twinkle_metrics/integrations/factory.py:2: twinkle_metrics.integrations.factory (integrations) imports "
        "twinkle_metrics (twinkle_metrics), which is not below it",
        "twinkle_metrics/testing/guard.py:1: twinkle_metrics.testing.guard (testing) imports "
        "twinkle_metrics.integrations.factory (integrations), which is not below it",
    ])


def test_checker_reports_each_circle_once_with_its_path(tmp_path):
    root = _tree(tmp_path, {
        "parallel/mesh.py": "def f():\n    from . import adapters\n",
        "parallel/adapters.py": "from .mesh import DeviceMesh\n",
        "twinkle_metrics/comm/a.py": "from twinkle_metrics.comm import b\n",
        "twinkle_metrics/comm/b.py": "from twinkle_metrics.comm.c import x\n",
        "twinkle_metrics/comm/c.py": "def f():\n    from twinkle_metrics.comm import a\n",
    })
    _, imports = all_imports(root)
    assert sorted(cycles(imports)) == [
        ["parallel.adapters", "parallel.mesh", "parallel.adapters"],
        ["twinkle_metrics.comm.a", "twinkle_metrics.comm.b", "twinkle_metrics.comm.c", "twinkle_metrics.comm.a"]]


def test_checker_counts_lines_of_every_file(tmp_path):
    root = _tree(tmp_path, {"parallel/big.py": "x = 1\n" * 501, "parallel/ok.py": "x = 1\n" * 500,
                            "twinkle_metrics/configs/big.json": "{}\n" * 600})
    assert long_files(root) == ["twinkle_metrics/configs/big.json: 600 lines", "parallel/big.py: 501 lines"]


# --------------------------------------------------------------- one path per module
#: module paths the package had before its first release; none is an alias now
EARLIER_PATHS = ("twinkle_metrics.base", "twinkle_metrics.loss", "twinkle_metrics.sync", "twinkle_metrics.grpo",
                 "twinkle_metrics.megatron", "twinkle_metrics.plot", "twinkle_metrics.kernels.triton_entropy",
                 "twinkle_metrics.kernels._triton", "twinkle_metrics.kernels.triton_rl",
                 "twinkle_metrics.inputs.vocab")


def _checkout_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that sees this checkout and the installed third-party
    packages (this one's path) but runs no ``.pth`` file (``-S``): an editable install of
    another checkout would otherwise answer for a module this one does not have."""
    paths = dict.fromkeys([str(REPO)] + [p for p in sys.path if p])
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(paths)))


def test_import_adds_no_hook_no_alias_table_and_earlier_paths_do_not_import():
    code = f"""
import importlib, sys
before = list(sys.meta_path)
import twinkle_metrics, parallel
assert twinkle_metrics.__file__.startswith({str(REPO)!r}), twinkle_metrics.__file__
assert sys.meta_path == before, sys.meta_path
assert not hasattr(twinkle_metrics, "MOVED")
for path in {EARLIER_PATHS!r}:
    try:
        importlib.import_module(path)
    except ImportError:
        continue
    raise AssertionError(path + " imports")
"""
    out = _checkout_python(code)
    assert out.returncode == 0, out.stderr
