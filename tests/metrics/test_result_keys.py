"""Every result key a shipped metric can return has a line that computes it (STYLE.md, 27).

For each metric class of ``twinkle_metrics.__all__`` and each key it declares
(``result_keys``: what ``calculate()`` may return), the code of the metric (its module and
the ``twinkle_metrics.metrics`` modules that module imports, read with ``ast``: docstrings
and comments do not count) computes the key on a line a reader finds by grepping for it:

* a literal key: the key of an assignment (``out["train/clip_ratio"] = ...``, one of a tuple
  target), of a dict display (``{"accuracy": ...}``) or of a dict comprehension;
* a pattern: the same with an f-string key, each ``*`` or ``{setting}`` of the declared key
  one placeholder of it, e.g. ``out[f"train/{name}_reward"] = ...`` for ``train/*_reward``
  (per-name keys);
* a quantile key, declared with a trailing ``p*``: that placeholder may hold the whole suffix
  (``quantile_suffix(q)`` is ``p50``), or the key is the first argument of
  ``quantile_keys("train/ratio", ...)`` (``stats.histogram``: ``{key}_p50``, ...).

A key assembled from a prefix constant (``_P + "mean"``), passed as a keyword
(``out.update(pos_sim=...)``) or made by a loop over a table of names has no such line, and
fails here.
"""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import List, NamedTuple

import pytest

import twinkle_metrics
from twinkle_metrics import Metric

REPO = Path(__file__).resolve().parents[2]
HOLE = "\x00"  # an f-string placeholder, in a key's template

SHIPPED = sorted((c for c in (getattr(twinkle_metrics, n) for n in twinkle_metrics.__all__)
                  if isinstance(c, type) and issubclass(c, Metric) and c is not Metric), key=lambda c: c.__name__)


class Key(NamedTuple):
    """A key written in the code: its text (each f-string placeholder ``HOLE``), whether it is
    ``quantile_keys``' prefix, and its line."""

    template: str
    quantile_prefix: bool
    line: str


def _template(node):
    """A str constant's text, an f-string's with each placeholder ``HOLE``; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values)
    return None


def written_keys(source: str) -> List[Key]:
    """The keys ``source`` computes: see the module docstring."""
    tree, lines = ast.parse(source), source.splitlines()
    found = []

    def add(node, quantile=False):
        text = _template(node)
        if text is not None:
            found.append(Key(text, quantile, lines[node.lineno - 1]))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Subscript):
                        add(t.slice)
        elif isinstance(node, ast.Dict):
            for k in node.keys:
                if k is not None:
                    add(k)
        elif isinstance(node, ast.DictComp):
            add(node.key)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "quantile_keys" and node.args:
            add(node.args[0], quantile=True)
    return found


def sources(cls) -> List[str]:
    """The code of ``cls``'s module and of the ``twinkle_metrics.metrics`` modules it imports."""
    path = Path(inspect.getsourcefile(cls))
    paths = [path]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("twinkle_metrics.metrics"):
            for name in [node.module] + [f"{node.module}.{a.name}" for a in node.names]:
                candidate = REPO / (name.replace(".", "/") + ".py")
                if candidate.is_file() and candidate not in paths:
                    paths.append(candidate)
    return [p.read_text() for p in paths]


def _pattern(key: str) -> str:
    """A declared key as a regex over templates: each ``*`` / ``{setting}`` one placeholder."""
    parts = re.split(r"(\*|\{[A-Za-z_][A-Za-z_0-9]*\})", key)
    return "".join(HOLE if (p == "*" or p.startswith("{")) else re.escape(p) for p in parts)


def computing_lines(key: str, source: str) -> List[str]:
    """The lines of ``source`` that compute declared result key ``key``."""
    whole = _pattern(key[:-2]) + f"(?:p{HOLE}|{HOLE})" if key.endswith("p*") else _pattern(key)
    prefix = _pattern(key[:-3]) if key.endswith("_p*") else None
    lines = []
    for k in written_keys(source):
        if k.quantile_prefix:
            hit = prefix is not None and re.fullmatch(prefix, k.template)
        else:
            hit = re.fullmatch(whole, k.template)
        if hit:
            lines.append(k.line)
    return lines


@pytest.mark.parametrize("cls", SHIPPED, ids=lambda c: c.__name__)
def test_every_declared_key_has_a_line_that_computes_it(cls):
    assert cls.result_keys, f"{cls.__name__} declares no result_keys"
    code = sources(cls)
    missing = [key for key in cls.result_keys if not any(computing_lines(key, text) for text in code)]
    assert not missing, f"{cls.__name__}: no line computes {missing} (grep finds none: write the key once, " \
                        "as a literal or an f-string, on the line that computes it)"


def test_policy_keys_each_on_the_line_that_divides_their_states():
    """``grep -n '"train/clip_ratio"'`` finds the formula, beside the states it divides."""
    from twinkle_metrics import GRPOMetric

    code = sources(GRPOMetric)
    for key, states in (("train/clip_ratio", ('"clip_low"', '"clip_high"', '"clip_n"')),
                        ("train/approx_kl", ('"sum_kl"', '"n_old"')),
                        ("train/ratio_mean", ('"sum_ratio"', '"n_old"')),
                        ("train/entropy", ('"sum_ent"', '"n_ent"')),
                        ("train/ref_kl", ('"sum_ref_kl"', '"n_ref"')),
                        ("train/clip_ratio_dual", ('"clip_dual"', '"clip_n"'))):
        hits = [line for text in code for line in computing_lines(key, text)]
        assert hits and all(all(s in hit for s in states) for hit in hits), (key, hits)


@pytest.mark.parametrize("source, key", [
    ('out[_P + "mean"] = s["sum"] / n', "staleness/mean"),                      # a prefix constant
    ('for k, (c, n) in MEANS.items():\n    out[k] = s[c] / s[n]', "train/approx_kl"),  # a loop over a table
    ("result_keys = ('train/approx_kl', 'train/entropy')", "train/approx_kl"),     # the declaration
    ('out[f"moe/{name}"] = mean(name)', "moe/cv"),                              # a literal key, as a pattern
    ('out["train/x_reward"] = r', "train/*_reward"),                            # a pattern key, as a literal
    ('out.update(pos_sim=s["pos_sum"] / s["pos_count"])', "pos_sim"),           # a keyword
])
def test_keys_built_elsewhere_are_not_found(source, key):
    assert not computing_lines(key, source)


@pytest.mark.parametrize("source, key", [
    ('out["accuracy"], out["n"] = a / b, b', "accuracy"),
    ('return {"accuracy": s["correct"] / s["total"]}', "accuracy"),
    ('out[f"train/{name}_reward"] = mean', "train/*_reward"),
    ('out[f"staleness/frac_over_{self.max_staleness}"] = s["n_over"] / n', "staleness/frac_over_{max_staleness}"),
    ('out.update({f"staleness/{quantile_suffix(q)}": v for q, v in pairs})', "staleness/p*"),
    ('out.update(quantile_keys("train/ratio", H, s["hist_ratio"], qs))', "train/ratio_p*"),
    ('out.update(quantile_keys(f"train/{name}_reward", H, s[h], qs))', "train/*_reward_p*"),
])
def test_the_documented_forms_are_found(source, key):
    assert computing_lines(key, source)
