"""``Metric``: declared states, a pure ``update``, a pure ``compute``, generic sync.

A metric is a few ``State`` declarations plus two methods:

* ``update(inputs, outputs, **kwargs) -> {state name: value}`` turns one call's
  inputs into contributions, on the device, without waiting for it. It must not
  touch the states: ``accumulate`` folds the whole dict in only after ``update``
  returned, so a call that raises on bad input loses nothing accumulated before.
  It runs under ``torch.no_grad()`` and every folded value is detached, so a metric
  never holds the caller's autograd graph.
* ``compute(s) -> {key: number}`` turns the globally reduced states (plain Python
  numbers, lists for shaped states) into results.

``calculate()`` packs every state into one buffer and syncs it with at most two
collectives (see ``twinkle_metrics.sync``).
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import warnings
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch

from parallel import DeviceMesh, as_device_mesh, dist_ready, group_size
from parallel.groups import group_ranks
from twinkle_metrics.core import slicing
from twinkle_metrics.core.state import State, _as_tensor, move_states, new_states
from twinkle_metrics.sync import pending
from twinkle_metrics.sync.agreement import join_failed
from twinkle_metrics.sync.fused import plain_states, sync_and_compute

#: Keyword arguments of ``accumulate`` that some metric's ``update`` names. A trainer
#: passes one shared kwargs dict to every metric (Twinkle's convention), so a keyword
#: one metric uses is accepted by all; one that no metric knows is a mistake.
_KNOWN_KWARGS: Set[str] = set()
_PLAIN = (bool, int, float, str, type(None))
#: key of the schema fingerprint in a metric's ``state_dict()``
FINGERPRINT_KEY = "__fingerprint__"
#: (metric class, argument) pairs already warned about: one warning each per process
_WARNED: Set[Tuple[type, str]] = set()


class UnknownArgumentWarning(UserWarning):
    """A metric constructor got an argument it does not know and ignored it, as
    Twinkle's metrics do."""


class Metric:
    """Base class of every metric, with Twinkle's constructor and verbs.

    Args:
        device_mesh: the ``parallel.DeviceMesh`` that says which ranks hold disjoint
            data, or Twinkle's ``DeviceMesh`` (converted by
            ``DeviceMesh.from_twinkle``, collective the first time). ``None``:
            ``DeviceMesh.current()`` at the first ``calculate()`` (Megatron's groups
            when initialised, else WORLD as pure data parallel).
        process_group: overrides the mesh's data group (DP x CP) for the reduction. Under
            context parallelism it must hold the mesh's DP x CP ranks (the CP rules follow
            the mesh: ``sequence_group``).
        slice_by: name of a per-sequence input field (``"data_source"``, ``"task"``: a list
            of strings or ints, one per sequence): results also carry every key per slice
            value, as ``"{key}/{slice}"`` (see ``twinkle_metrics.slicing``).
        max_slices: the most slice values one metric may hold over its data group (a
            bounded buffer); one more on a rank raises and accumulates nothing; more over the
            ranks together makes ``calculate()`` raise ``MetricSyncError`` on every rank,
            keeping the states (the smallest ``max_slices`` of the ranks counts).
        **kwargs: arguments this metric does not know are ignored, as Twinkle's
            metrics ignore them, with one ``UnknownArgumentWarning`` per class and
            name; they never enter the fingerprint.

    A metric declares its states, folds one call's contributions in ``update`` and
    turns the reduced states into results in ``compute``; the base does the rest
    (no autograd, detaching, the fused sync, ``reset``, ``state_dict``).

    Example:
        >>> import torch
        >>> class MaskedMax(Metric):
        ...     peak = State("max")                 # the max over calls and ranks
        ...     count = State("sum", torch.int64)
        ...     def update(self, inputs, outputs, **kwargs):
        ...         mask = inputs["labels"] != -100
        ...         v = torch.where(mask, outputs["values"].double(), -torch.inf)
        ...         return {"peak": v.amax(), "count": mask.sum()}
        ...     def compute(self, s):
        ...         return {"max": s["peak"], "tokens": s["count"]} if s["count"] else {}
        >>> m = MaskedMax()
        >>> _ = m.accumulate({"labels": torch.tensor([1, -100])}, {"values": torch.tensor([9.0, 50.0])})
        >>> _ = m.accumulate({"labels": torch.tensor([2, 3])}, {"values": torch.tensor([1.0, 2.0])})
        >>> m.calculate()
        {'max': 9.0, 'tokens': 3}
    """

    _class_states: ClassVar[Dict[str, State]] = {}
    _own_merge: ClassVar[bool] = False
    #: keyword arguments this metric reads from ``**kwargs`` without naming them in
    #: ``update``'s signature (named ones are found automatically)
    accepted_kwargs: ClassVar[Sequence[str]] = ()
    #: constructor arguments that do not change what a state means (left out of the
    #: schema fingerprint), e.g. chunk sizes
    fingerprint_exclude: ClassVar[Sequence[str]] = ()
    _update_kwargs: ClassVar[Optional[frozenset]] = None  # set per class: see __init_subclass__
    _update_reads: ClassVar[frozenset] = frozenset()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        found: Dict[str, State] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                if isinstance(value, State):
                    found[name] = value
        cls._class_states = found
        cls._own_merge = cls.merge is not Metric.merge  # the sync merges the others column-wise
        _KNOWN_KWARGS.update(cls.accepted_kwargs)
        params = list(inspect.signature(cls.update).parameters.values())[1:]
        named = {p.name for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if "update" in vars(cls):
            _KNOWN_KWARGS.update(named)
        # an update without **kwargs gets only the keywords it names, so one shared kwargs
        # dict (TrainMetric's lr= beside a norm metric) works for it too
        cls._update_kwargs = None if any(p.kind == p.VAR_KEYWORD for p in params) else frozenset(named)
        cls._update_reads = frozenset(named) | frozenset(cls.accepted_kwargs)  # the keywords it reads

    #: what ``slice_by`` cannot mean for this metric (None: it can be sliced)
    unsliceable: ClassVar[Optional[str]] = None
    #: states kept for the whole call only, not per slice (e.g. records with global indices)
    unsliced_states: ClassVar[Sequence[str]] = ()

    def __init__(self, device_mesh: Optional[DeviceMesh] = None, process_group=None, *,
                 slice_by: Optional[str] = None, max_slices: int = 16, **kwargs):
        if kwargs:
            _warn_unknown_arguments(self, kwargs)
        name = type(self).__name__
        if slice_by is not None:
            if not isinstance(slice_by, str) or not slice_by:
                raise TypeError(f"{name}: slice_by must be the name of a per-sequence input field "
                                f"(e.g. 'data_source'), got {slice_by!r}")
            if self.unsliceable:
                raise ValueError(f"{name}: slice_by is not supported: {self.unsliceable}")
        if isinstance(max_slices, bool) or not isinstance(max_slices, int) or max_slices < 1:
            raise ValueError(f"{name}: max_slices must be an int >= 1, got {max_slices!r}")
        self.slice_by = slice_by
        self.max_slices = max_slices
        self.device_mesh = as_device_mesh(device_mesh, type(self).__name__)
        self.process_group = process_group
        self._specs: Dict[str, State] = dict(self._class_states)
        self._device = torch.device("cpu")
        self._states: Dict[str, torch.Tensor] = {}
        self._agreed: List[Any] = []
        # handed-off intervals whose asynchronous sync failed, oldest first, waiting to be
        # folded back on the caller's thread (pending.py), and the snapshots in flight
        self._returned: List["Metric"] = []
        self._in_flight: List["Metric"] = []
        self._epoch = 0  # bumped by reset() and loads: intervals from before them are dropped
        self.reset()

    # ------------------------------------------------------------------ states
    def add_state(self, name: str, state: State) -> None:
        """Add a state at run time (for metrics whose states depend on arguments).

        States added in the constructor are part of the metric's schema. A metric
        that adds states later (one per reward name, say) implements
        ``dynamic_state(name)`` so that ranks which never saw a name can create it
        when another rank has it (see ``twinkle_metrics.sync``).
        """
        if name in self._specs:
            raise ValueError(f"{type(self).__name__}: state {name!r} already exists")
        state.name = name
        self._specs[name] = state
        self._states[name] = state.new(self._device)

    def dynamic_state(self, name: str) -> Optional[State]:
        """The declaration of a state created on the fly under ``name``, or None when
        this metric creates no state of that name. Pure: must not change the metric."""
        return None

    def _new_state_spec(self, name: str) -> Optional[State]:
        """``dynamic_state(name)``, and the per-slice copies of the states when sliced."""
        if self.slice_by is not None and slicing.SEP in name:
            base = name.rpartition(slicing.SEP)[0]
            if base in self.unsliced_states:
                return None
            spec = self._specs.get(base) or self.dynamic_state(base)
            return None if spec is None else dataclasses.replace(spec)
        return self.dynamic_state(name)

    def _adopt(self, names: Sequence[str]) -> None:
        """Create the states ``names`` (known to be valid dynamic states)."""
        for name in names:
            if name not in self._specs:
                self.add_state(name, self._new_state_spec(name))

    def __getattr__(self, name):
        states = self.__dict__.get("_states")
        if states is not None and name in states:
            return states[name]
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def _end_interval(self) -> None:
        """``reset()`` after a ``calculate()`` or at a hand-off: it ends the interval, so
        intervals given back (``pending``), now or later, stay for the next one."""
        self._keep_returned = True
        try:
            self.reset()
        finally:
            self._keep_returned = False

    @property
    def states(self) -> Dict[str, torch.Tensor]:
        """The live state tensors (read-only view by convention)."""
        pending.settle(self)
        return dict(self._states)

    def reset(self) -> "Metric":
        """Restore every state to its default."""
        self._states = new_states(self._specs, self._device)
        self._touched: Set[str] = set()  # states folded into since: what "last" folds keep
        pending.drop_returned(self)
        return self

    def to(self, device) -> "Metric":
        """Move the states to ``device``.

        Onto an accelerator the copy is asynchronous; back to the CPU it is a blocking
        copy (an asynchronous device-to-host copy would hand back memory the device is
        still writing).
        """
        device = torch.device(device)
        if device != self._device:
            self._states = move_states(self._states, device)  # host ones in one copy per dtype
            self._device = device
        return self

    # ------------------------------------------------------------------ schema
    def fingerprint(self) -> str:
        """What ranks (and a checkpoint) must agree on for the states to mean the same.

        The class, and every constructor argument kept as a plain attribute of the
        same name (``loss_reduction``, ``beta``, ``epsilon``, ``vocab_parallel``, ...)
        except those in ``fingerprint_exclude``. Checked across ranks by
        ``calculate()`` and against a checkpoint by ``load_state_dict``.
        """
        cls = type(self)
        parts = [f"{cls.__module__}.{cls.__qualname__}"]
        for name in _constructor_arguments(cls):
            if name not in self.__dict__:
                continue
            value = self.__dict__[name]
            if isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
                value = tuple(value)
            elif not isinstance(value, _PLAIN):
                continue  # groups, callables: not part of what a state means
            parts.append(f"{name}={value!r}")
        if self.slice_by is not None:  # slices add states; max_slices only caps them
            parts.append(f"slice_by={self.slice_by!r}")
        return f"{parts[0]}({', '.join(parts[1:])})"

    def sync_fingerprint(self) -> str:
        """What ranks must agree on to sync: the ``fingerprint``, and which states the metric
        creates on the fly (``_creates``). The sync relies on ranks with one sync fingerprint
        creating the same states when a state exists on some ranks only; a checkpoint does
        not need it (``load_state_dict`` checks the states it holds)."""
        creates = self._creates()
        return self.fingerprint() if creates is None else f"{self.fingerprint()} creating {creates}"

    def _creates(self) -> Optional[str]:
        """Which states ``dynamic_state`` creates, where a setting that is not a constructor
        argument of the same name decides it (None: the fingerprint says it all)."""
        return None

    def exchange_groups(self) -> List[Any]:
        """Process groups this metric communicates over inside ``accumulate``, in the
        order its ``update`` agrees on them (see ``twinkle_metrics.exchange``)."""
        return []

    # ------------------------------------------------------------------ verbs
    def accumulate(self, inputs=None, outputs=None, **kwargs) -> "Metric":
        """Fold one batch (or a list of pipeline microbatches) into the states.

        Never waits for the device and never keeps the autograd graph. All or
        nothing: a call that raises changes no state.
        """
        self._commit(self._stage(inputs, outputs, kwargs))
        return self

    def _stage(self, inputs, outputs, kwargs) -> Optional["_Staged"]:
        """Run ``update`` and prepare its fold; change nothing. On an error, join the
        agreements of the groups this metric would have communicated over, so that
        every rank raises together (``exchange.join_failed``)."""
        self._agreed = []
        try:
            _check_kwargs(self, kwargs)
            if self._update_kwargs is not None:
                kwargs = {k: v for k, v in kwargs.items() if k in self._update_kwargs}
            with torch.no_grad():
                contributions = self.update(inputs, outputs, **kwargs)
                if self.slice_by is not None:
                    contributions = self._slice_contributions(contributions, inputs, outputs, kwargs)
                return self._plan_fold(contributions) if contributions else None
        except Exception as exc:  # an interrupt joins nothing: it ends the job
            if self.exchange_groups():
                join_failed(self, exc)
            raise

    def _slice_contributions(self, whole, inputs, outputs, kwargs) -> Dict[str, Any]:
        """The whole call's contributions plus each slice's, under ``"{state}@{slice}"``."""
        name = type(self).__name__
        out = dict(whole or {})
        parts = self._slice_parts(inputs, outputs, kwargs)
        reads = [v for k, v in kwargs.items() if k in self._update_reads]
        if not parts and whole and inputs is None and (slicing.holds_data(outputs) or any(map(slicing.is_data, reads))):
            raise ValueError(f"{name}: slice_by={self.slice_by!r}, but this call has data and no inputs to read "
                             f"the slices from; pass inputs (an InputFeature or a list of them) with "
                             f"{self.slice_by!r}, one entry per sequence")
        known = set(slicing.held(self._specs))
        fresh = [s for s, *_ in parts if s not in known]
        if len(known) + len(fresh) > self.max_slices:
            raise ValueError(f"{name}: {len(known) + len(fresh)} slices of {self.slice_by!r} "
                             f"({sorted(known | set(fresh))[:20]}) exceed max_slices={self.max_slices}; "
                             "raise max_slices, or slice by a field with fewer values")
        for value, s_inputs, s_outputs, s_kwargs in parts:
            self._agreed = []  # each update agrees anew over its groups (exchange.guard)
            for key, v in (self.update(s_inputs, s_outputs, **s_kwargs) or {}).items():
                if key not in self.unsliced_states:
                    out[f"{key}{slicing.SEP}{value}"] = v
        return out

    def _slice_parts(self, inputs, outputs, kwargs) -> List[tuple]:
        """One call as the calls of its slices: ``[(slice, inputs, outputs, kwargs)]``."""
        return slicing.split(type(self).__name__, self.slice_by, inputs, outputs, kwargs)

    def _results(self, states: Dict[str, Any]) -> Dict[str, Any]:
        """``compute`` of the reduced states, with each slice's keys as ``"{key}/{slice}"``."""
        if self.slice_by is None:
            return self.compute(states)
        whole = {k: v for k, v in states.items() if slicing.SEP not in k}
        out = dict(self.compute(whole))
        per_slice: Dict[str, Dict[str, Any]] = {}
        for key, value in states.items():
            if slicing.SEP in key:
                base, _, s = key.rpartition(slicing.SEP)
                per_slice.setdefault(s, {})[base] = value
        if per_slice:  # states a slice does not carry (unsliced ones) at their identity
            specs = {k: spec for k, spec in self._specs.items() if slicing.SEP not in k}
            defaults = plain_states({k: spec.new("cpu") for k, spec in specs.items()}, specs)
        for s in sorted(per_slice):
            for key, value in self.compute({**defaults, **per_slice[s]}).items():
                if not key.startswith("_"):  # records with global indices stay whole-call only
                    out[f"{key}/{s}"] = value
        return out

    def _commit(self, staged: Optional["_Staged"]) -> None:
        if staged is None:
            return
        staged.apply()
        self._touched.update(staged.contributions)
        self._after_commit(staged.contributions)

    def _after_commit(self, contributions: Mapping[str, Any]) -> None:
        """Host bookkeeping of a call, run only once its contributions are folded in."""

    def update(self, inputs, outputs, **kwargs) -> Optional[Mapping[str, Any]]:
        """Return ``{state name: contribution}`` for one call; must not mutate states."""
        raise NotImplementedError(f"{type(self).__name__} must implement update()")

    def compute(self, s: Dict[str, Any]) -> Dict[str, Any]:
        """Turn reduced states (plain numbers/lists keyed by state name) into results."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute()")

    def merge(self, rows: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Merge every rank's states, given as ``[ranks, *shape]`` rows in data-group order.

        Runs on every rank on identical rows. Override only for merges that need
        several states at once (e.g. global indices from per-rank counts).
        """
        specs = self._specs
        return {name: (specs.get(name) or self._new_state_spec(name)).merge(r) for name, r in rows.items()}

    def _merge_reads(self) -> Optional[Sequence[str]]:
        """The states an overridden ``merge`` needs as every rank's rows; ``None``: all.

        A data group too large to gather (``sync.REDUCE_ABOVE``) all-reduces every other
        sum/max/min state and hands ``merge`` only these rows (states with a callable
        reduction are always gathered).
        """
        return None

    def calculate(self, reset: bool = True, async_op: bool = False):
        """Reduce over the data group and return plain numbers, the same on every rank.

        Collective over the mesh: every rank calls it, pipeline stages included.
        Resets the metric afterwards (as Twinkle does) unless ``reset=False``.

        ``async_op=True`` returns a ``CalculateHandle`` at once instead: the
        interval's states are handed off (the metric is reset now, so ``accumulate``
        goes on into the next interval), the sync runs in the background, and
        ``handle.wait()`` returns the same dict (see ``twinkle_metrics.pending``).
        If the sync fails, the interval is not lost (as a failed synchronous call keeps
        it): it goes back under the next interval, and the next calculate reports both.
        """
        if async_op:
            return pending.submit([self], lambda results: results[0], reset, type(self).__name__)
        pending.settle(self)
        return sync_and_compute([self], reset=reset)[0]

    def resolve_mesh(self) -> DeviceMesh:
        if self.device_mesh is None:
            self.device_mesh = DeviceMesh.current()
        return self.device_mesh

    def data_group(self):
        """The group the states are reduced over: ``process_group`` or the mesh's DP x CP."""
        if self.process_group is not None:
            return self.process_group if group_size(self.process_group) > 1 else None
        return self.resolve_mesh().data_group

    def sequence_group(self):
        """The mesh's CP group when context parallelism splits sequences (> 1 rank), else
        None. The CP rules (sequence sums completed over it, each sequence counted by its
        CP rank 0) follow the mesh, also when ``process_group`` replaces the data group;
        that group must then hold the mesh's DP x CP ranks, or this raises."""
        mesh = self.resolve_mesh()
        if mesh.cp_size <= 1:
            return None
        if self.process_group is not None and not getattr(self, "_group_spans_cp", False):
            mine, want = sorted(group_ranks(self.process_group)), sorted(group_ranks(mesh.data_group))
            if mine != want:
                raise ValueError(f"{type(self).__name__}: process_group holds ranks {mine[:16]} but the mesh "
                                 f"splits sequences over CP (cp_size={mesh.cp_size}) and its DP x CP data "
                                 f"group is {want[:16]}; pass the DP x CP group (or no process_group)")
            self._group_spans_cp = True
        return mesh.cp_group

    def gather_results(self, local_results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Twinkle's helper: gather a list of Python dicts from every data-group rank.

        For custom metrics that keep Python objects; built-in metrics use
        declared states instead (one fused, pickle-free sync).
        """
        group = self.data_group()
        if group is None or not dist_ready():
            return list(local_results)
        import torch.distributed as dist

        out: List[Any] = [None] * group_size(group)
        dist.all_gather_object(out, list(local_results), group=group)
        return [r for rank_results in out for r in (rank_results or [])]

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> Dict[str, Any]:
        """The local (unreduced) states, so a resumed run keeps what it accumulated,
        and the metric's fingerprint (checked by ``load_state_dict``)."""
        pending.settle(self)
        out: Dict[str, Any] = {name: t.detach().clone() for name, t in self._states.items()}
        out[FINGERPRINT_KEY] = self.fingerprint()
        return out

    def load_state_dict(self, state_dict: Union[Mapping[str, Any], Sequence[Mapping[str, Any]]]) -> "Metric":
        """Restore saved states; all or nothing.

        Given a list of state dicts (those of several ranks of an earlier run), their
        states are merged with each state's own reduction, exactly as ``calculate()``
        would merge those ranks: this is how a run resumes at a smaller data-parallel
        size. Split the saved dicts of each old data group so that every old rank's
        dict is loaded by exactly one new rank of the same TP/PP position (e.g. old
        DP ranks 2k and 2k+1 into new DP rank k); to grow the data-parallel size, load
        each old dict into one new rank and nothing (a fresh metric) into the others.
        """
        self._commit_load(self._stage_load(state_dict))
        return self

    def _legacy_state(self, name: str, saved: Mapping[str, Any]) -> torch.Tensor:
        """The value of optional state ``name`` for a state dict saved before it existed:
        its default, unless the metric can tell it from the saved states."""
        return self._specs[name].new("cpu")

    def _fold_under(self, earlier: "Metric") -> None:
        """Put an earlier interval under this one's states, as if the two had been one:
        ``earlier``'s states come first, and the states this interval folded into fold
        onto them with each state's own ``local`` fold, as ``accumulate`` folds a call (a
        "last" state this interval set wins; one it never set keeps ``earlier``'s).
        ``self`` is the metric or a later hand-off's snapshot (``pending``); not bounded by
        ``max_slices``: both intervals were within it when handed off."""
        specs = {**earlier._specs, **self._specs}
        base = move_states({k: earlier._states[k].clone() if k in earlier._states else spec.new("cpu")
                            for k, spec in specs.items()}, self._device)  # earlier may go under others too
        later = self._rebase({k: self._states[k] for k in self._touched if k in self._states}, earlier)
        saved = self._specs, self._states
        self._specs, self._states = specs, base
        try:
            staged = self._plan_fold(later)
        except BaseException:
            self._specs, self._states = saved
            raise
        staged.apply()
        self._touched = earlier._touched | self._touched
        self._after_fold_under(earlier)

    def _rebase(self, later: Dict[str, torch.Tensor], earlier: "Metric") -> Dict[str, torch.Tensor]:
        """States of this interval made to follow ``earlier`` (e.g. a sequence index counted
        from this interval's start). Identity by default."""
        return later

    def _after_fold_under(self, earlier: "Metric") -> None:
        """Host bookkeeping of an interval with ``earlier`` under it (its start time, say)."""

    def _stage_load(self, state_dict) -> tuple:
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
            if theirs is not None and theirs != mine:
                where = f"state dict {i}" if len(dicts) > 1 else "the state dict"
                raise ValueError(f"{name}.load_state_dict: {where} was saved by {theirs} but this "
                                 f"metric is {mine}; build the metric with the same class and "
                                 "arguments as the run that saved it")
        names = set().union(*(set(d) - {FINGERPRINT_KEY} for d in dicts))
        specs = dict(self._specs)
        new = []
        for key in sorted(names - set(specs)):
            spec = self._new_state_spec(key)
            if spec is not None:
                specs[key] = spec
                new.append(key)
        extra = sorted(names - set(specs))
        slices = slicing.held(specs) if self.slice_by is not None else []
        if len(slices) > self.max_slices:
            raise ValueError(f"{name}.load_state_dict: the state dicts hold {len(slices)} slices of "
                             f"{self.slice_by!r} ({slices[:20]}), more than max_slices={self.max_slices}; "
                             "build the metric with a larger max_slices")
        missing = sorted({k for d in dicts for k, spec in specs.items()
                          if k not in d and not spec.optional and self._new_state_spec(k) is None})
        if missing or extra:
            raise ValueError(f"{name}.load_state_dict: missing states {missing}, unexpected {extra}; "
                             "load a state dict saved by the same metric")
        rows: Dict[str, torch.Tensor] = {}
        for key, spec in specs.items():
            values = []
            for d in dicts:
                if key not in d:  # created on the fly elsewhere (default), or optional
                    values.append(self._legacy_state(key, d) if spec.optional else spec.new("cpu"))
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
            merged = self.merge(rows)
        loaded = {k: merged[k].to(device=self._device, dtype=specs[k].dtype).clone() for k in specs}
        return new, loaded

    def _commit_load(self, staged: tuple) -> None:
        new, loaded = staged
        self._adopt(new)
        self._states = {k: loaded[k] for k in self._specs}
        self._touched = set(self._specs)  # loaded values stand for calls of their own
        pending.drop_returned(self)

    # --------------------------------------------------------------- internal
    def _plan_fold(self, contributions: Mapping[str, Any]) -> "_Staged":
        """Validate and stage ``{state: contribution}``; nothing changes until ``apply()``.

        Stage first (names, devices, dtypes, shapes, results of callable folds), so
        that nothing in ``apply`` can raise; then one multi-tensor op per reduction
        (``torch._foreach_add_/_maximum_/_minimum_``, one for tensors and one for
        Python numbers) instead of one op per state: ~5x less host time for the RL
        metrics' ~20 states, and one multi-tensor kernel on CUDA.
        """
        specs, states = self._specs, self._states
        new_specs = {}
        for name in contributions.keys() - specs.keys():
            spec = self._new_state_spec(name)
            if spec is None:
                raise KeyError(f"{type(self).__name__}.update returned unknown state {name!r}")
            new_specs[name] = spec
        device = self._device
        move = None
        if device.type == "cpu":
            # States follow the first accelerator tensor they see, and never go back to the
            # CPU on their own: CPU contributions are copied to them (host to device) instead.
            move = next((v.device for v in contributions.values()
                         if isinstance(v, torch.Tensor) and v.device.type != "cpu"), None)
            if move is not None:
                device = move
        install = None  # the states apply() swaps in: moved copies and new states
        if move is not None or new_specs:
            install = move_states(states, move) if move is not None else dict(states)
            install.update(new_states(new_specs, device))
            states = install
            specs = {**specs, **new_specs}
        groups: Dict[Any, tuple] = {}  # (op, tensors or numbers) -> (states, values)
        copies = []  # (state, new value: a tensor, or a Python number to fill) for "last" and callable merges
        stacks: Dict[tuple, list] = {}  # (batched fold, dtype, shape) -> [(name, state, value)]
        for name, value in contributions.items():
            state, spec = states[name], specs[name]
            if type(value) is torch.Tensor and value.requires_grad:
                value = value.detach()
            op = spec.local or spec.reduce
            if op in _FOREACH:
                if (type(value) is torch.Tensor and value.dtype is state.dtype
                        and value.shape == state.shape and value.device == device):
                    group = groups.setdefault((op, 0), ([], []))  # the common case, checked cheaply
                    group[0].append(name)
                    group[1].append(value)
                    continue
                number = _plain_number(value, state.dtype)
                if number is not None:  # a scalar argument: no fill kernel, no copy
                    group = groups.setdefault((op, 1), ([], []))
                    group[0].append(name)
                    group[1].append(number)
                    continue
            if op == "last":
                number = _plain_number(value, state.dtype)
                if number is not None:  # filled in place: no tensor made for it, no copy
                    copies.append((name, number))
                    continue
            value = _as_tensor(value, state)
            if not _broadcasts_to(value.shape, state.shape):
                raise ValueError(f"{type(self).__name__}: contribution to state {name!r} has shape "
                                 f"{list(value.shape)}, expected {list(state.shape)}")
            if callable(op) and getattr(op, "batched", False):  # merged below, with its kind
                stacks.setdefault((op, state.dtype, tuple(state.shape)), []).append(
                    (name, state, value.expand(state.shape)))
            elif callable(op):
                copies.append((name, self._merged(name, op, state, value)))
            elif op == "last":
                copies.append((name, value))
            else:
                group = groups.setdefault((op, 0), ([], []))
                group[0].append(name)
                group[1].append(value)
        for (op, _, _), entries in stacks.items():  # one merge for every state sharing a batched fold
            names, olds, news = zip(*entries)
            if len(names) == 1:
                copies.append((names[0], self._merged(names[0], op, olds[0], news[0])))
                continue
            merged = self._merged(", ".join(names), op, torch.stack(olds), torch.stack(news))
            copies.extend(zip(names, merged.unbind()))
        return _Staged(self, contributions, groups, copies, install, device, new_specs)

    def _merged(self, name: str, op, state: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``op(state, value)``, a local merge, checked to keep the state's shape (pure: it
        runs before any state changes)."""
        value = _as_tensor(op(state, value), state).detach()
        if not _broadcasts_to(value.shape, state.shape):
            raise ValueError(f"{type(self).__name__}: local merge of state {name!r} returned "
                             f"shape {list(value.shape)}, expected {list(state.shape)}")
        return value

    def __repr__(self):
        return f"{type(self).__name__}(states={list(self._specs)})"


class _Staged:
    """One validated call of a metric, ready to fold in; ``apply`` cannot fail."""

    __slots__ = ("metric", "contributions", "groups", "copies", "install", "device", "new_specs")

    def __init__(self, metric, contributions, groups, copies, install, device, new_specs):
        self.metric, self.contributions = metric, contributions
        self.groups, self.copies = groups, copies
        self.install, self.device, self.new_specs = install, device, new_specs

    def apply(self) -> None:
        m = self.metric
        if self.install is not None:  # states follow the first accelerator tensor; new states
            for name, spec in self.new_specs.items():
                spec.name = name
                m._specs[name] = spec
            m._states, m._device = self.install, self.device
        states = m._states
        with torch.no_grad():
            for (op, _), (names, values) in self.groups.items():
                _FOREACH[op]([states[n] for n in names], values)
            for name, value in self.copies:
                if isinstance(value, torch.Tensor):
                    states[name].copy_(value)
                else:
                    states[name].fill_(value)


_ARGUMENTS: Dict[type, List[str]] = {}


def _constructor_arguments(cls) -> List[str]:
    """Names of ``cls``'s constructor arguments that may enter its fingerprint (cached:
    ``inspect.signature`` costs ~70 us, and the fingerprint is taken every calculate())."""
    names = _ARGUMENTS.get(cls)
    if names is None:
        skip = set(cls.fingerprint_exclude) | {"self", "device_mesh", "process_group"}
        names = _ARGUMENTS[cls] = [
            name for name, p in inspect.signature(cls.__init__).parameters.items()
            if name not in skip and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
            and not isinstance(getattr(cls, name, None), property)]
    return names


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
        if klass is Metric or not forwards:
            return names
    return None


def _warn_unknown_arguments(metric: Metric, kwargs: Mapping[str, Any]) -> None:
    """Warn once per (class, name) about constructor arguments ``metric`` ignores,
    pointing at the line that built the metric."""
    cls = type(metric)
    fresh = [k for k in sorted(kwargs) if (cls, k) not in _WARNED]
    if not fresh:
        return
    level, frame = 3, inspect.currentframe().f_back.f_back  # Metric.__init__'s caller
    while frame is not None and frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is metric:
        level, frame = level + 1, frame.f_back  # a subclass __init__: look past it
    known = constructor_keywords(cls) or []
    for key in fresh:
        _WARNED.add((cls, key))
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        warnings.warn(f"{cls.__name__}: ignoring unknown constructor argument {key!r}{hint}; "
                      f"it changes nothing, as in Twinkle's metrics. Known arguments: {known}",
                      UnknownArgumentWarning, stacklevel=level)
    del frame  # a frame held in a local keeps every frame below it alive


def _check_kwargs(metric: Metric, kwargs: Mapping[str, Any]) -> None:
    unknown = [k for k in kwargs if k not in _KNOWN_KWARGS]
    if not unknown:
        return
    key = unknown[0]
    close = difflib.get_close_matches(key, sorted(_KNOWN_KWARGS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise TypeError(f"{type(metric).__name__}.accumulate: unexpected keyword argument {key!r}{hint} "
                    "(no metric of twinkle-metrics takes it; keywords one metric takes are "
                    "accepted by all, so a shared kwargs dict works)")


_FOREACH = {"sum": torch._foreach_add_, "max": torch._foreach_maximum_, "min": torch._foreach_minimum_}
_INT64 = (-2 ** 63, 2 ** 63)


def _plain_number(value, dtype):
    """``value`` as a Python scalar a foreach op takes for a state of ``dtype``, else None.

    Only conversions that cannot fail later qualify: ints in int64 range for int64
    states (floats go through ``_as_tensor``, as before), any finite-size int or float
    for float64 states.
    """
    if type(value) is bool or not isinstance(value, (int, float)):
        return None
    if dtype == torch.int64:
        return int(value) if isinstance(value, int) and _INT64[0] <= value < _INT64[1] else None
    try:
        return float(value)
    except OverflowError:
        return None


def _broadcasts_to(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    return all(a in (1, b) for a, b in zip(reversed(shape), reversed(target)))
