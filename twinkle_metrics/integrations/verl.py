"""verl: exact metrics through the metrics dict a worker's update returns.

On the workers, the metrics accumulate as usual (in the loss function, every micro-batch)
and each rank puts its export into the metrics dict of its update, once per update and
wrapped in a list (verl flattens one level of list per data-parallel gather)::

    tm_export = [metrics.export()]                  # every rank, once per train_batch
    if self.engine.is_mp_src_rank_with_outputs():   # the ranks whose output goes on
        output["metrics"]["twinkle"] = tm_export

verl gathers the dict over data parallelism (``all_gather_object``), flattens one level of
list, keeps the model-parallel source ranks (TP rank 0, last stage, CP rank 0) and extends
the lists of every mini-batch, so the driver receives, under ``"actor/twinkle"``, the list
of every data-parallel rank's exports of every mini-batch (nested lists are read alike).
Under context parallelism verl keeps CP rank 0 only: gather the exports of the CP group
into that list first (``all_gather_object``), or the driver raises for the missing shards;
metrics with states of every stage (``scope="stage"``) cannot come this way. On the driver,
``reduce_metrics`` here replaces verl's ``verl.utils.metric.reduce_metrics``::

    from twinkle_metrics.integrations.verl import reduce_metrics
    actor_output_metrics = reduce_metrics(actor_output.meta_info["metrics"])

It merges the exports under each key exactly (``calculate_from`` with
``merge_intervals=True``: the mini-batches of a step merge as one interval), putting each
result under ``"{key}/{result key}"``, and reduces every other key as verl does. An export may
also come as JSON text (``json.dumps(metrics.export())``). Only numbers enter the metrics
verl logs: results that are not (GRPO's ``_high_kl_records``, a list of dicts) go to the
``records`` dict the caller passes, or nowhere. The library does not import verl.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Dict, List, Optional

import numpy as np

from twinkle_metrics.core.export import FORMAT, is_export
from twinkle_metrics.integrations.loggers import is_number
from twinkle_metrics.metrics import from_export

__all__ = ["reduce_metrics", "exports_in"]


def exports_in(value: Any) -> Optional[List[Mapping]]:
    """The exports ``value`` holds: itself when it is one, the leaves of a (nested) list
    of them, each an export or its JSON text (``json.dumps(export)``, read back); ``None``
    when it holds none. A list mixing exports with other values raises ``ValueError`` (a
    merge of part of them would be a wrong number), as does JSON text of an export that
    does not parse."""
    leaves: List[Any] = []
    stack = [value]
    while stack:
        item = _read_json(stack.pop())
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        else:
            leaves.append(item)
    found = [v for v in leaves if is_export(v)]
    if not found:
        return None
    if len(found) != len(leaves):
        other = next(v for v in leaves if not is_export(v))
        raise ValueError(f"{len(found)} exports and {len(leaves) - len(found)} other values ({type(other).__name__} "
                         f"{other!r:.60}) under one key; put only metrics.export() values under a key")
    return found


def _read_json(value: Any) -> Any:
    """``value``, or the JSON it holds when it is JSON text naming the export format."""
    if not isinstance(value, str) or FORMAT not in value or not value.lstrip().startswith(("{", "[")):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise ValueError(f"JSON text naming {FORMAT!r} that does not parse ({exc}); pass json.dumps(export()) "
                         "as it came, or the export itself") from None


def _verl_reduce(key: str, value: Any) -> Any:
    """verl 0.9's rule for one key (``verl.utils.metric.reduce_metrics``): a verl ``Metric``
    aggregates itself, else np.max when the key holds "max", np.min when it holds "min",
    else np.mean."""
    if not isinstance(value, (list, tuple, np.ndarray)) and callable(getattr(value, "aggregate", None)):
        return value.aggregate()
    if "max" in key:
        return np.max(value)
    if "min" in key:
        return np.min(value)
    return np.mean(value)


def reduce_metrics(metrics: Dict[str, Any], *, drivers: Optional[Mapping[str, Any]] = None,
                   merge_intervals: bool = True, records: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """verl's ``reduce_metrics``, with the exports of this library merged exactly.

    Every key that holds exports (one, or a nested list of them: what verl's gathers
    make of ``[metrics.export()]``; each export itself or its JSON text) is replaced by the
    merged results that are numbers, each under ``"{key}/{result key}"``; every other key is
    reduced as verl 0.9 reduces it. As verl's, it changes ``metrics`` in place and returns it.

    Args:
        metrics: the metrics dict a worker group's update returned to the driver.
        drivers: ``{key: Metric or MetricCollection}`` built on the driver with the workers'
            arguments and no mesh, for metrics of one's own classes; the library's metrics
            are rebuilt from the exports (``twinkle_metrics.from_export``).
        merge_intervals: merge the exports of several intervals (the mini-batches and
            epochs of one update) as one long interval, as the default; ``False`` raises
            when a key holds more than one interval.
        records: a dict that receives the merged results that are not numbers (GRPO's
            ``_high_kl_records``), under the same ``"{key}/{result key}"``; None: they are
            left out. verl's loggers take numbers only.

    Raises ``ValueError``/``TypeError`` naming the key, before ``metrics`` is changed, when
    the exports under a key cannot be merged (a data shard missing, replicas that
    disagree, a malformed export or JSON text; see ``calculate_from``) or another key
    cannot be reduced as verl does (numpy's error, with the key).

    Example:
        >>> from twinkle_metrics import LossMetric
        >>> worker = LossMetric(loss_reduction="sum")            # on a worker
        >>> _ = worker.accumulate(None, {"loss": 6.0, "num_tokens": 3})
        >>> got = {"actor/twinkle": [[worker.export()]], "actor/pg_loss": [1.0, 3.0], "actor/ratio_max": [1.5, 2.0]}
        >>> {k: float(v) for k, v in reduce_metrics(got).items()}   # on the driver
        {'actor/pg_loss': 2.0, 'actor/ratio_max': 2.0, 'actor/twinkle/loss': 2.0, 'actor/twinkle/num_tokens': 3.0}
    """
    drivers = dict(drivers or {})
    merged: Dict[str, Dict[str, Any]] = {}
    for key, value in metrics.items():
        try:
            exports = exports_in(value)
            if exports is None:
                continue
            driver = drivers.get(key)
            if driver is None:
                driver = from_export(exports)
            merged[key] = driver.calculate_from(exports, merge_intervals=merge_intervals)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"reduce_metrics: key {key!r}: {exc}") from None
    unused = sorted(set(drivers) - set(merged))
    if unused:
        raise ValueError(f"reduce_metrics: drivers given for keys {unused}, which hold no exports (keys with exports: "
                         f"{sorted(merged)})")
    for key, results in merged.items():
        taken = sorted(f"{key}/{name}" for name in results if f"{key}/{name}" in metrics)
        if taken:
            raise ValueError(f"reduce_metrics: key {key!r}: its results {taken[:4]} would overwrite keys of the same "
                             "name; put the exports under another key")
    reduced = {}
    for key, value in metrics.items():
        if key not in merged:
            try:
                reduced[key] = _verl_reduce(key, value)
            except Exception as exc:  # noqa: BLE001 - numpy's errors, named by the key
                kind = ValueError if isinstance(exc, ValueError) else TypeError
                raise kind(f"reduce_metrics: key {key!r} holds {type(value).__name__} {value!r:.60}, which verl's "
                           f"rule (np.mean, np.max, np.min) cannot reduce: {exc}") from exc
    for key in list(metrics):
        if key in merged:
            del metrics[key]
            for name, result in merged[key].items():
                if is_number(result):
                    metrics[f"{key}/{name}"] = result
                elif records is not None:
                    records[f"{key}/{name}"] = result
        else:
            metrics[key] = reduced[key]
    return metrics
