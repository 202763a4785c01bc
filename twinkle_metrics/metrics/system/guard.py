"""``StepGuard``: one verdict a step, the same on every rank (go on, skip the update, or
stop), naming the first rank whose numbers were not finite, and whether the global loss
spiked against a running baseline.

A healthy step costs one SUM all-reduce of a few float64 numbers over every rank of the
mesh (WORLD when the mesh spans it; else its data group, then its TP x PP group), on the
job's own groups through ``comm.transport.Transport``, and the one device-to-host read of
its result. The numbers: the loss pair ``[sum, count]`` (counted once per data shard: the
mesh's result source, last stage and TP rank 0), the count of ranks with a non-finite
checked value (and per input), an agreement token (a 32-bit hash of the guard's fingerprint
and the step, as 16-bit halves with their squares: ranks agree exactly when ``n * sum(h^2)
== sum(h)^2``), a count of ranks that rejected their input, and the guard's kept values
(its loss baseline, its run of non-ok steps) from the mesh's first rank alone. Every rank
reduces the same numbers, so every rank takes the same branch:

* something is bad (a non-finite value, a rejected input): a second, MIN all-reduce names
  the lowest bad rank (and the lowest rejecting one); the bad rank writes its host, device
  and local rank under one key of WORLD's store (``get_group_store()``) and the others read
  it, within the mesh's bound;
* the ranks disagree on the guard or the step: one gather of what each holds, then
  ``MetricSyncError`` on every rank, naming which ranks hold what.

The verdict (``verdict.decide``) is folded into the guard's states by ``accumulate``
(``update`` reads the verdict), so the counts come out of ``calculate()`` with the other
metrics, in the same fused sync, and out of ``export()``.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import socket
import weakref
import zlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from parallel import MeshLike
from parallel import groups as G
from parallel.groups import ProcessGroup
from twinkle_metrics.comm.plan import MetricSyncError
from twinkle_metrics.comm.transport import Transport
from twinkle_metrics.comm.waits import ranges
from twinkle_metrics.core.config import Schema
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import host_reads, nonfinite, scalar
from twinkle_metrics.inputs.data_format import Inputs, Outputs
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.metrics.system.verdict import (
    CHECKS,
    KEPT,
    MAX_STEP,
    RANK_BITS,
    RANK_MASK,
    BadRank,
    GuardPolicy,
    Verdict,
    decide,
)

_NAME = "StepGuard"
_WHAT = "StepGuard.check()"
_NONE = 2 ** 63 - 1  # first_bad's identity: no bad rank this interval
#: the lanes of a step's sum, in order (then the kept values, ``KEPT``)
_LANES = ("loss", "tokens", "bad", "loss_ranks", "grad_norm_ranks", "values_ranks", "entries",
          "rejected", "ranks", "h1", "h1_sq", "h2", "h2_sq")
_AT = {name: i for i, name in enumerate(_LANES)}
_NOBODY = float(1 << 30)  # above every rank: the MIN's "no such rank"
#: per default group, for the store keys of bad steps: guards of each mesh checked so far
_SERIALS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class StepGuard(Metric):
    """A per-step NaN and loss-spike verdict that every rank shares.

    Call ``check`` once a step, on every rank, after the backward and before the update,
    with what the step has: the loss (Megatron's per-microbatch reports ``[{"lm loss":
    tensor([loss_sum, num_tokens])}, ...]``, ``[]`` on other stages; a ``[sum, count]``
    tensor; or a scalar, a mean counted as one entry), the grad norm, per-token ``values``
    (only real tokens, or zeros where masked). Every rank gets the same ``Verdict``:
    ``ok``, ``skip`` (do not apply this update) or ``stop``, with the first bad rank, its
    host and device, and the numbers behind it (``verdict.Verdict``). The policy is the
    constructor's arguments (``GuardPolicy``: see there).

    Keys of ``calculate()`` (over the interval; the same on every rank): ``guard/steps``,
    ``guard/skipped``, ``guard/stopped``, ``guard/nonfinite_steps``, ``guard/spikes``,
    ``guard/first_bad_rank`` and ``guard/first_bad_step`` (lowest step, then lowest rank;
    when there was one), ``guard/loss_baseline`` and ``guard/loss_baseline_std`` (the
    running baseline). The baseline and the run of non-ok steps are kept over intervals and
    in ``state_dict()`` (``State(keep=True)``): a resumed run goes on where it was.

    Args:
        checks, on_nonfinite, on_spike, max_skips, spike_z, spike_ratio, warmup, ewma:
            the policy (``GuardPolicy``).
        loss_key: the key of Megatron's report dicts.

    Example:
        >>> import torch
        >>> guard = StepGuard(warmup=3)
        >>> for loss_sum in (20.0, 21.0, 19.0):                  # [loss_sum, num_tokens]
        ...     v = guard.check(loss=torch.tensor([loss_sum, 10.0]), grad_norm=1.5)
        >>> v.action, round(v.loss, 2)
        ('ok', 1.9)
        >>> v = guard.check(loss=torch.tensor([float("nan"), 10.0]), grad_norm=1.5)
        >>> v.action, v.bad.rank, v.bad.fields
        ('skip', 0, ('loss',))
        >>> v = guard.check(loss=torch.tensor([60.0, 10.0]), grad_norm=1.5)  # 3x the baseline
        >>> v.action, v.reason, round(v.ratio, 2)
        ('skip', 'spike', 3.0)
        >>> out = guard.calculate()
        >>> [out[k] for k in ("guard/steps", "guard/skipped", "guard/spikes", "guard/first_bad_step")]
        [5, 2, 1, 3]
    """

    reads = Reads(keywords=("verdict?",))
    result_keys = ("guard/steps", "guard/skipped", "guard/stopped", "guard/nonfinite_steps", "guard/spikes",
                   "guard/first_bad_rank", "guard/first_bad_step", "guard/loss_baseline",
                   "guard/loss_baseline_std")
    unsliceable = "its verdicts are per step over every rank, not per sequence"
    schema = Schema(sync_only=("loss_key",))  # where the loss is read changes no state's meaning

    # Counts of the interval: every rank folds the same verdicts, so a MAX over ranks is exact.
    steps = State("max", torch.int64, default=0, local="sum")
    skipped = State("max", torch.int64, default=0, local="sum")
    stopped = State("max", torch.int64, default=0, local="sum")
    nonfinite_steps = State("max", torch.int64, default=0, local="sum")
    spikes = State("max", torch.int64, default=0, local="sum")
    # (step << 20) | rank of the first bad rank of the interval: lowest step, then lowest rank
    first_bad = State("min", torch.int64)
    # Kept over the run (the verdict's ``kept``): steps checked, the run of non-ok steps and
    # its first bad rank (packed, -1: none), the loss baseline.
    checked = State("max", torch.int64, default=0, local="last", keep=True)
    streak = State("max", torch.int64, default=0, local="last", keep=True)
    streak_first = State("max", torch.int64, default=-1, local="last", keep=True)
    base_mean = State("max", default=0.0, local="last", keep=True)
    base_var = State("max", default=0.0, local="last", keep=True)
    base_n = State("max", torch.int64, default=0, local="last", keep=True)

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *,
                 checks: Tuple[str, ...] = CHECKS, on_nonfinite: str = "skip", on_spike: str = "skip",
                 max_skips: int = 3, spike_z: Optional[float] = 6.0, spike_ratio: Optional[float] = 1.5,
                 warmup: int = 50, ewma: float = 0.1, loss_key: str = "lm loss", **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.policy = GuardPolicy(checks, on_nonfinite, on_spike, max_skips, spike_z, spike_ratio, warmup, ewma)
        if not isinstance(loss_key, str):
            raise TypeError(f"{_NAME}: loss_key must be a string, got {type(loss_key).__name__}")
        self.loss_key = loss_key
        self._serial: Optional[str] = None  # this guard's place among the mesh's (store keys)
        self._calls = 0
        self._token: Optional[int] = None
        self._seen: Optional[BadRank] = None  # the first bad rank of the current run, with its host

    @classmethod
    def from_policy(cls, policy: GuardPolicy, device_mesh: MeshLike = None,
                    process_group: ProcessGroup = None, **kwargs: Any) -> "StepGuard":
        """A guard with ``policy`` (``GuardPolicy``)."""
        return cls(device_mesh, process_group, **policy.arguments(), **kwargs)

    # ------------------------------------------------------------------- the step
    @torch.no_grad()
    def check(self, loss: Union[float, torch.Tensor, Mapping[str, Any], Sequence[Any], None] = None, *,
              grad_norm: Union[float, torch.Tensor, None] = None,
              values: Union[torch.Tensor, Sequence[torch.Tensor], None] = None, step: Optional[int] = None) -> Verdict:
        """The verdict of this step, the same on every rank. Collective over every rank of
        the mesh: call it on every rank, once a step, with the same ``step`` (default: the
        steps this guard checked before, kept over a resume). Raises on every rank when a
        rank rejects its input (the rank its own error, the others ``MetricSyncError``) or
        when ranks hold other guards or steps (``MetricSyncError``, naming them)."""
        mesh = self.resolve_mesh()
        mesh.check_live(_WHAT)
        groups = self._groups(mesh)
        t = Transport(_WHAT, mesh, groups[0] if groups else None, groups[1] if len(groups) > 1 else None)
        try:
            mine, flags = self._lanes(loss, grad_norm, values, step, mesh, t.device)
            error = None
        except (TypeError, ValueError) as exc:
            error, flags = exc, None
            mine = torch.zeros(len(_LANES), dtype=torch.float64, device=t.device)
            mine[_AT["rejected"]] = 1.0
        head = all(G.group_rank(g) == 0 for g in groups)  # its kept values ride for every rank
        if head:
            states = self.states
            kept = torch.stack([states[k].to(t.device, torch.float64) for k in KEPT])
        else:
            kept = torch.zeros(len(KEPT), dtype=torch.float64, device=t.device)
        buf = torch.cat([mine, kept])
        self._calls += 1
        for g in groups:
            t.all_reduce(buf, g)
        read = t.host(buf)  # the step's one device-to-host read
        with host_reads():
            total = dict(zip(_LANES + KEPT, read.tolist()))
        rank = G.global_rank()
        lowest = (self._lowest(t, groups, flags, rank, error is not None) if total["bad"] or total["rejected"]
                  else (_NOBODY, _NOBODY))
        if lowest[1] < _NOBODY:
            if error is not None:
                raise error
            raise MetricSyncError(f"{_WHAT}: rank {int(lowest[1])} rejected its input (its error says why), so "
                                  f"no rank checked this step (this is rank {rank}); nothing was folded")
        n = int(total["ranks"])
        if any(n * int(total[f"h{i}_sq"]) != int(total[f"h{i}"]) ** 2 for i in (1, 2)):
            self._disagree(t, groups, rank, step)
        step = int(total["checked"]) if step is None else step
        bad = None
        if lowest[0] < _NOBODY:
            bad = self._whereabouts(mesh, int(lowest[0]), rank, step, flags, loss, grad_norm, values)
        verdict = decide(self.policy, step, totals=total, kept=total, bad=bad,
                         first=self._run_first(int(total["streak_first"])))
        self.accumulate(None, None, verdict=verdict)
        self._seen = verdict.first
        return verdict

    def _groups(self, mesh) -> List[Any]:
        """The groups a step's sum runs over, in order: WORLD when the mesh spans it, else
        the data group and the TP x PP group (a SUM over both is a SUM over the mesh)."""
        if mesh.member_ranks() is not None and self.process_group is None:
            return [dist.group.WORLD]
        return [g for g in (self.data_group(), mesh.mp_group) if G.normalize(g) is not None]

    def _lanes(self, loss, grad_norm, values, step, mesh, device):
        """This rank's lanes (``_LANES``) on ``device``, and its bad flags per input (a
        tensor there), validated first; no device read."""
        if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)
                                 or not 0 <= int(step) < MAX_STEP):
            raise ValueError(f"{_WHAT}: step must be an int in [0, 2**{53 - RANK_BITS}), got {step!r}")
        checks = self.policy.checks
        zero = torch.zeros((), dtype=torch.float64, device=device)
        pair = _loss_pair(loss, self.loss_key)
        pair = torch.zeros(2, dtype=torch.float64, device=device) if pair is None else pair.to(device)
        norm = None if grad_norm is None else scalar(_NAME, "grad_norm", grad_norm)
        norm = zero if norm is None else torch.as_tensor(norm, dtype=torch.float64).to(device)
        entries = zero
        for v in _value_list(values):
            entries = entries + nonfinite(v).sum().to(device, torch.float64)
        flags = torch.stack([
            (nonfinite(pair).sum() > 0).double() if "loss" in checks else zero,
            nonfinite(norm).double() if "grad_norm" in checks else zero,
            (entries > 0).double() if "values" in checks else zero])
        source = pair if mesh.is_result_source else torch.zeros_like(pair)
        if self._token is None:  # the guard's fingerprint: its class and policy
            self._token = zlib.crc32(self.sync_fingerprint().encode())
        h = zlib.crc32(f"{self._token}@{step}".encode())
        hosts = torch.tensor([0.0, 1.0] + [v for x in (h >> 16, h & 0xFFFF) for v in (x, x * x)],
                             dtype=torch.float64)
        lanes = torch.cat([source, (flags.sum() > 0).double().reshape(1), flags,
                           entries.reshape(1) if "values" in checks else zero.reshape(1), hosts.to(device)])
        return lanes, flags

    def _lowest(self, t, groups, flags, rank: int, rejected: bool):
        """The lowest bad rank and the lowest rejecting rank (``_NOBODY``: none): one MIN."""
        mine = torch.tensor([_NOBODY, float(rank) if rejected else _NOBODY], dtype=torch.float64).to(t.device)
        if flags is not None:
            mine[0] = torch.where(flags.sum() > 0, mine.new_tensor(float(rank)), mine[0])
        for g in groups:
            t.all_reduce(mine, g, dist.ReduceOp.MIN)
        read = t.host(mine)
        with host_reads():
            return read.tolist()

    def _whereabouts(self, mesh, bad_rank: int, rank: int, step: int, flags, loss, grad_norm, values) -> BadRank:
        """The bad rank's host, device and bad inputs: it writes them under this call's key of
        WORLD's store, the others read them (within the mesh's bound)."""
        store = G.group_store(dist.group.WORLD) if G.dist_ready() else None
        # the bad rank names the key: meshes over other ranks, built alike, never share one
        key = f"twinkle_metrics/guard/{self._serial_key(mesh)}/{self._calls}/{bad_rank}"
        if rank == bad_rank:
            with host_reads():
                bad = [name for name, f in zip(CHECKS, flags.cpu().tolist()) if f]
            local = os.environ.get("LOCAL_RANK")
            info: Dict[str, Any] = {"host": socket.gethostname(), "device": _device_of(loss, grad_norm, values),
                    "local_rank": int(local) if local and local.isdigit() else None, "fields": bad}
            if store is not None:
                try:
                    store.set(key, json.dumps(info))
                except (RuntimeError, dist.DistError):
                    pass
        else:
            info = {}
            if store is not None:
                try:
                    store.wait([key], mesh.wait_timeout())
                    info = json.loads(store.get(key).decode())
                except (RuntimeError, ValueError, dist.DistError):
                    info = {}
        return BadRank(bad_rank, step, info.get("host"), info.get("device"), info.get("local_rank"),
                       tuple(info.get("fields", ())))

    def _serial_key(self, mesh) -> str:
        if self._serial is None:  # every rank checks its guards of a mesh in one order
            world = dist.group.WORLD if G.dist_ready() else None
            counts = {} if world is None else _SERIALS.setdefault(world, {})
            counts[mesh.wait_key] = n = counts.get(mesh.wait_key, 0) + 1
            self._serial = f"{mesh.wait_key}#{n}"
        return self._serial

    def _run_first(self, packed: int) -> Optional[BadRank]:
        """The first bad rank of the current run of non-ok steps (kept packed), with the host
        and device this process learnt (none after a resume)."""
        if packed < 0:
            return None
        seen = self._seen
        if seen is not None and seen.packed == packed:
            return seen
        return BadRank(packed & RANK_MASK, packed >> RANK_BITS)

    def _disagree(self, t, groups, rank: int, step) -> None:
        """Every rank's guard and step, gathered (over each group in turn), then raised."""
        held: List[Any] = [[rank, f"{self.sync_fingerprint()} at step {step}"]]
        for g in groups:
            held = [x for part in t.gather_bytes(json.dumps(held).encode(), g) for x in json.loads(part)]
        by_text: Dict[str, List[int]] = {}
        for r, text in held:
            by_text.setdefault(text, []).append(r)
        said = "; ".join(f"ranks {ranges(rs)} hold {text}" if len(rs) > 1 else f"rank {rs[0]} holds {text}"
                         for text, rs in by_text.items())
        raise MetricSyncError(f"{_WHAT}: the ranks do not agree on the guard or the step: {said} (this is rank "
                              f"{rank}); build the guard with the same arguments on every rank and call check() "
                              "once a step on every rank, with the same step. Nothing was folded")

    # ----------------------------------------------------------- the metric contract
    def update(self, inputs: Inputs, outputs: Outputs, *, verdict: Optional[Verdict] = None,
               **kwargs: Any) -> Dict[str, Any]:
        if verdict is None:
            return {}
        if not isinstance(verdict, Verdict):
            raise TypeError(f"{_NAME}: verdict must be a Verdict (StepGuard.check returns it), got "
                            f"{type(verdict).__name__}")
        out: Dict[str, Any] = {"steps": 1, "skipped": int(verdict.skip), "stopped": int(verdict.stop),
               "nonfinite_steps": int(verdict.reason == "nonfinite"), "spikes": int(verdict.spike)}
        if verdict.bad is not None:
            out["first_bad"] = verdict.bad.packed
        out.update({k: verdict.kept[k] for k in KEPT})
        return out

    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        if not s["steps"]:
            return {}
        out: Dict[str, Any] = {"guard/steps": s["steps"], "guard/skipped": s["skipped"], "guard/stopped": s["stopped"],
               "guard/nonfinite_steps": s["nonfinite_steps"], "guard/spikes": s["spikes"]}
        if s["first_bad"] != _NONE:
            out["guard/first_bad_rank"] = s["first_bad"] & RANK_MASK
            out["guard/first_bad_step"] = s["first_bad"] >> RANK_BITS
        if s["base_n"] > 0:
            out["guard/loss_baseline"] = s["base_mean"]
            out["guard/loss_baseline_std"] = math.sqrt(s["base_var"])
        return out


def _loss_pair(loss, key: str) -> Optional[torch.Tensor]:
    """This rank's loss as a float64 ``[sum, count]`` on its device, or None (no loss here)."""
    if loss is None:
        return None
    if isinstance(loss, Mapping):
        loss = [loss]
    if not isinstance(loss, (list, tuple)):
        return _pair(loss, "loss")
    total = None
    for i, item in enumerate(loss):
        where = f"loss[{i}]"
        if isinstance(item, Mapping):
            if key not in item:
                raise ValueError(f"{_WHAT}: {where} has no {key!r} (got keys {sorted(map(str, item))}); pass "
                                 f"StepGuard(loss_key=...) or Megatron's reports [{{{key!r}: tensor([loss_sum, "
                                 "num_tokens])}, ...]")
            item, where = item[key], f"{where}[{key!r}]"
        pair = _pair(item, where)
        total = pair if total is None else total + pair.to(total.device)
    return total


def _pair(value, where: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool or value.numel() not in (1, 2):
            raise ValueError(f"{_WHAT}: {where} is a {value.dtype} tensor of shape {list(value.shape)}; expected "
                             "a loss (one number) or Megatron's [loss_sum, num_tokens] pair")
        value = value.detach().reshape(-1).to(torch.float64)
        return value if value.numel() == 2 else torch.cat([value, torch.ones_like(value)])
    number = scalar(_NAME, where, value)
    return torch.tensor([float(number), 1.0], dtype=torch.float64)


def _value_list(values) -> List[torch.Tensor]:
    items = [] if values is None else list(values) if isinstance(values, (list, tuple)) else [values]
    for i, v in enumerate(items):
        if not isinstance(v, torch.Tensor) or v.is_complex():
            got = f"a {v.dtype} tensor" if isinstance(v, torch.Tensor) else type(v).__name__
            raise TypeError(f"{_WHAT}: values{f'[{i}]' if items is not values else ''} must be a real tensor, "
                            f"got {got}")
    return items


def _device_of(*inputs) -> str:
    """The accelerator this rank computes on: that of its first device tensor, else CUDA's
    current device where CUDA runs, else ``"cpu"``."""
    for x in inputs:
        for t in x if isinstance(x, (list, tuple)) else [x]:
            if isinstance(t, Mapping):
                t = next(iter(t.values()), None)
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                return str(t.device)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


__all__ = ["StepGuard", "GuardPolicy", "Verdict", "BadRank"]
