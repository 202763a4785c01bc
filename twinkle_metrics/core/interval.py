"""``Interval``: what a metric accumulated since its last reset, as one object.

The machinery that moves a metric's states (staging in ``accumulate``, the fused sync,
asynchronous calculate and its fold-back, checkpoints, exports and the driver's merge)
works on this object and its public methods, never on the metric's attributes:

* data: ``specs`` (each state's declaration), ``states`` (the tensors), ``device``,
  ``touched`` (the states folded into), ``origins`` (host values fixed at its start),
  ``number`` (intervals the metric ended before this one);
* what it needs to know of its metric: ``name``, ``spec_of(name)`` / ``dynamic_spec(name)``
  (declarations of states created on the fly), ``slice_bound`` and ``over_bound``
  (``max_slices``), ``tp_mismatch_hint``, ``handoffs`` (``comm.pending.HandOffs``);
* verbs: ``adopt(names)`` (create states other ranks hold), ``fold_under(earlier)`` (an
  earlier interval under this one, as one), ``copy(...)``.

A metric holds its current interval (``core.state.interval_of(metric)``); ``reset()`` starts a new one. The
lower layer (``comm``) is handed intervals and plain data, and never reaches the metric.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from twinkle_metrics.comm import pending
from twinkle_metrics.comm.fused import plain_states, sync_states
from twinkle_metrics.comm.transport import Transport, on_twins
from twinkle_metrics.core import slicing, staging
from twinkle_metrics.core.state import State, interval_of, move_states, new_states_each

__all__ = ["Interval", "calculate", "calculate_async", "computing", "end", "results", "sync_and_compute"]


class Interval:
    """One interval of one metric: its states, their declarations, what was folded into."""

    __slots__ = ("owner", "specs", "states", "device", "touched", "origins", "number", "handoffs",
                 "followed", "last_host", "fresh")

    def __init__(self, owner: Any, specs: Dict[str, State], states: Dict[str, torch.Tensor], device: torch.device,
                 *, origins: Optional[Dict[str, Any]] = None, touched: Optional[Set[str]] = None, number: int = 0,
                 handoffs: Optional[pending.HandOffs] = None, followed: frozenset = frozenset(),
                 last_host: Optional[Dict[str, Any]] = None) -> None:
        self.owner = owner  # the metric: its configuration (``compute``, slicing), never its states
        self.specs, self.states, self.device = specs, states, device
        self.touched: Set[str] = set() if touched is None else touched
        self.origins: Dict[str, Any] = {} if origins is None else origins
        self.number = number
        self.handoffs = handoffs
        # the states an ``Origin`` follows, and the newest host number folded into each
        # (shared with the metric's next intervals: it is kept over resets)
        self.followed = followed
        self.last_host: Dict[str, Any] = {} if last_host is None else last_host
        # the next interval's states when they were made beside other metrics' (``end``)
        self.fresh: Optional[Dict[str, torch.Tensor]] = None

    # --------------------------------------------------------------- the metric's facts
    @property
    def name(self) -> str:
        return type(self.owner).__name__

    @property
    def tp_mismatch_hint(self) -> Optional[str]:
        return self.owner.tp_mismatch_hint

    @property
    def slice_bound(self) -> Optional[int]:
        """``max_slices`` of a sliced metric, else None."""
        return self.owner.max_slices if self.owner.slice_by is not None else None

    def dynamic_spec(self, name: str) -> Optional[State]:
        """The declaration of a state created on the fly under ``name``, else None."""
        return self.owner.state_spec(name)

    def spec_of(self, name: str) -> Optional[State]:
        """The declaration of ``name``: held, or one the metric creates on the fly (None: neither)."""
        spec = self.specs.get(name)
        return spec if spec is not None else self.owner.state_spec(name)

    def over_bound(self, names: Sequence[str], bound: int, where: str = "sync") -> Optional[str]:
        """Why the slices ``names`` hold exceed ``bound`` (``max_slices``); None when within it."""
        return slicing.over_bound(self.owner, slicing.held(names), bound, where)

    # ------------------------------------------------------------------------ verbs
    def adopt(self, names: Sequence[str]) -> None:
        """Create the states ``names`` (valid states created on the fly) at their identity."""
        for name in names:
            if name not in self.specs:
                spec = self.owner.state_spec(name)
                spec.name = name
                self.specs[name] = spec
                self.states[name] = spec.new(self.device)

    def copy(self, states: Optional[Dict[str, torch.Tensor]] = None, device: Optional[torch.device] = None,
             touched: Optional[Set[str]] = None, last_host: Optional[Dict[str, Any]] = None) -> "Interval":
        """A copy with its own ``specs`` and ``touched`` (and ``states``: the same tensors unless
        given), out of the metric's hand-off ledger; its host numbers are ``last_host`` (a
        fresh record unless given)."""
        return Interval(self.owner, dict(self.specs), dict(self.states) if states is None else states,
                        self.device if device is None else device, origins=self.origins,
                        touched=set(self.touched) if touched is None else touched, number=self.number,
                        followed=self.followed, last_host=last_host)

    def fold_under(self, earlier: "Interval") -> None:
        """Put an earlier interval under this one's states, as if the two had been one:
        ``earlier``'s states come first, and the states this interval folded into fold
        onto them with each state's own ``local`` fold, as ``accumulate`` folds a call (a
        "last" state this interval set wins; one it never set keeps ``earlier``'s; values
        measured from an origin are absolute, so a ``"min"`` fold keeps ``earlier``'s start),
        and the interval keeps ``earlier``'s origins. Not bounded by ``max_slices``: both
        intervals were within it when handed off."""
        specs = {**earlier.specs, **self.specs}
        # a kept state of this interval started from earlier's value (``end``): it holds both
        first = {k: self.states[k] if spec.keep and k in self.states else earlier.states.get(k)
                 for k, spec in specs.items()}
        base = move_states({k: spec.new("cpu") if (t := first[k]) is None else t.clone()
                            for k, spec in specs.items()}, self.device)  # earlier may go under others too
        later = {k: self.states[k] for k in self.touched if k in self.states and not specs[k].keep}
        saved = self.specs, self.states
        self.specs, self.states = specs, base
        try:
            staged = staging.plan(self, later)
        except BaseException:
            self.specs, self.states = saved
            raise
        staged.apply()
        self.touched = earlier.touched | self.touched
        self.origins = dict(earlier.origins)


# ------------------------------------------------------------- calculate, over intervals
def end(metrics: Sequence[Any]) -> None:
    """``reset()`` of each metric after a ``calculate()`` or at a hand-off: it ends the
    interval (the next one is numbered on), and intervals given back (``comm.pending``),
    now or later, stay for the next one. The next intervals' states are made together
    (``state.new_states_each``: one block per dtype and device, not one per metric) and
    handed to each ``reset()``."""
    ended = [interval_of(m) for m in metrics]
    devices: Dict[Any, List[Interval]] = {}
    for iv in ended:
        devices.setdefault(iv.device, []).append(iv)
    for device, ivs in devices.items():
        for iv, states in zip(ivs, new_states_each([iv.specs for iv in ivs], device)):
            iv.fresh = states
    try:
        for m, iv in zip(metrics, ended):
            iv.handoffs.keep = True
            try:
                m.reset()
            finally:
                iv.handoffs.keep = False
            new = interval_of(m)
            new.number = iv.number + 1
            for name, spec in iv.specs.items():  # states kept over the run go on from where they are
                if spec.keep and name in new.states:
                    new.states[name] = iv.states[name].clone()
    finally:
        for iv in ended:
            iv.fresh = None


def computing(interval: Interval) -> Any:
    """The metric of ``interval`` as ``compute`` must see it: with ``interval`` as its own
    (``compute`` may read its declarations, ``self.declarations``), itself when it is."""
    metric = interval.owner
    return metric if interval_of(metric) is interval else metric._viewing(interval)


def results(interval: Interval, states: Dict[str, Any]) -> Dict[str, Any]:
    """The metric's ``compute`` of ``interval``'s reduced states, with each slice's keys as
    ``"{key}/{slice}"``: what ``calculate()``, its asynchronous handle and ``calculate_from``
    return. A key its ``result_keys`` do not name raises ``ValueError`` (a slice's key is
    checked as its base key)."""
    metric = computing(interval)
    if metric.slice_by is None:
        out = metric.compute(states)
        slices: List[str] = []
    else:
        def defaults():
            specs = {k: spec for k, spec in interval.specs.items() if slicing.SEP not in k}
            return plain_states({k: spec.new("cpu") for k, spec in specs.items()}, specs)

        out = slicing.results(metric, states, defaults)
        slices = slicing.held(states)
    declared = metric.keys_declared()
    if declared:
        _check_keys(metric, out, declared, slices)
    return out


def _check_keys(metric, out: Dict[str, Any], declared: List[str], slices: List[str]) -> None:
    """``ValueError`` naming the metric and the key when ``out`` holds a key ``declared`` does
    not name (``"{key}/{slice}"`` of a held slice counts as ``key``)."""
    exact, named = _key_matcher(tuple(declared))
    if exact.issuperset(out):  # every key declared as it is: the common case, one set test
        return
    for key in out:
        if not (named(key) or any(key.endswith("/" + s) and named(key[:-len(s) - 1]) for s in slices)):
            raise ValueError(f"{type(metric).__name__}: compute() returned the key {key!r}, which its "
                             f"result_keys {declared} do not name; declare it (a MetricCollection refuses "
                             "two members that could return the same key by these declarations)")


@functools.lru_cache(maxsize=256)
def _key_matcher(declared: Tuple[str, ...]) -> Tuple[frozenset, Callable[[str], bool]]:
    """The keys of ``declared`` without a ``*``, and whether a key is one of ``declared``
    (``*`` matches any text)."""
    exact = frozenset(k for k in declared if "*" not in k)
    patterns = [".*".join(map(re.escape, k.split("*"))) for k in declared if "*" in k]
    pattern = re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None
    return exact, lambda key: key in exact or (pattern is not None and pattern.fullmatch(key) is not None)


def sync_and_compute(metrics: Sequence[Any]) -> List[Dict[str, Any]]:
    """Reduce the current intervals of ``metrics`` globally and return each one's results.
    Metrics that share the same data and TP x PP groups sync together in one pass
    (``comm.fused.sync_states``)."""
    return _sync_and_compute(_places(metrics), [interval_of(m) for m in metrics])


def sync_handed(places: Sequence[tuple], intervals: Sequence[Interval]) -> List[Dict[str, Any]]:
    """On the worker: ``sync_and_compute`` of handed-off ``intervals``, each synced where
    ``places`` says (taken at the hand-off: the transports over private twins)."""
    return _sync_and_compute(places, intervals)


def _places(metrics: Sequence, what: str = "calculate()", transports=None) -> List[tuple]:
    """Where each metric syncs, and what its ranks must agree on: ``(transport, sync
    fingerprint)``. Metrics of one data group whose meshes sync alike (``DeviceMesh.sync_key``:
    the same groups and bound, also from meshes built apart) share one transport, the first
    one's: one sync; ``transports(mesh, data group)``: a maker of the transport (default
    ``Transport``)."""
    made: Dict[tuple, Transport] = {}
    out = []
    for m in metrics:
        mesh, data = m.resolve_mesh(), m.data_group()
        key = (id(data),) + mesh.sync_key()
        if key not in made:
            made[key] = Transport(what, mesh, data) if transports is None else transports(mesh, data)
        out.append((made[key], m.sync_fingerprint()))
    return out


def _sync_and_compute(places: Sequence[tuple], intervals: Sequence[Interval]) -> List[Dict[str, Any]]:
    buckets: Dict[int, List[int]] = {}
    for i, (transport, _) in enumerate(places):
        buckets.setdefault(id(transport), []).append(i)
    out: List[Dict[str, Any]] = [{} for _ in places]
    for idx in buckets.values():
        transport = places[idx[0]][0]
        reduced = sync_states([intervals[i] for i in idx], transport, [places[i][1] for i in idx])
        for i, states in zip(idx, reduced):
            out[i] = results(intervals[i], states)
    return out


def calculate(metrics: Sequence[Any], reset: bool, finish: Callable[[List[Dict[str, Any]]], Dict[str, Any]]
              ) -> Dict[str, Any]:
    """The synchronous ``calculate()`` of ``metrics``: intervals given back first, then the
    sync; the intervals end only once every metric computed (an error keeps them all)."""
    for m in metrics:
        live = interval_of(m)
        pending.settle(live.handoffs, live)
    out = finish(sync_and_compute(metrics))
    if reset:
        end(metrics)
    return out


def calculate_async(metrics: Sequence[Any], reset: bool, finish: Callable[[List[Dict[str, Any]]], Dict[str, Any]]
                    ) -> pending.CalculateHandle:
    """``calculate(async_op=True)``: each interval is handed off (``reset``: the states move
    and the metric starts a new interval; else a copy), then synced on the worker."""
    what = "calculate(async_op=True)"
    for m in metrics:
        m.resolve_mesh().check_live("calculate()")
    # taken now, on the caller's thread: the twins are made here, at the same point on every rank
    places = _places(metrics, what, lambda mesh, data: on_twins(mesh, data)(what))

    def take() -> List[Interval]:
        out = []
        for m in metrics:
            live = interval_of(m)
            pending.settle(live.handoffs, live)
            live = interval_of(m)
            if reset:
                end([m])
                out.append(live)
            else:
                out.append(live.copy(states={k: v.clone() for k, v in live.states.items()}, last_host=live.last_host))
        return out

    def run(intervals):
        return finish(sync_handed(places, intervals))

    return pending.submit([interval_of(m).handoffs for m in metrics], take, run, reset)
