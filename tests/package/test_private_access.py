"""Library code keeps to other objects' public surface.

Every module under ``twinkle_metrics/`` and ``parallel/`` is read with ``ast``; an access
counts when it reads or writes an attribute ``_name`` (one leading underscore or two, not a
dunder) of an object other than ``self``/``cls`` (``type(self)`` and ``super()`` are
``self`` too), written ``x._name`` or ``getattr``/``setattr``/``hasattr``/``delattr(x,
"_name")``. Accesses on imported modules (``torch._foreach_add_``, ``dist._x``, a library
module's own private name) do not count: those are a module's namespace, not an object's
state; the rule that torch's private APIs sit behind one compat module is another test's.
``self._interval.states`` is public; ``self._other._states`` is another object's private
attribute and counts.

The machinery (staging, the fused sync, asynchronous handles, checkpoints) works on a
metric's ``Interval`` through its public methods, so the count stays small.
"""
from __future__ import annotations

import ast
import importlib
import inspect
from collections import Counter
from pathlib import Path
from typing import Dict, List, NamedTuple, Set

REPO = Path(__file__).resolve().parents[2]
LIBRARY = ("twinkle_metrics", "parallel")
#: the most accesses of other objects' private attributes library code may make
LIMIT = 20
_REFLECT = {"getattr", "setattr", "hasattr", "delattr"}


class Access(NamedTuple):
    path: str
    line: int
    text: str


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_names(tree: ast.AST, module: str, root: Path) -> Set[str]:
    """Names the file binds to modules: ``import a.b`` (``a``), ``import a.b as c`` (``c``),
    ``from a import b`` when ``a.b`` is a module."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")[:-node.level]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                if _is_module(f"{base}.{alias.name}", root):
                    names.add(alias.asname or alias.name)
    return names


def _is_module(dotted: str, root: Path) -> bool:
    parts = dotted.split(".")
    if parts[0] in LIBRARY:
        path = root.joinpath(*parts)
        return path.with_suffix(".py").exists() or (path / "__init__.py").exists()
    parent, _, leaf = dotted.rpartition(".")
    try:
        return inspect.ismodule(getattr(importlib.import_module(parent), leaf, None))
    except Exception:  # noqa: BLE001 - an optional dependency that is not installed
        return False


def _is_self(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "super":
            return True
        if node.func.id == "type" and len(node.args) == 1:
            return _is_self(node.args[0])
    return False


def _on_module(node: ast.AST, modules: Set[str]) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in modules


def accesses_in(path: Path, root: Path = REPO) -> List[Access]:
    """Every read or write of another object's private attribute in ``path``."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, str(path))
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    if module.endswith(".__init__"):
        module = module[: -len(".__init__")] + ".__init__"
    modules = _module_names(tree, module, root)
    lines = source.splitlines()
    out = []

    def note(node, owner):
        if not _is_self(owner) and not _on_module(owner, modules):
            out.append(Access(str(path.relative_to(root)), node.lineno, lines[node.lineno - 1].strip()))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            note(node, node.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _REFLECT
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _is_private(node.args[1].value)):
            note(node, node.args[0])
    return sorted(out)


def library_accesses(root: Path = REPO) -> List[Access]:
    out = []
    for package in LIBRARY:
        for path in sorted((root / package).rglob("*.py")):
            out.extend(accesses_in(path, root))
    return out


def by_file(accesses: List[Access]) -> Dict[str, int]:
    return dict(Counter(a.path for a in accesses).most_common())


def test_library_code_touches_few_private_attributes_of_other_objects():
    found = library_accesses()
    listing = "\n".join(f"{a.path}:{a.line}: {a.text}" for a in found)
    assert len(found) <= LIMIT, f"{len(found)} private accesses on other objects (at most {LIMIT}):\n{listing}"


def test_the_counter_sees_each_form_and_leaves_self_and_modules_out(tmp_path):
    package = tmp_path / "twinkle_metrics"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "other.py").write_text("_x = 1\n")
    (package / "m.py").write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "from twinkle_metrics import other\n"
        "class A:\n"
        "    def f(self, b):\n"
        "        self._a = 1\n"                  # self: no
        "        type(self)._c = 2\n"            # self's class: no
        "        super()._d()\n"                  # no
        "        torch._foreach_add_([], [])\n"  # a module: no
        "        dist._group = None\n"           # a module: no
        "        other._x\n"                     # a library module: no
        "        b.__dict__\n"                   # a dunder: no
        "        b._states\n"                    # 1
        "        b._states = {}\n"               # 2
        "        self._i._states\n"              # 3: self._i is another object
        "        getattr(b, '_flag', False)\n"   # 4
        "        setattr(b, '_flag', True)\n"    # 5
        "        getattr(self, '_flag', 0)\n"    # self: no
        "        b.f()._g\n"                     # 6
    )
    found = accesses_in(package / "m.py", tmp_path)
    assert [a.line for a in found] == [13, 14, 15, 16, 17, 19]


if __name__ == "__main__":  # the count, file by file
    found = library_accesses()
    for path, n in by_file(found).items():
        print(f"{n:4d}  {path}")
    print(f"{len(found):4d}  in all")
