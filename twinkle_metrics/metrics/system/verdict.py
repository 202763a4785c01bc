"""What ``StepGuard`` decides, as plain data: the policy, the verdict, and the pure rule
between them (``decide``), the same on every rank given the same reduced numbers.

Every rank reduces the same few numbers of a step (``StepGuard.check``); ``decide`` turns
them and the guard's kept values (the loss baseline, the run of non-ok steps) into the
verdict and the kept values after the step. Nothing here reads a tensor or talks to a rank.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

_NAME = "StepGuard"
#: what a guard can check for non-finite numbers
CHECKS = ("loss", "grad_norm", "values")
ACTIONS = ("ok", "skip", "stop")
#: a bad rank rides in the low bits of ``step << RANK_BITS | rank`` (a MIN gives the lowest
#: step, then the lowest rank)
RANK_BITS = 20
RANK_MASK = (1 << RANK_BITS) - 1
#: steps must fit float64 exactly once packed with a rank (the kept lanes ride as float64)
MAX_STEP = 1 << (53 - RANK_BITS)
#: the kept values, in the order they ride in a step's sum (``StepGuard``'s kept states)
KEPT = ("checked", "streak", "streak_first", "base_mean", "base_var", "base_n")


@dataclass(frozen=True)
class GuardPolicy:
    """What a ``StepGuard`` checks and what it answers: plain data, the same on every rank
    by construction (a guard's constructor arguments are its policy, so ranks that build
    it otherwise raise at their first ``check()``, as metrics' fingerprints do).

    Args:
        checks: which inputs are checked for NaN/inf: ``"loss"``, ``"grad_norm"``,
            ``"values"`` (per-token values).
        on_nonfinite: the answer to a step with a non-finite checked value on any rank:
            ``"skip"`` or ``"stop"``.
        on_spike: the answer to a loss spike: ``"skip"``, ``"stop"``, or ``"ok"`` (counted
            and reported only; the loss then joins the baseline).
        max_skips: consecutive non-ok steps answered ``"skip"``; the next one is ``"stop"``.
        spike_z: a spike needs the global loss at least this many baseline standard
            deviations above the baseline mean (``None``: no z-score condition).
        spike_ratio: ... and at least this many times the baseline mean, where that mean is
            positive (``None``: no ratio condition). Both ``None``: no spike checks.
        warmup: steps folded into the baseline before a spike can be found.
        ewma: the weight of a new loss in the baseline's mean and variance (an exponential
            moving average; during the first ``1 / ewma`` steps a plain running mean).
    """

    checks: Tuple[str, ...] = CHECKS
    on_nonfinite: str = "skip"
    on_spike: str = "skip"
    max_skips: int = 3
    spike_z: Optional[float] = 6.0
    spike_ratio: Optional[float] = 1.5
    warmup: int = 50
    ewma: float = 0.1

    def __post_init__(self) -> None:
        checks = self.checks
        if isinstance(checks, str) or not isinstance(checks, (tuple, list)):
            raise TypeError(f"{_NAME}: checks must be a tuple of names from {CHECKS}, got {checks!r}")
        unknown = [c for c in checks if c not in CHECKS]
        if unknown or len(set(checks)) != len(checks):
            raise ValueError(f"{_NAME}: checks must name each of {CHECKS} at most once, got {tuple(checks)}")
        object.__setattr__(self, "checks", tuple(checks))
        _choice("on_nonfinite", self.on_nonfinite, ("skip", "stop"))
        _choice("on_spike", self.on_spike, ACTIONS)
        _integer("max_skips", self.max_skips)
        _integer("warmup", self.warmup)
        for name, low in (("spike_z", 0.0), ("spike_ratio", 1.0)):
            value = getattr(self, name)
            if value is not None and (not _real(value) or not math.isfinite(value) or value <= low):
                raise ValueError(f"{_NAME}: {name} must be a number above {low:g} or None, got {value!r}")
        if not _real(self.ewma) or not 0 < self.ewma <= 1:
            raise ValueError(f"{_NAME}: ewma must be a number in (0, 1], got {self.ewma!r}")

    def arguments(self) -> Dict[str, Any]:
        """The policy as ``StepGuard``'s keyword arguments."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BadRank:
    """A rank whose checked values were not finite: its global rank, the step, its host
    (``socket.gethostname()``), its device and local rank, and which inputs were bad;
    ``host``/``device`` are ``None`` where they could not be learnt (the store did not
    answer, or the step came before a resume)."""

    rank: int
    step: int
    host: Optional[str] = None
    device: Optional[str] = None
    local_rank: Optional[int] = None
    fields: Tuple[str, ...] = ()

    @property
    def packed(self) -> int:
        return (self.step << RANK_BITS) | self.rank

    def __str__(self) -> str:
        where = ", ".join(x for x in (self.host and f"host {self.host}", self.device,
                                      self.local_rank is not None and f"local rank {self.local_rank}") if x)
        bad = f": non-finite {', '.join(self.fields)}" if self.fields else ""
        return f"rank {self.rank}{f' ({where})' if where else ''} at step {self.step}{bad}"


@dataclass(frozen=True)
class Verdict:
    """One step's verdict, the same on every rank.

    ``action`` is ``"ok"``, ``"skip"`` (do not apply this step's update) or ``"stop"``;
    ``reason`` ``None``, ``"nonfinite"`` or ``"spike"``. ``bad`` is this step's lowest
    rank with a non-finite value, ``first`` the first one (lowest step, then lowest rank)
    of the current run of non-ok steps. The numbers behind it: ``bad_ranks`` (ranks with
    any non-finite checked value), ``nonfinite`` (ranks per input, and ``"entries"``: the
    non-finite per-token values over every rank), ``loss`` (the global token-weighted loss,
    ``None`` where no rank passed one) over ``tokens``, the baseline it was compared with
    (``baseline_mean``, ``baseline_std``, ``baseline_steps``), ``z`` and ``ratio``, and
    ``streak`` (non-ok steps in a row, this one included).
    """

    action: str
    step: int
    reason: Optional[str] = None
    bad: Optional[BadRank] = None
    first: Optional[BadRank] = None
    bad_ranks: int = 0
    nonfinite: Mapping[str, int] = field(default_factory=dict)
    loss: Optional[float] = None
    tokens: float = 0.0
    spike: bool = False
    z: Optional[float] = None
    ratio: Optional[float] = None
    baseline_mean: Optional[float] = None
    baseline_std: Optional[float] = None
    baseline_steps: int = 0
    streak: int = 0
    #: the guard's kept values after this step (what ``StepGuard.update`` folds)
    kept: Mapping[str, float] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.action == "ok"

    @property
    def skip(self) -> bool:
        return self.action == "skip"

    @property
    def stop(self) -> bool:
        return self.action == "stop"

    def __str__(self) -> str:
        text = f"step {self.step}: {self.action}"
        if self.reason == "nonfinite":
            where = ", ".join(f"{k} on {v}" for k, v in self.nonfinite.items() if k != "entries" and v)
            text += f": non-finite values on {self.bad_ranks} rank{'s' if self.bad_ranks != 1 else ''} ({where})"
            if self.first is not None:
                text += f"; first: {self.first}"
        elif self.reason == "spike":
            text += (f": loss spike {self.loss:.6g} against a baseline of {self.baseline_mean:.6g} +- "
                     f"{self.baseline_std:.3g} (z {self.z:.3g}" + (f", ratio {self.ratio:.3g})" if self.ratio else ")"))
        elif self.loss is not None:
            text += f" (loss {self.loss:.6g})"
        if self.streak > 1:
            text += f"; {self.streak} non-ok steps in a row"
        return text


def decide(policy: GuardPolicy, step: int, totals: Mapping[str, float], kept: Mapping[str, float],
           bad: Optional[BadRank], first: Optional[BadRank]) -> Verdict:
    """The verdict of one step from its reduced ``totals`` (``loss``, ``tokens``, ``bad``,
    the per-input counts ``loss_ranks``/``grad_norm_ranks``/``values_ranks``, ``entries``)
    and the guard's ``kept`` values before it; ``bad``: the step's lowest bad rank (when any
    rank was bad), ``first``: the first bad rank of the current run if it began earlier."""
    tokens = totals["tokens"]
    loss = totals["loss"] / tokens if tokens else (totals["loss"] if not math.isfinite(totals["loss"]) else None)
    nonfinite = totals["bad"] > 0
    mean, var, n = kept["base_mean"], kept["base_var"], int(kept["base_n"])
    std = math.sqrt(var) if n else None
    z = ratio = None
    spike = False
    if loss is not None and math.isfinite(loss) and std is not None:  # n > 0
        z = (loss - mean) / std if std > 0 else (math.inf if loss > mean else 0.0)
        ratio = loss / mean if mean > 0 else None
        conditions = [] if n < policy.warmup else (
            ([z >= policy.spike_z] if policy.spike_z is not None else [])
            + ([ratio >= policy.spike_ratio] if policy.spike_ratio is not None and ratio is not None else []))
        spike = bool(conditions) and all(conditions)
    if nonfinite:
        reason, action = "nonfinite", policy.on_nonfinite
    elif spike:
        reason, action = "spike", policy.on_spike
    else:
        reason, action = None, "ok"
    streak = 0 if action == "ok" else int(kept["streak"]) + 1
    if action == "skip" and streak > policy.max_skips:
        action = "stop"
    first = None if action == "ok" else first or bad
    after = {"checked": int(kept["checked"]) + 1, "streak": streak,
             "streak_first": -1 if first is None else first.packed,
             "base_mean": mean, "base_var": var, "base_n": n}
    if action == "ok" and loss is not None and math.isfinite(loss):
        alpha = max(policy.ewma, 1.0 / (n + 1))  # a running mean until the average takes over
        delta = loss - mean
        after.update(base_mean=mean + alpha * delta, base_var=(1 - alpha) * (var + alpha * delta * delta),
                     base_n=n + 1)
    return Verdict(action, step, reason, bad, first, int(totals["bad"]),
                   {"loss": int(totals["loss_ranks"]), "grad_norm": int(totals["grad_norm_ranks"]),
                    "values": int(totals["values_ranks"]), "entries": int(totals["entries"])},
                   loss, tokens, spike, z, ratio, mean if n else None, std, n, streak, after)


def _choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{_NAME}: {name} must be one of {allowed}, got {value!r}")


def _integer(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{_NAME}: {name} must be an int >= 0, got {value!r}")


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
