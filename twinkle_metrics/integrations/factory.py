"""Build metrics and loggers from a config, so a training script wires no groups by hand.

A config is a plain dict (JSON files in ``configs/``; no YAML dependency)::

    {
      "metrics": [
        {"type": "LossMetric", "kwargs": {"loss_reduction": "sum"}},
        {"type": "Accuracy", "kwargs": {"vocab_parallel": true}},
        {"type": "TrainMetric"},
        {"type": "my_pkg.my_module:MyMetric", "name": "custom"}
      ],
      "logging": {"interval": 5, "sinks": ["console", "jsonl", "tensorboard"]}
    }

``type`` is a shipped metric's class name (``metrics.SHIPPED``), a name added with
``register_metric``, or ``"module:Class"``. Every metric gets the mesh, so all of
them reduce over the same data group. Without ``name`` fields the result keys are
the metrics' own (Twinkle's keys); with names on every entry, keys become
``"{name}/{key}"``.

Example::

    mesh = DeviceMesh.from_megatron()
    metrics = build_metrics(config["metrics"], mesh)   # a MetricCollection
"""
from __future__ import annotations

import copy
import difflib
import importlib
import inspect
import json
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Type, Union

from parallel import MeshLike
from twinkle_metrics.core.collection import MetricCollection
from twinkle_metrics.core.metric import Metric, constructor_keywords
from twinkle_metrics.metrics import SHIPPED

_REGISTRY: Dict[str, Type[Metric]] = {}
_RESERVED_KWARGS = ("device_mesh", "process_group")
_ENTRY_KEYS = ("type", "name", "kwargs", "feed")
# Which call of a training loop reaches a metric (see ``split_feeds``).
FEEDS = ("step", "microbatch")
_STEP_METRICS = ("LossMetric", "TrainMetric")


def register_metric(name: str, cls: Type[Metric]) -> Type[Metric]:
    """Make ``cls`` buildable from configs as ``{"type": name}``."""
    if not (inspect.isclass(cls) and issubclass(cls, Metric)):
        raise TypeError(f"register_metric: {cls!r} is not a Metric subclass")
    _REGISTRY[name] = cls
    return cls


def available_metrics() -> Dict[str, Type[Metric]]:
    """Every metric name a config may use without a ``module:Class`` path."""
    found = dict(SHIPPED)
    found.update(_REGISTRY)
    return dict(sorted(found.items()))


def resolve_metric(type_name: str) -> Type[Metric]:
    """The class for a config ``type``; a clear error listing valid names otherwise."""
    if not isinstance(type_name, str) or not type_name:
        raise TypeError(f"build_metrics: metric 'type' must be a non-empty string, got {type_name!r}")
    if ":" in type_name:
        module_name, _, attr = type_name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"build_metrics: cannot import metric {type_name!r} ({exc}); use "
                             "'package.module:ClassName'") from exc
        if not (inspect.isclass(cls) and issubclass(cls, Metric)):
            raise TypeError(f"build_metrics: {type_name!r} is not a twinkle_metrics.Metric subclass")
        return cls
    known = available_metrics()
    if type_name not in known:
        raise ValueError(f"build_metrics: unknown metric {type_name!r}; valid: {sorted(known)} "
                         "(or 'package.module:ClassName' for your own)")
    return known[type_name]


def metric_kwargs(cls: Type[Metric]) -> Optional[List[str]]:
    """Keyword arguments ``cls`` accepts besides the mesh; ``None`` if it cannot be told.

    The named parameters of the ``__init__`` chain (``base.constructor_keywords``).
    A metric built directly ignores other arguments with a warning, as Twinkle's do;
    a config is stricter: ``build_metric`` rejects them, since there they are typos.
    """
    return constructor_keywords(cls)


def build_metric(entry: Mapping[str, Any], device_mesh: MeshLike = None) -> Metric:
    """One metric from ``{"type": ..., "kwargs": {...}}`` with ``device_mesh`` handed in."""
    if isinstance(entry, str):
        entry = {"type": entry}
    if not isinstance(entry, Mapping):
        raise TypeError(f"build_metrics: each metric entry must be a dict or a type name, got "
                        f"{type(entry).__name__}")
    extra = set(entry) - set(_ENTRY_KEYS)
    if extra:
        raise ValueError(f"build_metrics: metric entry {dict(entry)} has unknown fields "
                         f"{sorted(extra)}; valid: {list(_ENTRY_KEYS)}")
    if "type" not in entry:
        raise ValueError(f"build_metrics: metric entry {dict(entry)} has no 'type'; valid types: "
                         f"{sorted(available_metrics())}")
    cls = resolve_metric(entry["type"])
    kwargs = dict(entry.get("kwargs") or {})
    reserved = [k for k in kwargs if k in _RESERVED_KWARGS]
    if reserved:
        raise ValueError(f"build_metrics: {entry['type']} kwargs must not set {reserved}; the "
                         "factory hands every metric the mesh")
    valid = metric_kwargs(cls)
    if valid is not None:
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise ValueError(f"build_metrics: {entry['type']} got unknown kwargs {unknown}; "
                             f"valid: {valid}")
    return cls(device_mesh=device_mesh, **kwargs)


def build_metrics(entries: Union[Sequence[Any], Mapping[str, Any]], device_mesh: MeshLike = None
                  ) -> MetricCollection:
    """A ``MetricCollection`` of every entry, all sharing ``device_mesh``.

    Raises:
        ValueError: unknown metric types or kwargs (the message lists the valid
            ones), an empty list, or names on some entries but not others.
    """
    if isinstance(entries, Mapping) and "metrics" in entries:
        entries = entries["metrics"]
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ValueError("build_metrics: 'metrics' must be a non-empty list of "
                         "{'type': ..., 'kwargs': {...}} entries")
    metrics = [build_metric(e, device_mesh) for e in entries]
    for e in entries:
        feed_of(e)  # a bad 'feed' is a config error too
    names: List[Any] = [e.get("name") if isinstance(e, Mapping) else None for e in entries]
    if all(n is None for n in names):
        return MetricCollection(metrics, device_mesh=device_mesh)
    if any(n is None for n in names):
        raise ValueError(f"build_metrics: give every metric a 'name' or none (got {names}); "
                         "names prefix result keys as 'name/key'")
    if len(set(names)) != len(names):
        raise ValueError(f"build_metrics: metric names must be unique, got {names}")
    return MetricCollection(dict(zip(names, metrics)), device_mesh=device_mesh)


def feed_of(entry: Any) -> str:
    """``"step"`` or ``"microbatch"`` for a metric entry.

    ``"step"`` metrics get one call per optimizer step with the schedule's report
    list and step statistics (``accumulate(None, losses_reduced, grad_norm=..., lr=...)``);
    ``"microbatch"`` metrics get each microbatch's features and model outputs
    (``accumulate(feature, {"logits": logits})``). Default: LossMetric and
    TrainMetric are step metrics, everything else reads model outputs.
    """
    entry = {"type": entry} if isinstance(entry, str) else entry
    feed = entry.get("feed")
    if feed is None:
        name = resolve_metric(entry.get("type")).__name__
        return "step" if name in _STEP_METRICS else "microbatch"
    if feed not in FEEDS:
        raise ValueError(f"build_metrics: {entry.get('type')} has feed {feed!r}; valid: {list(FEEDS)}")
    return feed


def split_feeds(entries: Union[Sequence[Any], Mapping[str, Any]], collection: MetricCollection
                ) -> Tuple[MetricCollection, MetricCollection]:
    """``(step_metrics, microbatch_metrics)``: the collection's metrics grouped by ``feed_of``,
    each a ``MetricCollection`` to feed one shared call (each member takes its keywords).

    The collection still calculates them all together (one fused sync).
    """
    if isinstance(entries, Mapping) and "metrics" in entries:
        entries = entries["metrics"]
    if len(entries) != len(collection):
        raise ValueError(f"split_feeds: {len(entries)} entries but {len(collection)} metrics")
    step: List[Tuple[str, Metric]] = []
    micro: List[Tuple[str, Metric]] = []
    for entry, item in zip(entries, collection.members()):
        (step if feed_of(entry) == "step" else micro).append(item)

    def part(items: List[Tuple[str, Metric]]) -> MetricCollection:
        return MetricCollection(dict(items) if any(name for name, _ in items) else [m for _, m in items])

    return part(step), part(micro)


# ------------------------------------------------------------------ configs
def load_config(path: str, overrides: Iterable[str] = (), *, strict: bool = False,
                optional: Iterable[str] = ()) -> Dict[str, Any]:
    """Read a JSON config and apply ``key.sub=value`` overrides (values parsed as JSON).

    ``path`` is a file or the name of a shipped config (see ``config_path``).
    Example: ``load_config("megatron_demo", ["train.steps=8"])``. ``strict``: see
    ``apply_overrides``.
    """
    path = config_path(path)
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"load_config: {path} is not valid JSON: {exc}") from exc
    return apply_overrides(config, overrides, strict=strict, optional=optional)


def apply_overrides(config: Mapping[str, Any], overrides: Iterable[str], *, strict: bool = False,
                    optional: Iterable[str] = ()) -> Dict[str, Any]:
    """``config`` with ``key.sub=value`` overrides applied (a copy).

    ``strict`` (what the launch scripts use): a key must be in the config or in
    ``optional`` (dotted keys a program reads with a default), else the override is
    refused with a did-you-mean, so a typo cannot quietly run another experiment; and a
    value must have the type of the one it replaces (an int where a float was is fine,
    a bare string where a list was becomes a one-element list).
    """
    out = copy.deepcopy(dict(config))
    optional = set(optional)
    for item in overrides or ():
        key, sep, raw = item.partition("=")
        if not sep or not key or "" in key.split("."):
            raise ValueError(f"config override {item!r} must look like 'section.key=value'")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # bare strings need no quotes
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ValueError(f"config override {item!r}: {part!r} is not a section")
            node = child
        if strict:
            value = _checked_override(item, key, node, parts[-1], value, config, optional)
        node[parts[-1]] = value
    return out


def _checked_override(item, key, node, name, value, config, optional):
    if name not in node:
        if key in optional:
            return value
        known = sorted(set(_dotted_keys(config)) | optional)
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"config override {item!r}: the config has no {key!r}; {hint}known keys: {known}")
    old = node[name]
    raw = item.partition("=")[2]
    if isinstance(old, str) and not isinstance(value, str):
        return raw  # a string key keeps its text: logging.run_root=2024
    if isinstance(old, list) and isinstance(value, str):
        return [value]
    numbers = (int, float)
    same = (type(old) is type(value) or (type(old) is float and type(value) is int)
            or old is None or value is None)
    if not same or (isinstance(old, numbers) and isinstance(value, bool) != isinstance(old, bool)):
        raise ValueError(f"config override {item!r}: {key} is {type(old).__name__} ({old!r}) in the config, "
                         f"got {type(value).__name__} ({value!r})")
    return value


def _dotted_keys(node, prefix=""):
    for k, v in node.items():
        yield prefix + k
        if isinstance(v, dict):
            yield from _dotted_keys(v, prefix + k + ".")


def config_path(name_or_path: str) -> str:
    """A config file path. Names that are not a file are looked up among the shipped
    configs (``twinkle_metrics/configs`` in an installed package, the repository's
    ``configs/`` in a checkout), with or without ``.json``: ``config_path("megatron_demo")``."""
    if os.path.exists(name_or_path):
        return name_or_path
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # twinkle_metrics/
    places = [os.path.join(package, "configs"), os.path.join(os.path.dirname(package), "configs")]
    name = os.path.basename(name_or_path) if name_or_path.startswith("configs" + os.sep) else name_or_path
    for place in places:
        for candidate in (os.path.join(place, name), os.path.join(place, name + ".json")):
            if os.path.isfile(candidate):
                return candidate
    shipped = sorted({f[:-5] for p in places if os.path.isdir(p) for f in os.listdir(p) if f.endswith(".json")})
    raise FileNotFoundError(f"config {name_or_path!r} is not a file, nor one of the shipped configs "
                            f"{shipped}")
