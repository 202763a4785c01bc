"""``TrainMetric``: learning rate, iterations, time, throughput, MFU, peak memory."""
from __future__ import annotations

import math
import numbers
import secrets
import time
from typing import Any, Dict, Mapping, Optional, Sequence, Union

import torch

from parallel import MeshLike
from parallel.groups import ProcessGroup, global_rank, world_size
from twinkle_metrics.core.config import Schema
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import Origin, State
from twinkle_metrics.inputs.checks import count, fits_int64, negative_count
from twinkle_metrics.inputs.data_format import Inputs, Outputs

_NAME = "TrainMetric"
_COUNTS = ("global", "local")
#: a rank's global id rides in the low bits of a packed reading (step time, memory)
_RANK_BITS = 20
_MAX_READING = (2 ** 63 - 1) >> _RANK_BITS


def _extend(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """A later reading ``(clock, start, end)`` of the interval. On the same clock the
    earliest start stays and the newest end counts (a failed interval folded back under the
    next one keeps its start). A reading of another clock (a checkpoint another TrainMetric
    saved) keeps its length: it is taken as having ended where this one starts."""
    same = (old[0] == new[0]) | (old[1] == math.inf)
    start = torch.where(same, torch.minimum(old[1], new[1]), new[1] - (old[2] - old[1]))
    return torch.stack([new[0], start, new[2]])


def _longest(rows: torch.Tensor) -> torch.Tensor:
    """The longest interval of the ranks' ``[ranks, 3]`` (clock, start, end) rows, as
    (0, 0, its length); ranks whose clocks never started count for nothing. Only the
    lengths are compared: each rank's clock has its own zero."""
    longest = torch.where(rows[:, 1] < math.inf, rows[:, 2] - rows[:, 1], -math.inf).amax()
    started, zero, never = longest > -math.inf, torch.zeros_like(longest), torch.full_like(longest, math.inf)
    return torch.stack([zero, torch.where(started, zero, never), torch.where(started, longest, never)])


class TrainMetric(Metric):
    """Twinkle's training-progress metric, with numbers instead of strings.

    Call once per step (or micro step, as Twinkle does)::

        metric.accumulate(None, None, lr=scheduler.get_last_lr(), step=step,
                          gradient_accumulation_steps=ga, tokens=n_tokens, samples=n_seqs)

    Keys (Twinkle's): ``learning rate`` (one param group) or ``learning rate(param
    group i)`` (1-based, several groups), ``iters`` = ``step // gradient_accumulation_steps``,
    ``total time elapse`` (seconds since construction, a float; Twinkle prints
    ``'12 seconds'`` or ``'1.5 minutes'``), ``speed`` (iterations per second since
    the previous ``calculate``). Added: ``step time`` (seconds per iteration),
    ``tokens/s`` and ``samples/s`` (when counts are passed), ``mfu`` (when
    ``flops_per_token`` and ``peak_flops`` are known).

    Memory (where an accelerator's allocator has started, read from torch's counters
    on the host): ``peak memory GiB`` is the largest ``torch.accelerator.max_memory_allocated()``
    over every rank of the job (every stage, TP and data rank), and
    ``train/peak_memory_rank`` the global rank that holds it (of equal peaks, the highest);
    ``train/peak_memory_reserved_gib`` and ``train/peak_memory_reserved_rank`` the same
    for ``max_memory_reserved()``. torch counts each peak since the process started (or
    since the caller's last ``reset_peak_memory_stats()``; this library never resets it),
    so the numbers are peaks since start, not since the previous ``calculate``.

    Stragglers (when ``step`` is passed): every rank's own step time, its interval
    time over its interval steps, is merged over every rank of the world (TP and PP
    included, ``State(scope="model")``) into ``train/step_time_max`` (the slowest
    rank's seconds per iteration), ``train/step_time_min`` (the fastest's) and
    ``train/step_time_slowest_rank`` (the slowest rank's global rank; of ranks within
    a microsecond of each other, the highest). The rank rides exactly in the low 20
    bits of an int64 MAX state above the step time in microseconds.

    MFU here is achieved model FLOP/s per device divided by the device's peak:
    ``tokens * flops_per_token / interval / num_devices / peak_flops``, where
    ``flops_per_token`` counts forward and backward (``6 * params`` plus the
    attention term is the usual estimate) and ``num_devices`` is the world size.

    Times are host clocks taken at each ``accumulate`` (the interval ends at the last
    call before ``calculate``): each rank keeps its interval's start and end as absolute
    readings of its own clock, and the longest interval of the data group counts, inside
    the one fused sync of a ``MetricCollection``; the sync then hands one rank's numbers
    (last stage, TP rank 0) to every rank of TP x PP, so every rank reports the same
    values, clock readings included. With ``device_mesh=None`` the mesh is
    ``DeviceMesh.current()``; in a ``MetricCollection`` give the collection the mesh so
    that all metrics share one sync.

    Resuming (``load_state_dict``): the interval goes on from the load, its steps counted
    from the saved run's last step; what the saved run accumulated since its last
    ``calculate`` stays in the interval with the time it took on that run's clock, so the
    first interval after a resume reports what a run without the stop reports over the
    same steps (the time between the save and the resume does not count).

    Args:
        counts: ``'global'`` (default): ``tokens``/``samples`` are already global
            per step (the same on every rank; reduced with MAX). ``'local'``: they
            are this rank's counts, summed over the data group (DP x CP; under CP
            pass ``samples`` on one CP rank only, e.g. ``cp_rank == 0``).
        flops_per_token: model FLOPs per token (forward + backward); also per call.
        peak_flops: peak FLOP/s of one device; also per call.
        num_devices: devices sharing the work for MFU; default the world size.
        max_param_groups: capacity of the learning-rate state.

    Example:
        >>> m = TrainMetric()
        >>> _ = m.accumulate(None, None, lr=[1e-4], tokens=512)
        >>> out = m.calculate()
        >>> out["learning rate"], sorted(out)
        (0.0001, ['learning rate', 'tokens/s', 'total time elapse'])
    """

    result_keys = ('learning rate', 'learning rate(param group *)', 'iters', 'total time elapse', 'speed',
                  'step time', 'tokens/s', 'samples/s', 'mfu', 'peak memory GiB', 'train/peak_memory_rank',
                  'train/peak_memory_reserved_gib', 'train/peak_memory_reserved_rank', 'train/step_time_max',
                  'train/step_time_min', 'train/step_time_slowest_rank',)

    unsliceable = "its readings are per rank and per step, not per sequence"
    # v2: the interval names its clock, the memory peaks are packed with their rank
    schema = Schema(version=2)

    # Where each interval starts: this rank's clock, and the last step counted before it.
    interval_start = Origin(lambda: time.perf_counter())
    interval_first_step = Origin("step")

    lr_groups = State("max", torch.int64, local="last")
    step = State("max", torch.int64, local="last")
    grad_accum = State("max", torch.int64, local="last")
    # The step before the interval: the earliest one stays when a failed interval folds back.
    first_step = State("min", torch.int64)
    # Clock readings differ between ranks, TP replicas included.
    elapsed = State("max", local="last", per_rank=True)
    # This rank's interval as (clock, start, end): which TrainMetric's clock, and the
    # readings on it; merged: (0, 0, the longest interval).
    interval = State(_longest, shape=(3,), default=math.inf, local=_extend, per_rank=True)
    peak_flops = State("max", local="last")
    # This rank's own seconds per step, merged over every rank (TP x PP too), and
    # (microseconds << 20) | global rank, so that the MAX names the slowest rank exactly.
    rank_step_time_max = State("max", local="last", scope="model")
    rank_step_time_min = State("min", local="last", scope="model")
    slowest_rank = State("max", torch.int64, local="last", scope="model")
    # The allocator's peaks, (bytes << 20) | global rank, over every rank of the job: the
    # MAX names the rank that holds the peak (under 1F1B usually the first stage).
    peak_allocated = State("max", torch.int64, scope="model")
    peak_reserved = State("max", torch.int64, scope="model")

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *, counts: str = "global",
                 flops_per_token: Optional[float] = None, peak_flops: Optional[float] = None,
                 num_devices: Optional[int] = None, max_param_groups: int = 16, **kwargs: Any) -> None:
        if counts not in _COUNTS:
            raise ValueError(f"{_NAME}: counts must be one of {_COUNTS}, got {counts!r}")
        self._start = time.perf_counter()
        # tells this metric's clock readings from those of a checkpoint another one saved
        # (the OS's randomness: a run that seeds `random` alike would draw the same token)
        self._clock = float(1 + secrets.randbits(52))
        super().__init__(device_mesh, process_group, **kwargs)
        if int(max_param_groups) < 1:
            raise ValueError(f"{_NAME}: max_param_groups must be >= 1, got {max_param_groups}")
        # -inf marks unused slots; "last": the newest lr wins, MAX over ranks (all equal).
        self.add_state("lr", State("max", shape=(int(max_param_groups),), local="last"))
        # Global counts are the same on every rank: sum over calls, MAX over ranks.
        reduce, local = ("max", "sum") if counts == "global" else ("sum", "sum")
        for name in ("tokens", "samples", "model_flops"):
            self.add_state(name, State(reduce, local=local, default=0.0))
        self.counts = counts
        self.flops_per_token = flops_per_token
        self.default_peak_flops = peak_flops
        self.num_devices = num_devices

    def update(self, inputs: Inputs, outputs: Outputs, *, lr: Union[float, Sequence[float], torch.Tensor, None] = None,
               step: Optional[int] = None, gradient_accumulation_steps: Optional[int] = None,
               tokens: Union[int, torch.Tensor, None] = None, samples: Union[int, torch.Tensor, None] = None,
               flops_per_token: Optional[float] = None, peak_flops: Optional[float] = None,
               **kwargs: Any) -> Dict[str, Any]:
        now = time.perf_counter()
        out: Dict[str, Any] = {"elapsed": now - self._start,
               "interval": torch.tensor([self._clock, self.interval_start, now], dtype=torch.float64)}
        lrs = [] if lr is None else list(lr) if isinstance(lr, (list, tuple)) else [lr]
        if lrs:  # [] (no optimizer, e.g. during evaluation) reports no lr, as in Twinkle
            cap = self.declarations["lr"].shape[0]
            if len(lrs) > cap:
                raise ValueError(f"{_NAME}: lr has {len(lrs)} param groups, more than {cap}; pass "
                                 f"TrainMetric(max_param_groups={len(lrs)})")
            values = [_number("lr", x) for x in lrs]
            out["lr"] = torch.tensor(values + [-math.inf] * (cap - len(values)), dtype=torch.float64)
            out["lr_groups"] = len(values)
        ga = None
        if gradient_accumulation_steps is not None:
            ga = _integer("gradient_accumulation_steps", gradient_accumulation_steps)
            if ga < 1:
                raise ValueError(f"{_NAME}: gradient_accumulation_steps must be >= 1, got {ga}")
            out["grad_accum"] = ga
        if step is not None:
            step = _integer("step", step)
            out["step"] = step
            out["first_step"] = self.interval_first_step
            steps = step - self.interval_first_step
            if steps > 0:
                out.update(_straggler((now - self.interval_start) / steps))
        for name, value in (("tokens", tokens), ("samples", samples)):
            if value is not None:
                out[name] = _count(name, value)
        fpt = flops_per_token if flops_per_token is not None else self.flops_per_token
        if tokens is not None and fpt is not None:
            out["model_flops"] = out["tokens"] * _number("flops_per_token", fpt)
        peak = peak_flops if peak_flops is not None else self.default_peak_flops
        if peak is not None:
            out["peak_flops"] = _number("peak_flops", peak)
        out.update(_memory_peaks())
        return out

    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        groups = s["lr_groups"]
        if groups > 0:
            if groups == 1:
                out["learning rate"] = s["lr"][0]
            else:
                for i in range(groups):
                    out[f"learning rate(param group {i + 1})"] = s["lr"][i]
        ga = s["grad_accum"] if s["grad_accum"] > 0 else 1
        _, start, end = s["interval"]
        interval = end - start if start != math.inf else -math.inf
        if s["elapsed"] != -math.inf:
            out["total time elapse"] = s["elapsed"]
        if s["step"] >= 0:
            out["iters"] = s["step"] // ga
            iters = (s["step"] - s["first_step"]) / ga
            out["speed"] = iters / interval if interval > 0 else 0.0
            if iters > 0:
                out["step time"] = interval / iters
            if s["slowest_rank"] >= 0:  # some rank saw steps this interval
                out["train/step_time_max"] = s["rank_step_time_max"] * ga
                out["train/step_time_min"] = s["rank_step_time_min"] * ga
                out["train/step_time_slowest_rank"] = _rank(s["slowest_rank"])
        for name in ("tokens", "samples"):
            negative_count(_NAME, name, s[name], self.intervals)
        if interval > 0 and interval != -math.inf:
            if s["tokens"] > 0:
                out["tokens/s"] = s["tokens"] / interval
            if s["samples"] > 0:
                out["samples/s"] = s["samples"] / interval
            if s["model_flops"] > 0 and s["peak_flops"] > 0:
                devices = self.num_devices or world_size()
                out["mfu"] = s["model_flops"] / interval / devices / s["peak_flops"]
        if s["peak_allocated"] >= 0:  # some rank's allocator had started
            out["peak memory GiB"] = (s["peak_allocated"] >> _RANK_BITS) / 2 ** 30
            out["train/peak_memory_rank"] = _rank(s["peak_allocated"])
        if s["peak_reserved"] >= 0:
            out["train/peak_memory_reserved_gib"] = (s["peak_reserved"] >> _RANK_BITS) / 2 ** 30
            out["train/peak_memory_reserved_rank"] = _rank(s["peak_reserved"])
        return out


def _with_rank(reading: int, what: str) -> int:
    """``(reading << 20) | global rank``: the MAX of such numbers over the ranks is the
    largest reading and names its rank exactly (of equal readings, the highest rank)."""
    rank = global_rank()
    if rank >> _RANK_BITS:
        raise ValueError(f"{_NAME}: global rank {rank} does not fit the {_RANK_BITS} bits of the "
                         f"{what} state; {what} is reported for up to 2**20 ranks")
    return (min(max(reading, 0), _MAX_READING) << _RANK_BITS) | rank


def _rank(packed: int) -> int:
    return packed & ((1 << _RANK_BITS) - 1)


def _straggler(per_step: float) -> dict:
    """This rank's step-time readings: seconds per step, and the packed id."""
    return {"rank_step_time_max": per_step, "rank_step_time_min": per_step,
            "slowest_rank": _with_rank(int(round(per_step * 1e6)), "slowest-rank")}


def _memory_peaks() -> dict:
    """This rank's allocator peaks (torch's counters on the host: no device wait), packed
    with its rank; nothing before the accelerator's allocator has started."""
    if not torch.accelerator.is_available():
        return {}
    stats = torch.accelerator.memory_stats()  # empty until the allocator starts
    out = {}
    for state, key in (("peak_allocated", "allocated_bytes.all.peak"), ("peak_reserved", "reserved_bytes.all.peak")):
        if stats.get(key, 0) > 0:
            out[state] = _with_rank(int(stats[key]), "peak-memory")
    return out


def _count(field: str, value):
    """A count (``inputs.checks.count``) as float64: Python numbers as they are, tensors kept
    on their device (no read)."""
    value = count(_NAME, field, value)
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(torch.float64)
    return float(value)


def _number(field: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{_NAME}: {field} must be a number, got {type(value).__name__}")
    return float(value)


def _integer(field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_NAME}: {field} must be an int, got {type(value).__name__} ({value!r})")
    return fits_int64(_NAME, field, int(value))
