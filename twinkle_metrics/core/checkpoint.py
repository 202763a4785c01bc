"""Checkpoints: a metric's local states and fingerprint out, and back in, all or nothing.

``load_state_dict`` takes one state dict or a list of them (several ranks of an earlier
run, merged with each state's own reduction, as ``calculate()`` would merge those ranks:
resuming at a smaller data-parallel size). States created on the fly come back through
the metric's declarations (families, slices). ``Metric.load_state_dict`` and
``MetricCollection.load_state_dict`` both ``stage_load`` (validate, change nothing) and
then ``commit_load`` (cannot fail), so a collection loads all or nothing.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Dict

import torch

from twinkle_metrics.comm import pending
from twinkle_metrics.core import config, slicing
from twinkle_metrics.core.state import interval_of

#: key of the schema fingerprint in a metric's ``state_dict()``
FINGERPRINT_KEY = "__fingerprint__"


def stage_load(self, state_dict) -> tuple:
    """Validate and convert ``state_dict``; change nothing. Returns (new dynamic
    names, {name: tensor})."""
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
    names = set().union(*(set(d) - {FINGERPRINT_KEY} for d in dicts))
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
    return new, loaded


def commit_load(metric, staged: tuple) -> None:
    """Install what ``stage_load`` returned; cannot fail."""
    new, loaded = staged
    iv = interval_of(metric)
    iv.adopt(new)
    iv.states = {k: loaded[k] for k in iv.specs}
    iv.touched = set(iv.specs)  # loaded values stand for calls of their own
    pending.drop_returned(iv.handoffs)
