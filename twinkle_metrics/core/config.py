"""A metric's configuration: what its constructor was given, and the fingerprint of it.

Ranks that sync one metric, and a checkpoint loaded into it, must agree on what its
states mean. That is decided by the constructor's arguments, so the fingerprint is
taken from the arguments the constructor was *called* with (bound to its signature,
defaults applied, through every ``__init__`` of the class chain), whatever attribute
the metric keeps them in (where it keeps one under the argument's own name, that
attribute's current value counts, so a metric reconfigured after construction is
fingerprinted as it is). Every value enters it by value:

* numbers, strings, bools, ``None``, and lists, tuples, sets and dicts of them (an int
  given for an argument annotated ``float`` is that float);
* tensors by dtype, shape and a hash of their contents;
* ``torch.dtype`` / ``torch.device`` / enums by name, functions and classes by their
  qualified name (and a function's code).

Anything else (a model, a process group) is refused at construction with an error that
names the argument, unless the class's ``schema`` excludes it (``Schema(exclude=...)``:
arguments that do not change what a state means: chunk sizes, a model to read). ``device_mesh``,
``process_group`` and ``max_slices`` never enter it, nor do unknown arguments (ignored,
with a warning, as Twinkle's metrics ignore them).
"""
from __future__ import annotations

import difflib
import enum
import functools
import hashlib
import inspect
import itertools
import operator
import re
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from twinkle_metrics.inputs.fields import per_class, typo_of

#: arguments of ``Metric.__init__`` that never enter a fingerprint
NEVER = frozenset({"self", "device_mesh", "process_group", "max_slices"})
#: (metric class, argument) pairs already warned about: one warning each per process
_WARNED: Set[Tuple[type, str]] = set()


class UnknownArgumentWarning(UserWarning):
    """A metric constructor got an argument it does not know and ignored it, as
    Twinkle's metrics do."""


def record_arguments(cls: type) -> None:
    """Wrap ``cls.__init__`` (if it defines one) so that a construction records the
    arguments it was called with, in ``metric._arguments`` (outermost ``__init__`` first;
    an inner one adds the names the outer ones did not bind, with its defaults)."""
    init = vars(cls).get("__init__")
    if init is None or init in _RECORDING:
        return
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            bound = None  # the call itself raises the right error
        if bound is not None:
            bound.apply_defaults()
            arguments = self.__dict__.setdefault("_arguments", {})
            floats = self.__dict__.setdefault("_float_arguments", set())
            for name, value in bound.arguments.items():
                param = signature.parameters[name]
                if param.kind is inspect.Parameter.VAR_KEYWORD:
                    for key, v in value.items():
                        arguments.setdefault(key, v)
                elif param.kind is not inspect.Parameter.VAR_POSITIONAL:
                    arguments.setdefault(name, value)
                if "float" in str(param.annotation):  # beta=1 and beta=1.0 are one setting
                    floats.add(name)
        init(self, *args, **kwargs)

    _RECORDING.add(__init__)
    cls.__init__ = __init__  # type: ignore[misc]  # the recording wrapper replaces the class's own __init__


#: the constructors ``record_arguments`` made (a class's ``__init__`` is wrapped once)
_RECORDING: "weakref.WeakSet" = weakref.WeakSet()


def settle_arguments(metric: Any, unknown: Iterable[str]) -> Tuple[Dict[str, str], Dict[str, Any]]:
    """Turn the recorded arguments into their canonical text, once, in ``Metric.__init__``
    (every ``__init__`` of the chain has recorded its arguments before it runs): unknown
    arguments and excluded ones left out, the rest checked to be comparable. Raises
    ``TypeError`` naming an argument that cannot be compared. Returns the canonical texts
    (``metric._arguments``) and the values as given (``metric._argument_values``)."""
    cls = type(metric)
    skip = set(NEVER) | set(unknown) | set(schema_of(cls).exclude)
    out: Dict[str, str] = {}
    values: Dict[str, Any] = {}  # as given: what an export hands a driver to rebuild the metric
    for name, value in metric.__dict__.get("_arguments", {}).items():
        if name not in skip:
            out[name] = _text(metric, name, value)
            values[name] = value
    return out, values


def _text(metric: Any, name: str, value: Any) -> str:
    if name in metric.__dict__.get("_float_arguments", ()) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return canonical(value, f"{type(metric).__name__}: argument {name!r}")


def current(metric: Any) -> Dict[str, str]:
    """The recorded arguments' text, each taken from the instance attribute of the same
    name where the metric keeps one (so a metric reconfigured after construction, say
    ``m.nan_policy = "skip"``, is fingerprinted as it now is), else as it was given."""
    out = {}
    attributes = metric.__dict__
    for name, text in metric._arguments.items():
        if name in attributes and name != "slice_by":
            try:
                text = _text(metric, name, attributes[name])
            except TypeError:
                pass  # kept as something else than what was given: the argument stands
        out[name] = text
    return out


class Schema:
    """What a metric's fingerprint covers, declared once per class (``schema = Schema(...)``).

    Args:
        version: bumped by the author on purpose when what a state means changes in a way the
            arguments do not say (a new definition, a state reused for another quantity):
            checkpoints of another version are refused.
        exclude: constructor arguments that change no state's meaning (chunk sizes, a group
            or a model to read): left out.
        sync_only: arguments ranks must agree on but a checkpoint need not (they change only
            ``compute``, or which states are created on the fly; ``load_state_dict`` checks
            the states themselves).

    The fingerprint is ``Class/vN(argument=value, ...)`` over every other argument the
    constructor was called with, defaults included. A checkpoint loads when its class name
    and version are this metric's and every argument either side names holds the same value,
    an argument the checkpoint does not name counting as its default: so a state dict saved
    before an argument with a default was added, or before the class moved module, still
    loads, and one saved with another setting that changes a state's meaning does not.
    """

    def __init__(self, version: int = 1, exclude: Sequence[str] = (), sync_only: Sequence[str] = ()) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"Schema: version must be an int >= 1, got {version!r}")
        for what, names in (("exclude", exclude), ("sync_only", sync_only)):
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise TypeError(f"Schema: {what} must be a tuple of argument names, got {names!r}")
        self.version, self.exclude, self.sync_only = version, tuple(exclude), tuple(sync_only)

    def __repr__(self) -> str:
        return f"Schema(version={self.version}, exclude={self.exclude}, sync_only={self.sync_only})"


def schema_of(cls: type) -> Schema:
    schema = getattr(cls, "schema", None)
    if not isinstance(schema, Schema):
        raise TypeError(f"{cls.__name__}.schema must be a Schema(...), got {schema!r}")
    return schema


def fingerprint(metric: Any, checkpoint: bool = False) -> str:
    """``Class/vN(name=value, ...)`` over the recorded arguments; ``checkpoint=True`` leaves
    out the schema's ``sync_only`` (what ranks must agree on, a checkpoint need not).

    Taken on every ``calculate()``, so it is kept (``metric._fingerprints``) while every
    attribute it reads is the very object it was taken from and immutable (a number, a
    string, ``None``): setting one anew, as reconfiguring a metric does, takes it again."""
    attributes = metric.__dict__
    live = tuple(map(attributes.get, metric._arguments, itertools.repeat(_UNSET)))
    kept = attributes.get("_fingerprints")
    if kept is not None and checkpoint in kept:
        seen, text = kept[checkpoint]
        if len(live) == len(seen) and all(map(operator.is_, live, seen)):
            return text
    cls = type(metric)
    schema = schema_of(cls)
    skip = schema.sync_only if checkpoint else ()
    parts = [f"{k}={v}" for k, v in current(metric).items() if k not in skip]
    text = f"{cls.__name__}/v{schema.version}({', '.join(parts)})"
    if all(type(v) in _IMMUTABLE for v in live):
        attributes.setdefault("_fingerprints", {})[checkpoint] = (live, text)
    return text


_UNSET = object()  # an argument the metric keeps no attribute of
#: values that an attribute holding the same object again cannot have changed
_IMMUTABLE = frozenset({type(None), type(_UNSET), bool, int, float, str})


_FINGERPRINT = re.compile(r"(?P<path>[\w.]+?)(?:/v(?P<version>\d+))?\((?P<args>.*)\)", re.S)


def parse_fingerprint(text: str) -> Optional[Tuple[str, int, Dict[str, str]]]:
    """``(class name, version, {argument: value text})`` of a fingerprint, this format or the
    one before it (``module.path.Class(name=value, ...)``, version 1); None when it is neither."""
    m = _FINGERPRINT.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        return None
    args: Dict[str, str] = {}
    for part in _top_level(m.group("args")):
        name, eq, value = part.partition("=")
        if not eq or not name.strip().isidentifier():
            return None
        args[name.strip()] = value.strip()
    return m.group("path").rpartition(".")[2], int(m.group("version") or 1), args


def _top_level(text: str) -> List[str]:
    """``text`` split at the commas outside brackets and quotes."""
    parts, depth, quote, start, i = [], 0, None, 0, 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    tail = text[start:]
    return parts + [tail] if tail.strip() else parts


def checkpoint_mismatch(metric: Any, saved: str) -> Optional[str]:
    """Why a state dict saved with fingerprint ``saved`` does not hold states of ``metric``'s
    meaning (``Schema``); None when it does."""
    cls = type(metric)
    parsed = parse_fingerprint(saved)
    if parsed is None:
        return f"its fingerprint {saved!r} cannot be read"
    name, version, theirs = parsed
    schema = schema_of(cls)
    if name != cls.__name__:
        return f"it holds a {name}'s states"
    if version != schema.version:
        return f"it was saved by version {version} of {name}'s states, this is version {schema.version}"
    mine = {k: v for k, v in current(metric).items() if k not in schema.sync_only}
    known, defaults = set(constructor_keywords(cls) or ()), argument_defaults(cls)
    for arg in sorted(set(mine) | set(theirs)):
        if arg in schema.sync_only or arg in schema.exclude or arg not in known:
            continue  # not part of what the states mean (any longer)
        a, b = mine.get(arg, defaults.get(arg)), theirs.get(arg, defaults.get(arg))
        if a != b:
            return f"{arg}={b} there, {arg}={a} here" + ("" if arg in theirs else " (it predates the argument, "
                                                         "which then held its default)")
    return None


@per_class
def argument_defaults(cls: type) -> Dict[str, str]:
    """Each constructor argument's default as fingerprint text, through the ``__init__`` chain."""
    out: Dict[str, str] = {}
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or klass is object:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.name in out or p.name in NEVER or p.default is inspect.Parameter.empty:
                continue
            value = float(p.default) if "float" in str(p.annotation) and type(p.default) is int else p.default
            try:
                out[p.name] = canonical(value, f"{cls.__name__}: argument {p.name!r}")
            except TypeError:
                pass
    return out


def canonical(value: Any, where: str) -> str:
    """``value`` as text that is equal exactly when the values are."""
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, functools.partial):
        return f"partial({canonical(value.func, where)}, {canonical(value.args, where)}, " \
               f"{canonical(value.keywords, where)})"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(canonical(v, where) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(canonical(v, where) for v in value)) + "}"
    if isinstance(value, Mapping):
        items = sorted((canonical(k, where), canonical(v, where)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous()
        digest = hashlib.sha1(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
        return f"tensor({str(data.dtype).replace('torch.', '')}, {list(data.shape)}, {digest[:16]})"
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if inspect.isclass(value):
        return f"{value.__module__}.{value.__qualname__}"
    if inspect.isfunction(value):
        code = value.__code__
        digest = hashlib.sha1(code.co_code + repr(code.co_consts).encode()).hexdigest()
        return f"{value.__module__}.{value.__qualname__}#{digest[:12]}"
    raise TypeError(f"{where} is a {type(value).__name__}, which cannot be compared across ranks and "
                    "checkpoints (the fingerprint takes every constructor argument by value); if it does "
                    "not change what a state means, name it in the class's schema = Schema(exclude=(...))")


def constructor_keywords(cls: type) -> Optional[List[str]]:
    """Keyword arguments ``cls``'s constructor names besides the mesh and the process
    group; ``None`` if it cannot be told.

    Walks the ``__init__`` chain while each one forwards ``**kwargs`` to its parent,
    down to ``Metric.__init__``, so the named parameters seen on the way are all the
    arguments the metric uses.
    """
    names: List[str] = []
    for klass in cls.__mro__:
        if klass is object or "__init__" not in vars(klass):
            continue
        forwards = False
        for p in inspect.signature(vars(klass)["__init__"]).parameters.values():
            if p.kind is p.VAR_KEYWORD:
                forwards = True
            elif p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                if p.name not in ("device_mesh", "process_group") and p.name not in names:
                    names.append(p.name)
        if klass in ROOTS or not forwards:
            return names
    return None


#: the base classes whose ``__init__`` ends a constructor chain (``Metric`` adds itself)
ROOTS: set = set()


def warn_unknown_arguments(metric: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` for an unknown constructor argument within a typo of a real one
    (``vocab_paralel``); warn once per (class, name) about the other unknown arguments
    ``metric`` ignores (Twinkle's constructors take ``**kwargs``, and its users pass
    extras), pointing at the line that built the metric."""
    cls = type(metric)
    fresh = [k for k in sorted(kwargs) if (cls, k) not in _WARNED]
    if not fresh and not any(typo_of(str(k), n) for k in kwargs for n in constructor_keywords(cls) or []):
        return
    level, frame = 4, inspect.currentframe()
    for _ in range(2):  # Metric.__init__'s caller
        frame = frame.f_back if frame is not None else None
    while frame is not None and (frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is metric):
        level, frame = level + 1, frame.f_back  # a subclass __init__ (or its recording wrapper)
    known = constructor_keywords(cls) or []
    typos = [(k, n) for k in sorted(kwargs) for n in known if typo_of(str(k), n)]
    if typos:
        key, name = typos[0]
        raise TypeError(f"{cls.__name__}: unknown constructor argument {key!r}: did you mean {name!r}? (a "
                        f"misspelt argument would build the metric without it; known arguments: {known})")
    for key in fresh:
        _WARNED.add((cls, key))
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        warnings.warn(f"{cls.__name__}: ignoring unknown constructor argument {key!r}{hint}; "
                      f"it changes nothing, as in Twinkle's metrics. Known arguments: {known}",
                      UnknownArgumentWarning, stacklevel=level - 1)
    del frame  # a frame held in a local keeps every frame below it alive
