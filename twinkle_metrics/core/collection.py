"""``MetricCollection``: several metrics, one fused sync."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from parallel import DeviceMesh, as_device_mesh
from twinkle_metrics.comm import pending
from twinkle_metrics.comm.agreement import join_failed
from twinkle_metrics.comm.fused import sync_and_compute
from twinkle_metrics.core import checkpoint, staging
from twinkle_metrics.core.export import export_metrics
from twinkle_metrics.core.merge import merge_exports
from twinkle_metrics.core.metric import Metric, end_interval


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
                 device_mesh: Optional[DeviceMesh] = None):
        if isinstance(metrics, Mapping):
            items = list(metrics.items())
        else:
            items = [("", m) for m in metrics]
        device_mesh = as_device_mesh(device_mesh, "MetricCollection")
        for name, m in items:
            if not isinstance(m, Metric):
                raise TypeError(f"MetricCollection: {name or type(m).__name__} is not a Metric")
            if device_mesh is not None and m.device_mesh is None:
                m.device_mesh = device_mesh
        self._items: List = items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Metric]:
        return (m for _, m in self._items)

    def __getitem__(self, key: Union[int, str]) -> Metric:
        if isinstance(key, int):
            return self._items[key][1]
        for name, m in self._items:
            if name == key:
                return m
        raise KeyError(f"MetricCollection: no metric named {key!r}; have {[n for n, _ in self._items]}")

    def accumulate(self, inputs=None, outputs=None, **kwargs) -> "MetricCollection":
        """Pass the same call to every metric (each takes the keyword arguments it knows).

        All or nothing: every metric stages its part first and only when all
        succeeded are they folded in, so input one metric rejects leaves every metric
        unchanged (a retry cannot count the batch twice). When a metric fails, the
        metrics after it still join the exchanges they would have made inside
        ``accumulate``, so every rank raises together (``twinkle_metrics.exchange``).
        """
        metrics = [m for _, m in self._items]
        staged = []
        for i, m in enumerate(metrics):
            try:
                staged.append(staging.stage(m, inputs, outputs, kwargs))
            except Exception as exc:  # an interrupt joins nothing: it ends the job
                for n in metrics[i + 1:]:
                    if n.exchange_groups():
                        join_failed(n, exc, fresh=True)
                raise
        for s in staged:
            if s is not None:
                s.apply()
        return self

    def calculate(self, reset: bool = True, async_op: bool = False):
        """Results of every metric, reduced together; the same on every rank.

        ``async_op=True``: a ``CalculateHandle`` at once, as ``Metric.calculate``.
        """
        metrics = [m for _, m in self._items]
        if async_op:
            return pending.submit(metrics, self._combine, reset, "MetricCollection")
        for m in metrics:
            pending.settle(m)
        out = self._combine(sync_and_compute(metrics, reset=False))
        if reset:
            for m in metrics:
                end_interval(m)
        return out

    def _combine(self, per_metric: List[Dict[str, Any]]) -> Dict[str, Any]:
        """One dict from the per-metric results, keys prefixed by the metrics' names."""
        out: Dict[str, Any] = {}
        for (name, _m), results in zip(self._items, per_metric):
            for key, value in results.items():
                full = f"{name}/{key}" if name else key
                if full in out:  # raised before any reset: the interval is not lost
                    raise ValueError(f"MetricCollection: key {full!r} comes from two metrics; pass "
                                     "the metrics as a dict {name: metric} to prefix their keys")
                out[full] = value
        return out

    def export(self) -> Dict[str, Any]:
        """Every metric's states as one plain JSON value, for a driver's ``calculate_from``;
        not collective, one copy to the host; ends every metric's interval, as
        ``calculate()`` does (see ``Metric.export``)."""
        metrics = [m for _, m in self._items]
        for m in metrics:
            pending.settle(m)
        out = export_metrics(self._items, "MetricCollection.export()")
        for m in metrics:
            end_interval(m)
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
