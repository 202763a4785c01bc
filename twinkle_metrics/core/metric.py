"""``Metric``: the contract a metric author writes to, and the verbs a trainer calls.

A metric is declarations plus two (or three) methods:

* ``State(...)`` class attributes (or ``add_state`` / ``add_state_family`` in the
  constructor): each accumulator with its reduction over ranks, dtype, shape and
  default (``twinkle_metrics.core.state``); ``Origin(...)`` for a host value fixed for
  an interval (a clock at its start) that ``update`` may read;
* ``update(inputs, outputs, **kwargs) -> {state name: contribution}``: it reads its
  arguments and the metric's configuration (constructor arguments, origins), never the
  live states, and changes nothing of the metric; it runs under ``torch.no_grad()`` and
  never waits for the device; ``accumulate`` folds the whole dict in only after it
  returned, so a call that raises on bad input loses nothing accumulated before. A metric
  whose ``update`` communicates (vocab-parallel logits, sequences split over CP) names
  the mesh axes in ``agree_over``: the ranks of each group agree first, so that a rank
  that rejects its input raises on every rank instead of stranding its peers;
* ``compute(states) -> {key: number}``: pure, on the globally reduced states (plain
  Python numbers, lists for shaped states).

A few declared attributes complete it, each a plain value, never a method to override:
``agree_over``, ``tp_mismatch_hint``, ``unsliceable``, ``unsliced_states``, ``schema``,
``reads`` and ``result_keys``. Everything else (slicing, the
fused sync, asynchronous calculate and the fold-back of a failed interval, checkpoints
and resuming at another data-parallel size, agreement across ranks) works from the
declarations; docs/contract.md has the whole contract on one page.

``calculate()`` packs every state into one buffer and syncs it with at most two
collectives (see ``twinkle_metrics.comm``).
"""
from __future__ import annotations

import copy
import dataclasses
from types import MappingProxyType
from typing import Any, ClassVar, Dict, List, Literal, Mapping, Optional, Sequence, TypeVar, Union, overload

import torch

from parallel import DeviceMesh, MeshLike, as_device_mesh, dist_ready, group_size
from parallel.groups import ProcessGroup, group_ranks
from twinkle_metrics.comm import pending
from twinkle_metrics.core import checkpoint, config, interval, slicing, staging
from twinkle_metrics.core.config import Schema, UnknownArgumentWarning, constructor_keywords
from twinkle_metrics.core.export import export_metrics
from twinkle_metrics.core.interval import Interval
from twinkle_metrics.core.merge import merge_exports
from twinkle_metrics.core.state import Origin, State, move_states, new_states
from twinkle_metrics.inputs import fields
from twinkle_metrics.inputs.data_format import Inputs, Outputs

__all__ = ["Metric", "UnknownArgumentWarning", "constructor_keywords", "FINGERPRINT_KEY"]
#: key of the schema fingerprint in a metric's ``state_dict()``
FINGERPRINT_KEY = checkpoint.FINGERPRINT_KEY
_AXES = ("tp", "cp", "data")
_M = TypeVar("_M", bound="Metric")  # the class of a metric whose verbs return it

class Metric:
    """Base class of every metric, with Twinkle's constructor and verbs.

    Args:
        device_mesh: the ``parallel.DeviceMesh`` that says which ranks hold disjoint
            data, or Twinkle's ``DeviceMesh`` (converted by
            ``DeviceMesh.from_twinkle``, collective the first time). ``None``:
            ``DeviceMesh.current(process_group)`` at the first ``calculate()``
            (Megatron's groups when initialised, else ``process_group`` or WORLD as pure
            data parallel: a one-rank ``process_group`` never communicates).
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
    _class_origins: ClassVar[Dict[str, Origin]] = {}
    _followed: ClassVar[frozenset] = frozenset()
    _update_reads: ClassVar[frozenset] = frozenset()  # the keywords update names
    #: the fields ``update`` reads: a ``Reads`` or a tuple of them (``inputs.fields``); a call
    #: that carries part of a record, or a near-miss of a field's name, raises before any state
    #: or collective is touched
    reads: ClassVar[Any] = ()
    #: the result keys ``compute`` may return (``*`` matches any text, ``{name}`` a string
    #: setting of the metric): a ``MetricCollection`` refuses, when it is built, two members
    #: that could return the same key
    result_keys: ClassVar[Sequence[str]] = ()
    #: what the fingerprint covers (``core.config.Schema``): a version bumped on purpose, the
    #: constructor arguments that change no state's meaning (``exclude``) and those ranks must
    #: agree on but a checkpoint need not (``sync_only``)
    schema: ClassVar[Schema] = Schema()
    #: what ``slice_by`` cannot mean for this metric (None: it can be sliced)
    unsliceable: ClassVar[Optional[str]] = None
    #: states kept for the whole call only, not per slice (e.g. records with global indices)
    unsliced_states: Sequence[str] = ()
    #: mesh axes ``update`` communicates over, in the order it agrees on them: ``"tp"``
    #: (the TP group), ``"cp"`` (``sequence_group()``), ``"data"`` (``data_group()``); each
    #: counts only with more than one rank (see ``twinkle_metrics.comm.agreement``)
    agree_over: Sequence[str] = ()
    #: why TP replicas may disagree on a state, told when ``calculate()`` finds they do
    tp_mismatch_hint: Optional[str] = None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        states: Dict[str, State] = {}
        origins: Dict[str, Origin] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                if isinstance(value, State):
                    states[name] = value
                elif isinstance(value, Origin):
                    origins[name] = value
        cls._class_states, cls._class_origins = states, origins
        # the states an Origin follows: their newest host number is kept over resets
        cls._followed = frozenset(o.follows for o in origins.values() if o.follows)
        # what update reads (inputs.fields): the keywords its signature names, the records
        # of ``reads``; each call is checked against them where it is made
        cls._update_reads = fields.update_keywords(cls)[0]
        fields.records(cls)  # an author's mistake in ``reads`` raises here
        config.record_arguments(cls)

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *,
                 slice_by: Optional[str] = None, max_slices: int = 16, **kwargs: Any) -> None:
        if kwargs:
            config.warn_unknown_arguments(self, kwargs)
        slicing.check_config(self, slice_by, max_slices)
        self.__dict__.setdefault("_arguments", {}).setdefault("slice_by", slice_by)
        self._arguments, self._argument_values = config.settle_arguments(self, kwargs)
        self.slice_by = slice_by
        self.max_slices = max_slices
        self.device_mesh = as_device_mesh(device_mesh, type(self).__name__)
        self.process_group = process_group
        self._families: Dict[str, State] = {}
        # what the machinery moves (core.interval): the states and their declarations, what
        # was folded into, the origins; the asynchronous hand-offs (comm.pending.HandOffs)
        self.__interval = Interval(self, dict(self._class_states), {}, torch.device("cpu"),
                                  handoffs=pending.HandOffs(), followed=self._followed)
        self.reset()

    # ------------------------------------------------------------------ states
    def add_state(self, name: str, state: State) -> None:
        """Add a state at run time (for metrics whose states depend on arguments)."""
        if name in self.__interval.specs:
            raise ValueError(f"{type(self).__name__}: state {name!r} already exists")
        state.name = name
        iv = self.__interval
        iv.specs[name] = state
        iv.states[name] = state.new(iv.device)

    def add_state_family(self, prefix: str, state: State) -> None:
        """Declare states created on the fly: any name ``prefix + something`` that
        ``update`` returns (one per reward name, per parameter group) is a copy of
        ``state``, and a rank that never saw a name creates it when another rank has it."""
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"{type(self).__name__}: a state family needs a non-empty name prefix, got {prefix!r}")
        self._families[prefix] = state

    def dynamic_state(self, name: str) -> Optional[State]:
        """The declaration of ``name`` as a member of a state family, else None."""
        best = max((p for p in self._families if name.startswith(p) and len(name) > len(p)), key=len, default=None)
        return None if best is None else dataclasses.replace(self._families[best])

    def state_spec(self, name: str) -> Optional[State]:
        """The declaration of a state created on the fly under ``name`` (a family member,
        or a slice's copy of a state), or None when this metric creates no such state."""
        if self.slice_by is not None and slicing.SEP in name:
            return slicing.state_spec(self, name)
        return self.dynamic_state(name)

    def __getattr__(self, name: str) -> torch.Tensor:
        iv = self.__dict__.get("_Metric__interval")
        if iv is not None and name in iv.states:
            return iv.states[name]
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    # ------------------------------------------------- read-only views (metrics, tests)
    @property
    def declarations(self) -> Mapping[str, State]:
        """``{state name: State}`` of every state the metric holds now (declared, added, or
        created on the fly: a family's members, a slice's copies). A read-only view; a
        ``compute`` that reads it sees the interval it computes."""
        return MappingProxyType(self.__interval.specs)

    @property
    def families(self) -> Mapping[str, State]:
        """``{prefix: State}`` of the state families (``add_state_family``), read-only."""
        return MappingProxyType(self._families)

    @property
    def intervals(self) -> int:
        """Intervals this metric ended (each ``calculate()`` that resets, each ``export()``):
        the number of the current one, as an export names it."""
        return self.__interval.number

    @property
    def device(self) -> torch.device:
        """The device the states live on."""
        return self.__interval.device

    def _viewing(self, interval: Interval) -> "Metric":
        """A shallow copy of the metric whose current interval is ``interval`` (handed off, or a
        driver's scratch): ``compute`` may read its own declarations (``self.declarations``)."""
        view = copy.copy(self)
        view.__interval = interval
        return view

    @property
    def states(self) -> Dict[str, torch.Tensor]:
        """The live state tensors (read-only view by convention)."""
        self._settle()
        return dict(self.__interval.states)

    def _settle(self) -> None:
        pending.settle(self.__interval.handoffs, self.__interval)

    def reset(self: _M) -> _M:
        """Restore every state to its default; a new interval starts (its origins are read)."""
        iv = self.__interval
        states = iv.fresh if iv.fresh is not None else new_states(iv.specs, iv.device)
        self.__interval = Interval(self, dict(iv.specs), states, iv.device,
                                  origins={name: o.start(iv.last_host) for name, o in self._class_origins.items()},
                                  number=iv.number, handoffs=iv.handoffs, followed=iv.followed,
                                  last_host=iv.last_host)
        pending.drop_returned(iv.handoffs)
        return self

    def to(self: _M, device: Union[torch.device, str, int]) -> _M:
        """Move the states to ``device``.

        Onto an accelerator the copy is asynchronous; back to the CPU it is a blocking
        copy (an asynchronous device-to-host copy would hand back memory the device is
        still writing).
        """
        device = torch.device(device)
        iv = self.__interval
        if device != iv.device:
            iv.states = move_states(iv.states, device)  # host ones in one copy per dtype
            iv.device = device
        return self

    # ------------------------------------------------------------------ schema
    def fingerprint(self) -> str:
        """What a checkpoint must agree on for the states to mean the same: the class, its
        schema's version and the arguments its constructor was called with
        (``twinkle_metrics.core.config.Schema``), less the schema's ``exclude`` and
        ``sync_only``."""
        return config.fingerprint(self, checkpoint=True)

    def sync_fingerprint(self) -> str:
        """What ranks must agree on to sync: the fingerprint with the schema's ``sync_only``
        (checked by every ``calculate()``: ranks that differ raise ``MetricSyncError``)."""
        return config.fingerprint(self)

    def keys_declared(self) -> List[str]:
        """The result keys this metric may return: ``result_keys`` with its ``{setting}``
        names filled in (``*`` stays: it matches any text)."""
        return [k.format_map(vars(self)) if "{" in k else k for k in self.result_keys]

    def exchange_groups(self) -> List[Any]:
        """The groups of ``agree_over`` with more than one rank, in that order."""
        out = []
        for axis in self.agree_over:
            if axis == "tp":  # on a layout-only mesh its group is None: the agreement then raises
                mesh = self.resolve_mesh()
                if mesh.tp_size > 1:
                    out.append(mesh.tp_group)
                continue
            if axis == "cp":
                group = self.sequence_group()
            elif axis == "data":
                group = self.data_group()
                group = group if group_size(group) > 1 else None
            else:
                raise ValueError(f"{type(self).__name__}: agree_over holds {axis!r}; expected axes of {_AXES}")
            if group is not None:
                out.append(group)
        return out

    # ------------------------------------------------------------------ verbs
    def accumulate(self: _M, inputs: Inputs = None, outputs: Outputs = None, **kwargs: Any) -> _M:
        """Fold one batch (or a list of pipeline microbatches) into the states.

        Never waits for the device and never keeps the autograd graph. All or
        nothing: a call that raises changes no state.
        """
        staged = staging.stage(self, inputs, outputs, kwargs)
        if staged is not None:
            staged.apply()
        return self

    def update(self, inputs: Inputs, outputs: Outputs, **kwargs: Any) -> Dict[str, Any]:
        """Return ``{state name: contribution}`` for one call (``{}``: nothing); must not read or
        change states."""
        raise NotImplementedError(f"{type(self).__name__} must implement update()")

    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        """Turn reduced states (plain numbers/lists keyed by state name) into results."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute()")

    @overload
    def calculate(self, reset: bool = ..., async_op: Literal[False] = ...) -> Dict[str, Any]: ...
    @overload
    def calculate(self, reset: bool = ..., *, async_op: Literal[True]) -> pending.CalculateHandle: ...
    @overload
    def calculate(self, reset: bool = ..., async_op: bool = ...) -> Union[Dict[str, Any], pending.CalculateHandle]: ...

    def calculate(self, reset: bool = True, async_op: bool = False
                  ) -> Union[Dict[str, Any], pending.CalculateHandle]:
        """Reduce over the data group and return plain numbers, the same on every rank.

        Collective over the mesh: every rank calls it, pipeline stages included.
        Resets the metric afterwards (as Twinkle does) unless ``reset=False``.

        ``async_op=True`` returns a ``CalculateHandle`` at once instead: the
        interval's states are handed off (the metric is reset now, so ``accumulate``
        goes on into the next interval), the sync runs in the background, and
        ``handle.wait()`` returns the same dict (see ``twinkle_metrics.comm.pending``).
        If the sync fails, the interval is not lost (as a failed synchronous call keeps
        it): it goes back under the next interval, and the next calculate reports both.
        """
        if async_op:
            return interval.calculate_async([self], reset, lambda results: results[0])
        return interval.calculate([self], reset, lambda results: results[0])

    def export(self) -> Dict[str, Any]:
        """This rank's states as plain JSON, for a driver to merge (``calculate_from``).

        Not collective: one copy of the states to the host, no other device wait. Ends
        the interval as ``calculate()`` does (the states reset, the interval number
        advances). The value holds the format version, this rank's place in the mesh
        (data shard, TP/PP position), the interval number, and per metric its class,
        fingerprint, constructor arguments and states (``twinkle_metrics.core.export``).
        Raises ``RuntimeError`` while an asynchronous ``calculate()`` of it is in flight.
        """
        self._settle()
        out = export_metrics([("", self)], f"{type(self).__name__}.export()")
        interval.end([self])
        return out

    def calculate_from(self, exports: Sequence[Mapping[str, Any]], *,
                       merge_intervals: bool = False) -> Dict[str, Any]:
        """On a driver: the dict ``calculate()`` returns on the workers, from their exports.

        Build the metric with the workers' arguments and no mesh. ``exports``: the
        ``export()`` of workers covering every data shard (DP x CP rank) of the last stage
        at least once (every stage's for states of scope ``"stage"``, every rank's for
        ``"model"``); TP replicas and other stages may come too, and must agree. Not
        collective; never touches this metric's own states. ``merge_intervals=True``
        merges exports of several intervals, each complete, as one long interval.
        Raises ``ValueError``/``TypeError`` naming the export and the field
        (``twinkle_metrics.core.merge``).

        Example:
            >>> import json
            >>> from twinkle_metrics import LossMetric
            >>> worker = LossMetric(loss_reduction="sum")
            >>> _ = worker.accumulate(None, {"loss": 6.0, "num_tokens": 3})
            >>> sent = json.dumps(worker.export())                  # what travels
            >>> LossMetric(loss_reduction="sum").calculate_from([json.loads(sent)])["loss"]
            2.0
        """
        return merge_exports([("", self)], exports, merge_intervals=merge_intervals, single=True,
                                   what=f"{type(self).__name__}.calculate_from")[0]

    def resolve_mesh(self) -> DeviceMesh:
        if self.device_mesh is None:  # a process_group alone: the mesh of its ranks, never WORLD
            self.device_mesh = DeviceMesh.current(self.process_group)
        return self.device_mesh

    def data_group(self) -> ProcessGroup:
        """The group the states are reduced over: ``process_group`` or the mesh's DP x CP."""
        if self.process_group is not None:
            return self.process_group if group_size(self.process_group) > 1 else None
        return self.resolve_mesh().data_group

    def sequence_group(self) -> ProcessGroup:
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
        self._settle()
        out: Dict[str, Any] = {name: t.detach().clone() for name, t in self.__interval.states.items()}
        out[FINGERPRINT_KEY] = self.fingerprint()
        if self.__interval.followed:  # what the next interval's Origins start from (core.checkpoint)
            out[checkpoint.FOLLOWED_KEY] = dict(self.__interval.last_host)
        return out

    def load_state_dict(self: _M, state_dict: Union[Mapping[str, Any], Sequence[Mapping[str, Any]]]) -> _M:
        """Restore saved states; all or nothing. The interval's origins are taken at the load.

        Given a list of state dicts (those of several ranks of an earlier run), their
        states are merged with each state's own reduction, exactly as ``calculate()``
        would merge those ranks: this is how a run resumes at a smaller data-parallel
        size. Split the saved dicts of each old data group so that every old rank's
        dict is loaded by exactly one new rank of the same TP/PP position (e.g. old
        DP ranks 2k and 2k+1 into new DP rank k); to grow the data-parallel size, load
        each old dict into one new rank and nothing (a fresh metric) into the others.
        """
        checkpoint.commit_load(self, checkpoint.stage_load(self, state_dict))
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}(states={list(self.__interval.specs)})"


config.ROOTS.add(Metric)

