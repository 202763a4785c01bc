"""Checkpoints: a metric's local states and fingerprint out, and back in, all or nothing.

``load_state_dict`` takes one state dict or a list of them (several ranks of an earlier
run, merged with each state's own reduction, as ``calculate()`` would merge those ranks:
resuming at a smaller data-parallel size). States created on the fly come back through
the metric's declarations (families, slices). ``Metric.load_state_dict`` and
``MetricCollection.load_state_dict`` both ``stage_load`` (validate, change nothing) and
then ``commit_load`` (cannot fail), so a collection loads all or nothing.

A load starts the interval anew: its origins (``core.state.Origin``) are taken at the
load, a clock read there and a state's origin from the newest host number the saving run
had folded into that state (saved under ``FOLLOWED_KEY`` by metrics with such an origin),
so a step counter goes on from the saved run's last step.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, Sequence, Set, Union

import torch

from twinkle_metrics.core import config, slicing
from twinkle_metrics.core.state import interval_of

#: key of the schema fingerprint in a metric's ``state_dict()``
FINGERPRINT_KEY = "__fingerprint__"
#: key of ``{state: newest host number folded into it}`` for the states an Origin follows
FOLLOWED_KEY = "__followed__"


def stage_load(self: Any, state_dict: Union[Mapping[str, Any], Sequence[Mapping[str, Any]]]) -> tuple:
    """Validate and convert ``state_dict``; change nothing. Returns (new dynamic
    names, {name: tensor}, {followed state: newest host number})."""
    name = type(self).__name__
    dicts = [state_dict] if isinstance(state_dict, Mapping) else list(state_dict)
    if not dicts or not all(isinstance(d, Mapping) for d in dicts):
        raise TypeError(f"{name}.load_state_dict: expected a state dict or a non-empty list of "
                        f"them, got {type(state_dict).__name__}")
    mine = self.fingerprint()
    for i, d in enumerate(dicts):
        theirs = d.get(FINGERPRINT_KEY)
        why = None if theirs is None or theirs == mine else config.checkpoint_mismatch(self, theirs)
        if why is not None:
            where = f"state dict {i}" if len(dicts) > 1 else "the state dict"
            raise ValueError(f"{name}.load_state_dict: {where} was saved by {theirs} but this "
                             f"metric is {mine}: {why}; build the metric with the same class and "
                             "arguments as the run that saved it")
    names: Set[str] = set().union(*(set(d) - {FINGERPRINT_KEY, FOLLOWED_KEY} for d in dicts))
    held = interval_of(self)
    specs = dict(held.specs)
    new = []
    for key in sorted(names - set(specs)):
        spec = self.state_spec(key)
        if spec is not None:
            specs[key] = spec
            new.append(key)
    extra = sorted(names - set(specs))
    if self.slice_by is not None:
        error = slicing.over_bound(self, slicing.held(specs), self.max_slices, "load")
        if error:
            raise ValueError(error)
    missing = sorted({k for d in dicts for k in specs if k not in d and self.state_spec(k) is None})
    if missing or extra:
        raise ValueError(f"{name}.load_state_dict: missing states {missing}, unexpected {extra}; "
                         "load a state dict saved by the same metric")
    rows: Dict[str, torch.Tensor] = {}
    for key, spec in specs.items():
        values = []
        for d in dicts:
            if key not in d:  # created on the fly elsewhere: its default
                values.append(spec.new("cpu"))
                continue
            value = torch.as_tensor(d[key]).detach()
            if tuple(value.shape) != spec.shape:
                raise ValueError(f"{name}.load_state_dict: state {key!r} has shape "
                                 f"{list(value.shape)}, expected {list(spec.shape)}")
            values.append(value.to(device="cpu", dtype=spec.dtype))
        rows[key] = torch.stack(values)
    if len(dicts) == 1:
        merged = {k: r[0] for k, r in rows.items()}
    else:
        merged = {k: specs[k].merge(r) for k, r in rows.items()}
    loaded = {k: merged[k].to(device=held.device, dtype=specs[k].dtype).clone() for k in specs}
    return new, loaded, _followed(self, dicts, specs)


def _followed(metric, dicts, specs) -> Dict[str, float]:
    """The saved newest host numbers of the states an Origin follows, merged over the dicts
    with each state's reduction."""
    name, held = type(metric).__name__, interval_of(metric)
    values: Dict[str, list] = {}
    for i, d in enumerate(dicts):
        saved = d.get(FOLLOWED_KEY, {})
        if not isinstance(saved, Mapping) or not all(
                k in held.followed and isinstance(v, (int, float)) and not isinstance(v, bool)
                for k, v in saved.items()):
            raise ValueError(f"{name}.load_state_dict: {FOLLOWED_KEY!r} of state dict {i} is {saved!r}; "
                             f"expected numbers for states among {sorted(held.followed)}; load a state "
                             "dict saved by the same metric")
        for k, v in saved.items():
            values.setdefault(k, []).append(v)
    return {k: specs[k].merge(torch.tensor(v, dtype=specs[k].dtype)).item() for k, v in values.items()}


def commit_load(metric: Any, staged: tuple) -> None:
    """Install what ``stage_load`` returned, and start the interval at the load; cannot fail."""
    new, loaded, followed = staged
    interval_of(metric).last_host.update(followed)
    metric.reset()  # a new interval: its origins are read now, intervals given back are dropped
    iv = interval_of(metric)
    iv.adopt(new)
    iv.states = {k: loaded[k] for k in iv.specs}
    iv.touched = set(iv.specs)  # loaded values stand for calls of their own
