"""``MetricCollection``: several metrics, one fused sync."""
from __future__ import annotations

import re
from typing import Any, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Tuple, Union, overload

from parallel import MeshLike, as_device_mesh
from twinkle_metrics.comm import pending
from twinkle_metrics.comm.agreement import join_failed
from twinkle_metrics.core import checkpoint, interval, staging
from twinkle_metrics.core.export import export_metrics
from twinkle_metrics.core.merge import merge_exports
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import interval_of
from twinkle_metrics.inputs import fields
from twinkle_metrics.inputs.data_format import Inputs, Outputs


def _label(i: int, name: str, m: Metric) -> str:
    return f"member {i} ({name!r}: {type(m).__name__})" if name else f"member {i} ({type(m).__name__})"


def _refuse_clashes(items: List[Tuple[str, Metric]]) -> None:
    """Raise ``ValueError`` when the same metric comes twice (each call would fold into it
    twice) or when two members could return the same key (``Metric.result_keys``): found
    when the collection is built, on every rank alike, before any collective."""
    seen: Dict[int, int] = {}
    for i, (name, m) in enumerate(items):
        j = seen.setdefault(id(m), i)
        if j != i:
            raise ValueError(f"MetricCollection: {_label(j, *items[j])} and {_label(i, name, m)} are the same "
                             "metric object, which would fold every call in twice; build a second metric")
    keys = [[full_key(name, k) for k in m.keys_declared()] for name, m in items]
    for i in range(len(items)):
        for j in range(i):
            key = _common(keys[j], keys[i])
            if key is not None:
                raise ValueError(f"MetricCollection: {_label(j, *items[j])} and {_label(i, *items[i])} both return "
                                 f"{key!r}; pass the metrics as a dict {{name: metric}} to prefix their keys "
                                 "(an empty name keeps a member's keys as they are)")


def full_key(name: str, key: str) -> str:
    return f"{name}/{key}" if name else key


def _common(a: List[str], b: List[str]) -> Optional[str]:
    """A key both lists of result keys name: the same key, or a key of one that a pattern
    (``*``) of the other matches. Two patterns are not compared: what they match depends on
    the data (reward names, slices), so ``calculate()`` checks those."""
    for x in a:
        for y in b:
            if "*" in x and "*" in y:
                continue
            if x == y or ("*" in x and _matches(x, y)) or ("*" in y and _matches(y, x)):
                return y if "*" in x else x
    return None


def _matches(pattern: str, key: str) -> bool:
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), key) is not None


class MetricCollection:
    """Holds metrics and calculates them together in at most two collectives.

    Args:
        metrics: a list (result keys are merged as they are) or a dict
            ``{name: metric}`` (keys become ``"{name}/{key}"``; an empty name keeps
            keys as they are).
        device_mesh: given to every metric that has none, so they share groups
            (ours or Twinkle's ``DeviceMesh``, as for a metric).

    Example::

        metrics = MetricCollection([LossMetric(mesh), Accuracy(mesh)])
        metrics.accumulate(inputs, outputs)          # every metric sees the same call
        results = metrics.calculate()                # {'loss': ..., 'accuracy': ...}
    """

    def __init__(self, metrics: Union[Sequence[Metric], Mapping[str, Metric]],
                 device_mesh: MeshLike = None) -> None:
        if isinstance(metrics, Mapping):
            items = list(metrics.items())
        else:
            items = [("", m) for m in metrics]
        device_mesh = as_device_mesh(device_mesh, "MetricCollection")
        for name, m in items:
            if not isinstance(m, Metric):
                raise TypeError(f"MetricCollection: {name or type(m).__name__} is not a Metric")
        _refuse_clashes(items)
        for _, m in items:
            if device_mesh is not None and m.device_mesh is None:
                m.device_mesh = device_mesh
        self._items: List[Tuple[str, Metric]] = items

    def __len__(self) -> int:
        return len(self._items)

    def members(self) -> List[Tuple[str, Metric]]:
        """``[(name, metric)]`` in order (names are ``""`` in the list form)."""
        return list(self._items)

    def __iter__(self) -> Iterator[Metric]:
        return (m for _, m in self._items)

    def __getitem__(self, key: Union[int, str]) -> Metric:
        if isinstance(key, int):
            return self._items[key][1]
        for name, m in self._items:
            if name == key:
                return m
        raise KeyError(f"MetricCollection: no metric named {key!r}; have {[n for n, _ in self._items]}")

    def accumulate(self, inputs: Inputs = None, outputs: Outputs = None, **kwargs: Any) -> "MetricCollection":
        """Pass the same call to every metric; each gets the keyword arguments it takes.

        The call is checked once against what every member reads (``inputs.fields``): a
        member the call carries only part of a record for is excused when another member
        reads all of it (the call was meant for that one), and a keyword no member takes
        raises ``TypeError``.

        All or nothing: every metric stages its part first and only when all
        succeeded are they folded in, so input one metric rejects leaves every metric
        unchanged (a retry cannot count the batch twice). When a metric fails, the
        metrics after it still join the exchanges they would have made inside
        ``accumulate``, so every rank raises together (``twinkle_metrics.exchange``).
        """
        metrics = [m for _, m in self._items]
        try:
            own = fields.check_call(metrics, inputs, outputs, kwargs)
        except Exception as exc:  # peers of the members that communicate raise with this rank
            for n in metrics:
                if n.exchange_groups():
                    join_failed(n, exc, fresh=True)
            raise
        staged = []
        for i, m in enumerate(metrics):
            try:
                staged.append(staging.stage(m, inputs, outputs, own[i], checked=True))
            except Exception as exc:  # an interrupt joins nothing: it ends the job
                for n in metrics[i + 1:]:
                    if n.exchange_groups():
                        join_failed(n, exc, fresh=True)
                raise
        for s in staged:
            if s is not None:
                s.apply()
        return self

    @overload
    def calculate(self, reset: bool = ..., async_op: Literal[False] = ...) -> Dict[str, Any]: ...
    @overload
    def calculate(self, reset: bool = ..., *, async_op: Literal[True]) -> pending.CalculateHandle: ...
    @overload
    def calculate(self, reset: bool = ..., async_op: bool = ...) -> Union[Dict[str, Any], pending.CalculateHandle]: ...

    def calculate(self, reset: bool = True, async_op: bool = False
                  ) -> Union[Dict[str, Any], pending.CalculateHandle]:
        """Results of every metric, reduced together; the same on every rank.

        ``async_op=True``: a ``CalculateHandle`` at once, as ``Metric.calculate``.
        """
        metrics = [m for _, m in self._items]
        if async_op:
            return interval.calculate_async(metrics, reset, self._combine)
        return interval.calculate(metrics, reset, self._combine)

    def _combine(self, per_metric: List[Dict[str, Any]]) -> Dict[str, Any]:
        """One dict from the per-metric results, keys prefixed by the metrics' names."""
        out: Dict[str, Any] = {}
        for (name, _m), results in zip(self._items, per_metric):
            full = {full_key(name, key): value for key, value in results.items()}
            if not out.keys().isdisjoint(full):  # raised before any reset: the interval is not lost
                key = next(k for k in full if k in out)
                raise ValueError(f"MetricCollection: key {key!r} comes from two metrics; pass "
                                 "the metrics as a dict {name: metric} to prefix their keys")
            out.update(full)
        return out

    def export(self) -> Dict[str, Any]:
        """Every metric's states as one plain JSON value, for a driver's ``calculate_from``;
        not collective, one copy to the host; ends every metric's interval, as
        ``calculate()`` does (see ``Metric.export``)."""
        metrics = [m for _, m in self._items]
        for m in metrics:
            live = interval_of(m)
            pending.settle(live.handoffs, live)
        out = export_metrics(self._items, "MetricCollection.export()")
        interval.end(metrics)
        return out

    def calculate_from(self, exports: Sequence[Mapping[str, Any]], *, merge_intervals: bool = False) -> Dict[str, Any]:
        """On a driver: the dict ``calculate()`` returns on the workers, from their exports
        (see ``Metric.calculate_from``). Each metric merges from the exports that carry it
        (same name and class): the exports of several worker groups, each holding its own
        metrics, go in one list. Never touches the metrics' own states."""
        return self._combine(merge_exports(self._items, exports, merge_intervals=merge_intervals, single=False,
                                           what="MetricCollection.calculate_from"))

    def reset(self) -> "MetricCollection":
        for _, m in self._items:
            m.reset()
        return self

    def state_dict(self) -> Dict[str, Any]:
        return {f"{i}:{name}": m.state_dict() for i, (name, m) in enumerate(self._items)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> "MetricCollection":
        """Restore every metric; all or nothing. A list of collection state dicts
        (several ranks of an earlier run) is merged per metric, as
        ``Metric.load_state_dict`` does."""
        dicts = [state_dict] if isinstance(state_dict, Mapping) else list(state_dict)
        keys = [f"{i}:{name}" for i, (name, _) in enumerate(self._items)]
        for d in dicts:
            if not isinstance(d, Mapping) or sorted(keys) != sorted(d):
                got = sorted(d) if isinstance(d, Mapping) else type(d).__name__
                raise ValueError(f"MetricCollection.load_state_dict: expected keys {keys}, got {got}")
        staged = [checkpoint.stage_load(m, [d[key] for d in dicts]) for key, (_, m) in zip(keys, self._items)]
        for (_, m), s in zip(self._items, staged):
            checkpoint.commit_load(m, s)
        return self
