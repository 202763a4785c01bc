"""``State``: one accumulator of a metric, declared once with its reduction."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, overload

import torch

from twinkle_metrics.inputs.checks import from_host, from_host_all

Reduce = Union[str, Callable[[torch.Tensor], torch.Tensor]]
_OPS = ("sum", "max", "min")
_SCOPES = ("data", "stage", "model")


@dataclass
class State:
    """A metric accumulator: how it merges across ranks, its dtype, shape and default.

    Declare states as class attributes; the instance attribute of the same name is
    the live tensor::

        class Accuracy(Metric):
            correct: torch.Tensor = State("sum", torch.int64)
            total: torch.Tensor = State("sum", torch.int64)

    Args:
        reduce: ``"sum"``, ``"max"``, ``"min"``, or a callable taking the rows of every
            rank stacked as ``[ranks, *shape]`` and returning ``[*shape]``.
        dtype: ``torch.float64`` (default) or ``torch.int64``. An int64 ``"sum"`` state is a
            count, never negative (``calculate_from`` refuses an export that holds one).
        shape: fixed shape; state size never grows with the number of steps.
        default: the value after ``reset()``; the identity of ``reduce`` when omitted.
        local: how ``accumulate`` folds a new value in: the reduce op by default,
            ``"last"`` to overwrite, or a callable ``(old, new) -> merged``. A callable
            marked ``batched`` (see ``batched``) also merges ``[k, *shape]`` stacks of
            ``k`` states at once, so a metric's states that share it fold in one call.
        per_rank: the value is a reading of this rank (a wall clock) that TP
            replicas need not agree on; its result is still one data group's (a reading
            every rank must count in, such as a memory peak, is ``scope="model"``). Every
            other state must be the same on the TP ranks of a pipeline stage (they see
            the same tokens); ``calculate()`` checks that and raises on every rank if not.
        scope: which ranks contribute parts of the value, merged with ``reduce``:

            - ``"data"`` (default): the ranks of the data group (DP x CP) hold disjoint
              parts; the result is the last pipeline stage's (the stage that sees the
              loss and the logits), and TP replicas agree.
            - ``"stage"``: every pipeline stage contributes too (per-layer values of
              layers spread over the stages, such as MoE router counts); TP replicas
              of a stage agree and count once.
            - ``"model"``: every rank of TP x PP contributes a disjoint part as well
              (tensor-parallel shards of a parameter, sequence-parallel tokens); no
              agreement check, since TP ranks hold different parts.

            ``"stage"`` and ``"model"`` need a ``"sum"``, ``"max"`` or ``"min"`` reduction.
        keep: the value outlives ``calculate()``: a total over the run (the end of an
            interval leaves it, calls go on folding into it, every sync reduces it with the
            other states, ``state_dict()`` carries it over a resume; ``reset()`` clears it).

    A callable ``reduce`` (with its own ``local``) is how a merge that the three operations
    cannot express is declared: Chan's merge of moments (``stats.moments``), GRPO's top-k
    records with sequence indices counted over the ranks, TrainMetric's longest interval.
    """

    reduce: Reduce = "sum"
    dtype: torch.dtype = torch.float64
    shape: Tuple[int, ...] = ()
    default: Optional[float] = None
    local: Union[str, Callable, None] = None
    per_rank: bool = False
    scope: str = "data"
    keep: bool = False

    def __post_init__(self) -> None:
        if not callable(self.reduce) and self.reduce not in _OPS:
            raise ValueError(f"State: reduce must be one of {_OPS} or a callable, got {self.reduce!r}")
        if callable(self.reduce) and (self.default is None or self.local is None):
            raise ValueError("State: a callable reduce needs an explicit default and local merge")
        if self.dtype not in (torch.float64, torch.int64):
            raise ValueError(f"State: dtype must be torch.float64 or torch.int64, got {self.dtype}")
        local = self.local or self.reduce
        if not callable(local) and local not in _OPS + ("last",):
            raise ValueError(f"State: local must be one of {_OPS + ('last',)} or a callable, got {local!r}")
        if self.scope not in _SCOPES:
            raise ValueError(f"State: scope must be one of {_SCOPES}, got {self.scope!r}")
        if self.scope != "data" and callable(self.reduce):
            raise ValueError(f"State: scope={self.scope!r} needs reduce 'sum', 'max' or 'min', "
                             "got a callable")
        if self.scope == "model" and self.per_rank:
            raise ValueError("State: scope='model' already exempts the state from TP agreement; "
                             "drop per_rank=True")
        self.shape = tuple(int(s) for s in self.shape)
        self.name = ""  # the attribute it is declared as, or the name add_state gives it

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: Optional[type] = None) -> "State": ...
    @overload
    def __get__(self, obj: object, owner: Optional[type] = None) -> torch.Tensor: ...

    def __get__(self, obj: Optional[object], owner: Optional[type] = None) -> Union["State", torch.Tensor]:
        if obj is None:
            return self
        return interval_of(obj).states[self.name]

    def __set__(self, obj: object, value: Any) -> None:
        raise AttributeError(f"{type(obj).__name__}.{self.name} is a metric state; change it "
                             "through accumulate(), reset() or load_state_dict()")

    @property
    def identity(self) -> float:
        if self.default is not None:
            return self.default
        if self.reduce == "sum":
            return 0
        big = torch.iinfo(torch.int64).max if self.dtype == torch.int64 else math.inf
        return -big if self.reduce == "max" else big

    @property
    def signature(self) -> str:
        """What ranks must agree on for this state: reduction, dtype, shape."""
        red = self.reduce if isinstance(self.reduce, str) else getattr(self.reduce, "__name__", "fn")
        scope = "" if self.scope == "data" else f":{self.scope}"
        return f"{red}:{str(self.dtype).replace('torch.', '')}:{list(self.shape)}{scope}"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def new(self, device: Union[torch.device, str]) -> torch.Tensor:
        """A fresh tensor holding the default (a fill kernel: no host-device copy)."""
        return torch.full(self.shape, self.identity, dtype=self.dtype, device=device)

    def merge(self, rows: torch.Tensor) -> torch.Tensor:
        """Reduce ``[ranks, *shape]`` rows into one value."""
        if callable(self.reduce):
            return self.reduce(rows)
        if self.reduce == "sum":
            return rows.sum(0)
        return rows.amax(0) if self.reduce == "max" else rows.amin(0)


class Origin:
    """A host value fixed for one interval, taken as the interval starts (at construction
    and at every reset): what a metric measures its interval from.

    ``update`` may read an origin (``self.<name>``): unlike a state it does not change
    within an interval, so reading it keeps ``update`` pure. A value measured from it goes
    into the states as an absolute one (a start time, a step number), reduced with
    ``"min"`` where the earliest counts: so when a failed asynchronous interval goes back
    under the next one, the two read as one interval from the earlier origin.

    Args:
        reading: a callable ``() -> value`` read as the interval starts (a clock), or the
            name of a state: the newest host number folded into it before the interval
            started, 0 before any (a step counter: steps since the last ``calculate``).

    Example::

        class Steps(Metric):
            start = Origin(time.time)            # wall clock, as the interval starts
            step_before = Origin("step")         # the last step counted before it
            began = State("min", per_rank=True)  # the interval's span over the ranks
            ended = State("max", per_rank=True)
            first_step = State("min", torch.int64)
            step = State("max", torch.int64)
            def update(self, inputs, outputs, *, step, **kw):
                return {"began": self.start, "ended": time.time(),
                        "first_step": self.step_before, "step": step}
            def compute(self, s):  # steps per second since the previous calculate()
                return {"rate": (s["step"] - s["first_step"]) / (s["ended"] - s["began"])}
    """

    def __init__(self, reading: Union[Callable[[], Any], str]) -> None:
        if not (callable(reading) or (isinstance(reading, str) and reading)):
            raise TypeError(f"Origin: reading must be a callable (a clock) or the name of a state, got {reading!r}")
        self.reading = reading
        self.name = ""

    @property
    def follows(self) -> Optional[str]:
        """The state whose newest host number this origin takes, or None (a clock)."""
        return None if callable(self.reading) else self.reading

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Optional[object], owner: Optional[type] = None) -> Any:
        if obj is None:
            return self
        return interval_of(obj).origins[self.name]

    def start(self, last_host: Mapping[str, Any]) -> Any:
        """The origin of an interval starting now, given the newest host number folded
        into each followed state so far."""
        if callable(self.reading):
            return self.reading()
        return last_host.get(self.reading, 0)


def interval_of(metric: Any) -> Any:
    """The metric's current ``core.interval.Interval``: the one place that reads it off the
    metric, for the machinery that moves its states (``Metric`` keeps it name-mangled, so that
    no subclass attribute can clash with it)."""
    return metric._Metric__interval


def batched(fold: Callable) -> Callable:
    """Mark a local merge ``(old, new) -> merged`` as elementwise over a leading dim: given
    ``[k, *shape]`` stacks it returns the ``k`` merges stacked. ``accumulate`` then folds
    every state that uses it (same dtype and shape) in one call instead of one each."""
    fold.batched = True  # type: ignore[attr-defined]  # a mark on the function, read by accumulate
    return fold


def new_states(specs: Dict[str, "State"], device: Union[torch.device, str]) -> Dict[str, torch.Tensor]:
    """Every state of ``specs`` at its default on ``device``: one copy per dtype of a host
    block of the defaults (kept per set of states), each state a view of its dtype's block.
    A metric's ~15 states cost two copies, not ~15 fills (``reset()`` after every
    ``calculate()``), and on an accelerator no kernel per state."""
    return new_states_each((specs,), device)[0]


def new_states_each(specs: Sequence[Dict[str, "State"]], device: Union[torch.device, str]
                    ) -> List[Dict[str, torch.Tensor]]:
    """``new_states`` of several sets of states at once (the metrics of a collection
    ending their intervals together): one copy per dtype for them all, not one per set
    and dtype. The states of different sets share that block's storage, as a metric's
    own states do."""
    key = tuple((tuple(each), tuple(map(id, each.values()))) for each in specs)
    defaults = _DEFAULTS.get(key)
    if defaults is None:
        if len(_DEFAULTS) >= 256:  # a process builds few sets of states; bound it anyway
            _DEFAULTS.clear()
        defaults = _DEFAULTS[key] = _Defaults(specs)
    return defaults.fresh(torch.device(device))


class _Defaults:
    """The defaults of some sets of states as one host block per dtype (scalars first), and
    where each state sits in it. Holds the ``State`` objects: ``_DEFAULTS`` is keyed by
    their ids."""

    __slots__ = ("specs", "names", "blocks", "order", "bounds")

    def __init__(self, sets: Sequence[Dict[str, "State"]]) -> None:
        self.specs = tuple(spec for each in sets for spec in each.values())
        self.names = [list(each) for each in sets]
        entries_of: Dict[torch.dtype, list] = {}
        for i, each in enumerate(sets):
            for name, spec in each.items():
                entries_of.setdefault(spec.dtype, []).append(((i, name), spec))
        #: per dtype: (block of defaults, scalars at its start, sizes and shapes of the others)
        self.blocks: list = []
        placed = []
        for entries in entries_of.values():
            entries.sort(key=lambda e: e[1].shape != ())  # stable: scalars first, then in order
            scalars = sum(1 for _, spec in entries if spec.shape == ())
            shapes = [spec.shape for _, spec in entries[scalars:]]
            block = torch.cat([spec.new("cpu").reshape(-1) for _, spec in entries])
            self.blocks.append((block, scalars, [math.prod(s) for s in shapes], shapes))
            placed += [key for key, _ in entries]
        where = {key: i for i, key in enumerate(placed)}
        order = [where[(i, name)] for i, names in enumerate(self.names) for name in names]  # sets' order
        self.order = None if order == sorted(order) else order
        ends = list(itertools.accumulate(len(names) for names in self.names))
        self.bounds = list(zip([0] + ends[:-1], ends))  # each set's span of the views, in that order

    def fresh(self, device: torch.device) -> List[Dict[str, torch.Tensor]]:
        views: list = []
        for block, scalars, sizes, shapes in self.blocks:
            block = block.clone() if device.type == "cpu" else from_host(block, device)
            if scalars:
                views += (block if not sizes else block[:scalars]).unbind()
            if sizes:
                views += [p if len(s) == 1 else p.view(s) for p, s in zip(block[scalars:].split(sizes), shapes)]
        if self.order is not None:
            views = [views[i] for i in self.order]
        return [dict(zip(names, views[a:b])) for names, (a, b) in zip(self.names, self.bounds)]


_DEFAULTS: Dict[tuple, _Defaults] = {}


def move_states(states: Dict[str, torch.Tensor], device: Union[torch.device, str]) -> Dict[str, torch.Tensor]:
    """``states`` on ``device``: the host ones moved in one non-blocking copy per dtype
    (each state a view of its dtype's block), the others with ``.to``."""
    device = torch.device(device)
    out: Dict[str, torch.Tensor] = {}
    host: Dict[torch.dtype, list] = {}
    for name, t in states.items():
        if t.device == device:
            out[name] = t
        elif t.device.type == "cpu" and device.type != "cpu":
            host.setdefault(t.dtype, []).append(name)
        else:
            out[name] = t.to(device, non_blocking=device.type != "cpu")
    for names in host.values():
        out.update(zip(names, from_host_all([states[n] for n in names], device)))
    return {name: out[name] for name in states}


def as_tensor(value: Any, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.device != like.device:
            # Host to device: asynchronous. Device to host only happens for a state that
            # stays on the CPU by request, and must then be a blocking copy.
            value = value.to(like.device, non_blocking=like.device.type != "cpu")
        return value.to(like.dtype)
    # A fill kernel on the state's device: no host-to-device copy of a Python number.
    return torch.full_like(like, value)
