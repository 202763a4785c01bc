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
names the argument, unless the class lists it in ``fingerprint_exclude`` (arguments that
do not change what a state means: chunk sizes, a model to read). ``device_mesh``,
``process_group`` and ``max_slices`` never enter it, nor do unknown arguments (ignored,
with a warning, as Twinkle's metrics ignore them).
"""
from __future__ import annotations

import difflib
import enum
import functools
import hashlib
import inspect
import warnings
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

#: arguments of ``Metric.__init__`` that never enter a fingerprint
NEVER = frozenset({"self", "device_mesh", "process_group", "max_slices"})
#: Keyword arguments of ``accumulate`` that some metric's ``update`` names. A trainer
#: passes one shared kwargs dict to every metric (Twinkle's convention), so a keyword
#: one metric uses is accepted by all; one that no metric knows is a mistake.
KNOWN_KWARGS: Set[str] = set()
#: (metric class, argument) pairs already warned about: one warning each per process
_WARNED: Set[Tuple[type, str]] = set()


class UnknownArgumentWarning(UserWarning):
    """A metric constructor got an argument it does not know and ignored it, as
    Twinkle's metrics do."""


def record_arguments(cls) -> None:
    """Wrap ``cls.__init__`` (if it defines one) so that a construction records the
    arguments it was called with, in ``metric._arguments`` (outermost ``__init__`` first;
    an inner one adds the names the outer ones did not bind, with its defaults)."""
    init = vars(cls).get("__init__")
    if init is None or getattr(init, "_records_arguments", False):
        return
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
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

    __init__._records_arguments = True
    cls.__init__ = __init__


def settle_arguments(metric, unknown) -> None:
    """Turn the recorded arguments into their canonical text, once, in ``Metric.__init__``
    (every ``__init__`` of the chain has recorded its arguments before it runs): unknown
    arguments and excluded ones left out, the rest checked to be comparable. Raises
    ``TypeError`` naming an argument that cannot be compared."""
    cls = type(metric)
    skip = set(NEVER) | set(unknown) | declared(cls, "fingerprint_exclude")
    out: Dict[str, str] = {}
    values: Dict[str, Any] = {}  # as given: what an export hands a driver to rebuild the metric
    for name, value in metric.__dict__.get("_arguments", {}).items():
        if name in skip or (name == "slice_by" and value is None):  # unsliced: as before slicing existed
            continue
        out[name] = _text(metric, name, value)
        values[name] = value
    metric._arguments = out
    metric._argument_values = values


def _text(metric, name: str, value) -> str:
    if name in metric.__dict__.get("_float_arguments", ()) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return canonical(value, f"{type(metric).__name__}: argument {name!r}")


def current(metric) -> Dict[str, str]:
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


def declared(cls, attribute: str) -> Set[str]:
    """The names ``cls`` and every class above it list in ``attribute`` (``fingerprint_exclude``,
    ``fingerprint_sync_only``)."""
    return {n for klass in cls.__mro__ for n in vars(klass).get(attribute, ())}


def fingerprint(metric, checkpoint: bool = False) -> str:
    """``Class(name=value, ...)`` over the recorded arguments; ``checkpoint=True`` leaves
    out ``fingerprint_sync_only`` (what ranks must agree on, a checkpoint need not)."""
    cls = type(metric)
    skip = declared(cls, "fingerprint_sync_only") if checkpoint else ()
    parts = [f"{k}={v}" for k, v in current(metric).items() if k not in skip]
    return f"{cls.__module__}.{cls.__qualname__}({', '.join(parts)})"


def canonical(value, where: str) -> str:
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
                    "not change what a state means, list it in the class's fingerprint_exclude")


def constructor_keywords(cls) -> Optional[List[str]]:
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
        for p in inspect.signature(klass.__init__).parameters.values():
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


def warn_unknown_arguments(metric, kwargs: Mapping[str, Any]) -> None:
    """Warn once per (class, name) about constructor arguments ``metric`` ignores,
    pointing at the line that built the metric."""
    cls = type(metric)
    fresh = [k for k in sorted(kwargs) if (cls, k) not in _WARNED]
    if not fresh:
        return
    level, frame = 4, inspect.currentframe().f_back.f_back  # Metric.__init__'s caller
    while frame is not None and (frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is metric):
        level, frame = level + 1, frame.f_back  # a subclass __init__ (or its recording wrapper)
    known = constructor_keywords(cls) or []
    for key in fresh:
        _WARNED.add((cls, key))
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        warnings.warn(f"{cls.__name__}: ignoring unknown constructor argument {key!r}{hint}; "
                      f"it changes nothing, as in Twinkle's metrics. Known arguments: {known}",
                      UnknownArgumentWarning, stacklevel=level - 1)
    del frame  # a frame held in a local keeps every frame below it alive


def check_kwargs(metric, kwargs: Mapping[str, Any]) -> None:
    """Raise on an ``accumulate`` keyword that no metric takes, with a did-you-mean."""
    unknown = [k for k in kwargs if k not in KNOWN_KWARGS]
    if not unknown:
        return
    key = unknown[0]
    close = difflib.get_close_matches(key, sorted(KNOWN_KWARGS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise TypeError(f"{type(metric).__name__}.accumulate: unexpected keyword argument {key!r}{hint} "
                    "(no metric of twinkle-metrics takes it; keywords one metric takes are "
                    "accepted by all, so a shared kwargs dict works)")
