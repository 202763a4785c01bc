"""What a metric reads, declared once, and the one check of every call against it.

A metric declares the fields it reads as a class attribute ``reads``: one ``Reads`` (or a
tuple of them, for records read independently of each other, such as a loss entry and a
``grad_norm``)::

    class Accuracy(Metric):
        reads = Reads(inputs=("labels", "completion_mask?"), outputs=("logits",))

A field is ``"name"`` (required), ``"name?"`` (optional), ``"a|b"`` (either name serves) and
may name a constructor setting as ``"{loss_key}"`` (the metric's attribute of that name).
Keywords are the ones ``update`` names in its signature; ``keywords=`` in a ``Reads`` says which
of them belong to that record and which are required.

``check_call`` looks at which fields a call carries (keys whose value is not ``None`` or an
empty list, in the input features, the outputs and the keywords) before any state or
collective is touched, and raises, naming the metric, the field, what was expected and what
came, when:

* a record is carried in part: some of its fields came, a required one did not (a metric of a
  collection is excused when every field it got is read by another member the call is
  complete for: the call was meant for that one);
* a field no metric of the call reads came where a field one of them reads is missing and
  the two names are close (a typo, with a did-you-mean), or a read field came on the wrong
  side (``logits`` in the inputs);
* a keyword no metric of the call takes came (``TypeError``). Every metric also takes the
  keywords Twinkle passes to all of them (``COMMON_KEYWORDS``).

A call that carries none of a record's fields is "nothing here" (``[]`` on a pipeline stage
without the loss, a call meant for other members of a collection) and adds nothing, as before.
The check reads only host structure (keys, lengths): never a tensor's values.
"""
from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple, TypeVar, cast

#: keywords Twinkle passes to every metric (``accumulate_metrics``): accepted by each,
#: handed to those whose ``update`` takes ``**kwargs`` or names them
COMMON_KEYWORDS = frozenset({"lr", "step", "gradient_accumulation_steps", "grad_norm", "loss_reduction"})
SIDES = ("inputs", "outputs", "keyword")
_WHERE = {"inputs": "inputs", "outputs": "outputs", "keyword": "keyword arguments"}
_F = TypeVar("_F", bound=Callable[..., Any])


def per_class(fn: _F) -> _F:
    """``functools.lru_cache(maxsize=None)`` for a function of a class, typed as ``fn`` (mypy takes
    a ``type[X]`` for unhashable, so it would refuse every call of the plain wrapper)."""
    return cast(_F, functools.lru_cache(maxsize=None)(fn))


@dataclass(frozen=True)
class Field:
    """One field of a record: its side, the names that serve (any one), required or not."""

    side: str
    names: Tuple[str, ...]
    required: bool
    carries: bool = True  # False: context, read with the record but not a sign of it
    setting: Optional[str] = None  # the metric's setting the first name is taken from ("{loss_key}")

    def resolved(self, metric: Any) -> "Field":
        if not any("{" in n for n in self.names):
            return self
        setting = self.names[0][1:-1] if self.names[0].startswith("{") and self.names[0].endswith("}") else None
        return Field(self.side, tuple(n.format_map(_Attributes(metric)) for n in self.names), self.required,
                     self.carries, setting)

    def shown(self) -> str:
        names = " or ".join(repr(n) for n in self.names)
        return f"keyword {names}" if self.side == "keyword" else f"{self.side}[{names}]" \
            if len(self.names) == 1 else f"{self.side} {names}"


class _Attributes(dict):
    def __init__(self, metric: Any) -> None:
        super().__init__()
        self.metric = metric

    def __missing__(self, key: str) -> str:
        value = getattr(self.metric, key, None)
        if not isinstance(value, str):
            raise TypeError(f"{type(self.metric).__name__}: a field named {{{key}}} needs a string attribute "
                            f"{key!r}, got {type(value).__name__}")
        return value


class Reads:
    """One record a metric reads: its fields on each side (see the module docstring).

    ``context``: fields the record reads too but shares with other metrics (a token mask,
    advantages), given as a ``Reads``: a call that carries only those is not for this
    metric, and adds nothing to it.

    Example:
        >>> Reads(outputs=("logps",), context=Reads(inputs=("labels|completion_mask",))).required()
        ['outputs[logps]', 'inputs[labels|completion_mask]']
    """

    def __init__(self, inputs: Sequence[str] = (), outputs: Sequence[str] = (), keywords: Sequence[str] = (),
                 context: Optional["Reads"] = None) -> None:
        if context is not None and not isinstance(context, Reads):
            raise TypeError(f"Reads: context must be a Reads(...), got {type(context).__name__}")
        fields = []
        for side, specs in (("inputs", inputs), ("outputs", outputs), ("keyword", keywords)):
            if isinstance(specs, str):
                raise TypeError(f"Reads: {side} must be a tuple of field names, got the string {specs!r}")
            for spec in specs:
                if not isinstance(spec, str) or not spec.strip("?|"):
                    raise TypeError(f"Reads: a field is a name ('labels', 'completion_mask?', 'a|b'), got {spec!r}")
                required = not spec.endswith("?")
                fields.append(Field(side, tuple(spec.rstrip("?").split("|")), required))
        shared = () if context is None else tuple(Field(f.side, f.names, f.required, False) for f in context.fields)
        self.fields: Tuple[Field, ...] = tuple(fields) + shared

    def required(self) -> List[str]:
        return [f"{f.side}[{'|'.join(f.names)}]" for f in self.fields if f.required]

    def __repr__(self) -> str:
        shown = [f"{f.side}:{'|'.join(f.names)}" + ("" if f.required else "?") for f in self.fields]
        return f"Reads({', '.join(shown)})"


@per_class
def records(cls: Any) -> Tuple[Reads, ...]:
    """``cls.reads`` as a tuple; raises ``TypeError`` for the author when it is not one
    ``Reads`` or a tuple of them, or names a keyword ``update`` does not take."""
    reads = getattr(cls, "reads", ())
    out = (reads,) if isinstance(reads, Reads) else tuple(reads or ())
    if not all(isinstance(r, Reads) for r in out):
        raise TypeError(f"{cls.__name__}.reads must be a Reads(...) or a tuple of them, got {reads!r}")
    named = update_keywords(cls)[0]
    for r in out:
        for f in r.fields:
            if f.side == "keyword" and not set(f.names) <= named:
                raise TypeError(f"{cls.__name__}.reads names keyword {f.names} but {cls.__name__}.update does "
                                f"not take it; name it in update's signature")
    return out


@per_class
def update_keywords(cls: Any) -> Tuple[FrozenSet[str], bool]:
    """The keywords ``cls.update`` names, and whether it also takes ``**kwargs``."""
    params = list(inspect.signature(cls.update).parameters.values())[3:]
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return named, any(p.kind == p.VAR_KEYWORD for p in params)


# ------------------------------------------------------------------------ the check
def present(value: Any) -> bool:
    """Whether a field's value holds something: not None, not a list of nothing (``[]``, or
    ``None`` per microbatch, as a pipeline stage without the loss passes)."""
    if isinstance(value, (list, tuple)):
        return any(v is not None for v in value)
    return value is not None


def _keys(side_value) -> Tuple[List[Mapping], set]:
    """The dicts of one side (a dict, or a list of them) and the names they carry."""
    if isinstance(side_value, Mapping):
        dicts = [side_value]
    elif isinstance(side_value, (list, tuple)):
        dicts = [d for d in side_value if isinstance(d, Mapping)]
    else:
        dicts = []
    return dicts, {k for d in dicts for k, v in d.items() if isinstance(k, str) and present(v)}


class _Call:
    """The host structure of one call: the names it carries on each side."""

    def __init__(self, inputs, outputs, kwargs: Mapping[str, Any]):
        self.dicts: Dict[str, List[Mapping]] = {}
        self.names: Dict[str, set] = {}
        self.none = {"inputs": inputs is None, "outputs": outputs is None}
        # ``[]`` input features: a pipeline stage without the loss, where keywords the trainer
        # passes every stage (rollout versions, advantages) still come
        self.no_features = isinstance(inputs, (list, tuple)) and not inputs
        for side, value in (("inputs", inputs), ("outputs", outputs)):
            self.dicts[side], self.names[side] = _keys(value)
        self.dicts["keyword"] = [kwargs]
        self.names["keyword"] = {k for k, v in kwargs.items() if present(v)}

    def shape(self) -> tuple:
        """What the check depends on: the names of each side, and of each listed entry."""
        return tuple((frozenset(self.names[side]),
                      tuple(frozenset(k for k, v in d.items() if present(v)) for d in self.dicts[side])
                      if len(self.dicts[side]) > 1 else ())
                     for side in ("inputs", "outputs")) + (frozenset(self.names["keyword"]),
                                                           tuple(self.none.values()), self.no_features)

    def has(self, field: Field) -> bool:
        return any(n in self.names[field.side] for n in field.names)

    def shown(self, side: str) -> str:
        if self.names[side]:
            return f"the {_WHERE[side]} hold {sorted(self.names[side])}"
        if side == "keyword":
            return "no keyword arguments came"
        return f"{side} is None" if self.none[side] else f"the {side} hold no fields"


class _Verdict:
    def __init__(self, metric: Any, call: "_Call") -> None:
        self.metric = metric
        self.name = type(metric).__name__
        self.complete: set = set()  # (side, name) read by a complete record
        self.partial: List[Tuple[List[Field], List[Field]]] = []  # (missing fields, carried fields)
        self.absent: List[Field] = []  # fields of this metric the call does not carry
        self.known: Dict[str, set] = {side: set() for side in SIDES}
        slice_by = getattr(metric, "slice_by", None)
        if slice_by:
            self.known["inputs"].add(slice_by)
        for record in records(type(metric)):
            fields = [f.resolved(metric) for f in record.fields]
            for f in fields:
                self.known[f.side].update(f.names)
            carried = [f for f in fields if call.has(f)]
            self.absent += [f for f in fields if not call.has(f)]
            if not any(f.carries for f in carried):
                continue
            missing = [f for f in fields if f.required and not call.has(f)]
            if missing and call.no_features and all(f.side == "inputs" for f in missing) \
                    and not any(f.side == "outputs" for f in carried):
                continue  # a stage without the loss: nothing here
            if missing:
                self.partial.append((missing, carried))
            else:
                self.complete.update((f.side, n) for f in carried for n in f.names if n in call.names[f.side])


def check_call(metrics: Sequence[Any], inputs: Any, outputs: Any, kwargs: Mapping[str, Any]
               ) -> List[Optional[Dict[str, Any]]]:
    """Check one call of ``metrics`` (a metric alone, or the members of a collection) against
    what they read; return each member's own keywords, or None for a member the call carries
    part of a record for that another member reads whole (the call is not for it: it adds
    nothing). Raises ``ValueError`` / ``TypeError`` (see the module docstring); touches
    nothing. The verdict depends only on the call's names (and each member's declaration),
    so it is kept per shape of call."""
    _check_keywords(metrics, kwargs)
    call = _Call(inputs, outputs, kwargs)
    key = (tuple((type(m), m.slice_by, _declared(m)) for m in metrics), call.shape())
    verdict = _VERDICTS.get(key)
    if verdict is None:
        if len(_VERDICTS) > 512:  # a training loop makes a handful of call shapes; bound it anyway
            _VERDICTS.clear()
        verdict = _VERDICTS[key] = _judge(metrics, call)
    error, excused = verdict
    if error:
        raise ValueError(error)
    return [None if i in excused else own_keywords(m, kwargs) for i, m in enumerate(metrics)]


_VERDICTS: Dict[tuple, Tuple[str, FrozenSet[int]]] = {}  # call shape -> (error or "", excused members)


def _declared(metric) -> tuple:
    return tuple(f.resolved(metric) for record in records(type(metric)) for f in record.fields)


def _judge(metrics, call: "_Call") -> Tuple[str, FrozenSet[int]]:
    verdicts = [_Verdict(m, call) for m in metrics]
    excused = set()
    for i, v in enumerate(verdicts):
        others = set().union(*(w.complete for j, w in enumerate(verdicts) if j != i))
        for missing, carried in v.partial:
            got = {(f.side, n) for f in carried for n in f.names if n in call.names[f.side]}
            if got <= others:
                excused.add(i)  # meant for another member, which the call is complete for
                continue
            return _partial_message(v, call, missing, carried, verdicts), frozenset()
    return _typos(verdicts, call) or _entries(verdicts, call), frozenset(excused)


def own_keywords(metric: Any, kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """The keywords of a call ``metric.update`` takes: those it names, and the common ones
    when it takes ``**kwargs``."""
    named, rest = update_keywords(type(metric))
    return {k: v for k, v in kwargs.items() if k in named or (rest and k in COMMON_KEYWORDS)}


def _check_keywords(metrics, kwargs) -> None:
    accepted = set(COMMON_KEYWORDS).union(*(update_keywords(type(m))[0] for m in metrics))
    unknown = [k for k in kwargs if k not in accepted]
    if not unknown:
        return
    key = unknown[0]
    close = difflib.get_close_matches(str(key), sorted(accepted), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    who = type(metrics[0]).__name__ if len(metrics) == 1 else \
        "MetricCollection (" + ", ".join(type(m).__name__ for m in metrics) + ")"
    raise TypeError(f"{who}.accumulate: unexpected keyword argument {key!r}{hint} (no metric of this call takes "
                    f"it; they take {sorted(accepted)})")


def _norm(s: str) -> str:
    return "".join(c for c in s.lower() if c.isalnum())


@functools.lru_cache(maxsize=4096)
def typo_of(a: str, b: str) -> bool:
    """A typo of each other: equal but for case and separators, or within one edit (two for
    names over five letters) of insertion, deletion, substitution or transposition."""
    x, y = _norm(a), _norm(b)
    if abs(len(x) - len(y)) > 2:
        return False
    limit = 1 if min(len(x), len(y)) <= 5 else 2
    prev2: List[int] = []
    prev = list(range(len(y) + 1))
    for i in range(1, len(x) + 1):
        row = [i] + [0] * len(y)
        for j in range(1, len(y) + 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (x[i - 1] != y[j - 1]))
            if i > 1 and j > 1 and x[i - 1] == y[j - 2] and x[i - 2] == y[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1] <= limit


def _near(verdicts, call: _Call, missing: Field) -> Optional[Tuple[str, str]]:
    """(side, name) of a field the call carries, read by no member, that looks like ``missing``."""
    known = {side: set().union(*(v.known[side] for v in verdicts)) for side in SIDES}
    for side in ("inputs", "outputs"):
        for name in sorted(call.names[side] - known[side]):
            if name in missing.names and side != missing.side:
                return side, name  # the right name on the wrong side
            if side == missing.side and any(typo_of(name, n) for n in missing.names):
                return side, name
    return None


def _hint(near: Optional[Tuple[str, str]], missing: Field) -> str:
    if near is None:
        return ""
    side, name = near
    if side != missing.side:
        return f"; {name!r} came in the {_WHERE[side]}: pass it in the {_WHERE[missing.side]}"
    best = max(missing.names, key=lambda n: difflib.SequenceMatcher(None, _norm(n), _norm(name)).ratio())
    setting = f", or pass {missing.setting}={name!r} to read that field" if missing.setting else ""
    return f": did you mean {best!r}{setting}?"


def _partial_message(v: _Verdict, call: _Call, missing: List[Field], carried: List[Field], verdicts) -> str:
    came = " and ".join(f.shown() for f in carried if f.carries)
    first = missing[0]
    hints = "".join(_hint(_near(verdicts, call, f), f) for f in missing)
    return (f"{v.name}: got {came} but no {' and no '.join(f.shown() for f in missing)} ({v.name} reads them "
            f"together; {call.shown(first.side)}{hints}); pass {first.names[0]!r} in the {_WHERE[first.side]}, or "
            "none of these fields for a call that adds nothing. Nothing was accumulated")


def _typos(verdicts, call: _Call) -> str:
    for v in verdicts:
        for missing in v.absent:
            near = _near(verdicts, call, missing)
            if near is not None:
                return (f"{v.name}: no {missing.shown()}, but the {_WHERE[near[0]]} hold {near[1]!r}, "
                        f"which no metric of this call reads{_hint(near, missing)} ({call.shown(near[0])}). "
                        "Nothing was accumulated")
    return ""


def _entries(verdicts, call: _Call) -> str:
    """Lists of outputs (or input features) carry every required field of a record they
    carry in each entry: one entry without it would be skipped silently."""
    for side in ("inputs", "outputs"):
        dicts = call.dicts[side]
        if len(dicts) < 2:
            continue
        for v in verdicts:
            for record in records(type(v.metric)):
                for f in record.fields:
                    f = f.resolved(v.metric)
                    if f.side != side or not f.required or not call.has(f):
                        continue
                    lacking = [i for i, d in enumerate(dicts) if not any(present(d.get(n)) for n in f.names)]
                    if lacking:
                        return (f"{v.name}: {side}[{lacking[0]}] has no {f.names[0]!r} but other "
                                f"{side} entries do; pass it in every microbatch (or none); nothing was "
                                "accumulated")
    return ""
