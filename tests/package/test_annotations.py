"""Every public function of the library is annotated; mypy checks the bodies (``make typecheck``).

Every module under ``twinkle_metrics/`` and ``parallel/`` is read with ``ast``. A function is
public when its module's path has no part with a leading underscore (``__init__.py`` aside),
its class (if any, and every class around it) has none, and its own name has none or is a
dunder (``__init__``'s arguments are a class's public constructor). Functions defined inside
functions are not public. A public function annotates its return and every argument but the
first of a method (``self``/``cls``; a ``staticmethod`` has none) and ``*args``/``**kwargs``
(left unannotated they are ``Any``). Triton device functions (``@triton.jit``) are left out: the
Triton compiler reads their annotations (``tl.constexpr``), and its language has no types.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, NamedTuple, Tuple

REPO = Path(__file__).resolve().parents[2]
LIBRARY = ("twinkle_metrics", "parallel")


class Function(NamedTuple):
    path: str
    line: int
    name: str           # qualified: ``Class.method``
    public: bool
    arguments: int      # arguments that need an annotation (self/cls, *args, **kwargs left out)
    annotated: int      # of those, annotated
    returns: bool       # a return annotation

    def missing(self) -> List[str]:
        out = [] if self.returns else ["return"]
        if self.annotated < self.arguments:
            out.append(f"{self.arguments - self.annotated} argument(s)")
        return out


def _public_name(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def _decorators(node: ast.AST) -> set:
    out = set()
    for d in getattr(node, "decorator_list", ()):
        out.add(d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else "")
    return out


def functions_in(path: Path, root: Path = REPO) -> Iterator[Function]:
    """Every function of ``path`` (nested ones too, as not public), with what it annotates."""
    rel = path.relative_to(root)
    module_public = not any(p.startswith("_") and p != "__init__.py" for p in rel.parts)
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))

    def visit(node: ast.AST, prefix: str, public: bool, in_class: bool) -> Iterator[Function]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.", public and not child.name.startswith("_"), True)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if "jit" in _decorators(child):
                    continue
                a = child.args
                args = a.posonlyargs + a.args + a.kwonlyargs
                if in_class and "staticmethod" not in _decorators(child) and (a.posonlyargs + a.args):
                    args = args[1:]
                yield Function(str(rel), child.lineno, prefix + child.name, public and _public_name(child.name),
                               len(args), sum(x.annotation is not None for x in args), child.returns is not None)
                yield from visit(child, f"{prefix}{child.name}.", False, False)
            else:
                yield from visit(child, prefix, public, in_class)

    yield from visit(tree, "", module_public, False)


def library_functions(root: Path = REPO) -> List[Function]:
    return [f for package in LIBRARY for path in sorted((root / package).rglob("*.py"))
            for f in functions_in(path, root)]


def coverage(found: List[Function]) -> Tuple[float, float]:
    """The share of ``found`` with a return annotation, and of their arguments annotated."""
    arguments = sum(f.arguments for f in found)
    return (sum(f.returns for f in found) / max(len(found), 1),
            sum(f.annotated for f in found) / max(arguments, 1))


def test_every_public_function_annotates_its_arguments_and_return():
    found = library_functions()
    public = [f for f in found if f.public]
    offenders = [f"{f.path}:{f.line}: {f.name} lacks {', '.join(f.missing())}" for f in public if f.missing()]
    returns, arguments = coverage(found)
    assert not offenders, (f"{len(offenders)} of {len(public)} public functions are not fully annotated "
                           f"(all functions: {returns:.0%} return, {arguments:.0%} arguments):\n"
                           + "\n".join(offenders))


def test_the_walk_sees_each_form(tmp_path):
    package = tmp_path / "twinkle_metrics"
    (package / "_private").mkdir(parents=True)
    (package / "_private" / "m.py").write_text("def f(x): pass\n")
    (package / "m.py").write_text(
        "def ok(x: int, *args, **kwargs) -> None: pass\n"      # 1: complete
        "def bare(x, y: int): pass\n"                          # 2: return, 1 argument
        "def _helper(x): pass\n"                               # 3: private
        "class A:\n"                                           # 4
        "    def __init__(self, n): pass\n"                    # 5: a dunder counts
        "    @staticmethod\n"                                  # 6
        "    def s(x) -> int: return x\n"                      # 7: x is no self
        "    @classmethod\n"                                   # 8
        "    def c(cls) -> None:\n"                            # 9: complete
        "        def inner(y): pass\n"                         # 10: nested, not public
        "class _B:\n"                                          # 11
        "    def m(self, x): pass\n"                           # 12: in a private class
    )
    found = [f for path in sorted(package.rglob("*.py")) for f in functions_in(path, tmp_path)]
    lacking = {f.name: f.missing() for f in found if f.public and f.missing()}
    assert lacking == {"bare": ["return", "1 argument(s)"], "A.__init__": ["return", "1 argument(s)"],
                       "A.s": ["1 argument(s)"]}
    assert {f.name for f in found if not f.public} == {"f", "_helper", "A.c.inner", "_B.m"}
