"""``CompletionRewardMetric``: reward, completion-length and rollout-timing statistics."""
from __future__ import annotations

import math
from numbers import Number
from typing import Any, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, SupportsFloat, Union, cast

import torch

from parallel import MeshLike
from parallel.groups import ProcessGroup
from twinkle_metrics.core.config import Schema
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.slicing import SEP
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import counts, negative_count, nonfinite, real_values
from twinkle_metrics.inputs.checks import nan_policy as check_nan_policy
from twinkle_metrics.inputs.data_format import Inputs, Outputs, SideInput
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.inputs.rl import cp_lead
from twinkle_metrics.stats.histogram import Histogram, check_quantiles, quantile_keys
from twinkle_metrics.stats.moments import moments, moments_state

_NAME = "CompletionRewardMetric"
_PREFIX = "reward/"
_HIST = "hist/reward/"
_LENGTHS = "hist/completion_length"
#: completion lengths (counts: 0 has its own bucket, (0, 1) reads as 1) and rewards
LENGTH_HISTOGRAM = Histogram(1.0, 1e9, signed=False)
REWARD_HISTOGRAM = Histogram(1e-6, 1e9)
#: a group's reward std counts as zero at or below this: TRL's isclose(std, 0) (atol 1e-8)
_ZERO_STD = 1e-8


class CompletionRewardMetric(Metric):
    """Rewards per reward function, completion lengths and rollout timings (Twinkle's keys).

    Keys: ``train/{name}_reward`` (mean), ``train/{name}_reward_std`` (sample std,
    Bessel; 0 for one value), ``train/completion_length`` (mean) with ``_min`` /
    ``_max``, ``train/completion_clipped_ratio`` (lengths >= ``max_completion_length``),
    ``train/frac_reward_zero_std`` (prompt groups whose total reward has sample std
    <= 1e-8, TRL's ``isclose(std, 0)``; the total is the NaN-skipping sum over reward
    functions, as TRL's ``nansum``; a group of one completion counts as zero std; each
    call's groups are tested on their own, so a prompt group must lie within one
    ``accumulate`` call of one rank: ids are not matched across calls or ranks, and a
    group split over them is counted as several),
    ``profiling/Time taken: generate`` and ``profiling/Time taken: move_model_to_sampler``
    (mean seconds per call).

    Unlike Twinkle, every statistic is exact over the whole data group (Twinkle
    reports each rank's own numbers): the std is merged from (count, mean, M2) with
    Chan's parallel formula in float64, which stays exact when mean >> std. Nothing
    seen gives ``{}`` rather than Twinkle's -1.0.

    Non-finite rewards (``nan_policy``, default ``'skip'``: TRL's behaviour): NaN
    rewards (a reward function that returned None) and +-inf are dropped from that
    reward's mean and std, as TRL's nanmean does for NaN, and count as 0 in the total
    tested by ``frac_reward_zero_std`` (TRL's nansum; with ``zero_std_reward`` they
    are left out of their group's std). ``'propagate'``: they flow into the mean, the
    std and ``frac_reward_zero_std`` (NaN there, rather than a silently False
    comparison). Both report ``train/nonfinite_rewards`` (over every reward name)
    when > 0.

    Rewards per name are ``[n]`` or ``[n, 1]`` tensors, lists of numbers (``None``
    for a missing one), or one number; other shapes are an error.

    Under context parallelism the ranks of a CP group hold the same rollouts; only
    CP rank 0 contributes, so each completion counts once. Reward names seen on
    the other CP ranks still create their states.

    Reward names: pass ``reward_names=[...]`` to fix them up front (a name outside
    them is an error). Without it, a name gets its state the first time
    ``accumulate`` sees it, on this rank or, at ``calculate()``, on any other: a
    name that only some ranks or pipeline stages met (the last stage, say, while
    the others pass nothing) is merged exactly, the other ranks adding nothing to
    it, and every rank reports it. Adding a name costs one more exchange at the
    next ``calculate()`` (``twinkle_metrics.comm``).

    Args:
        reward_names: reward function names known up front (recommended).
        max_completion_length: length at which a completion counts as clipped.
        num_generations: completions per prompt, consecutive within each call; enables
            ``frac_reward_zero_std`` (or pass ``group_ids`` to ``accumulate``: ids within
            the call). Either way a prompt group must lie within one ``accumulate`` call of
            one rank (after verl's ``balance_batch`` or any reshuffle across ranks, call it
            where the whole groups are, such as the rollout driver).
        zero_std_reward: the reward name whose per-group std is tested; default the
            sum over all reward functions of the call (TRL tests the total reward).
        nan_policy: ``'skip'`` (default, TRL's) or ``'propagate'`` (see above).
        quantiles: e.g. ``(0.5, 0.9, 0.99)``: also report ``train/completion_length_p50``,
            ``train/{name}_reward_p50``, ... (``p99.9`` for 0.999), nearest-rank over the
            whole data group from histograms (``twinkle_metrics.stats.histogram``) within 1%
            relative error of the true value: lengths in [1, 1e9) (0 exact), rewards with
            magnitude in [1e-6, 1e9) (0 exact; outside, clamped to the bound). Non-finite
            rewards follow ``nan_policy`` (``'propagate'``: NaN quantiles when a reward
            was NaN). Each histogram adds one int64 state of 1,046 (lengths) or 3,478
            (each reward) buckets to the sync buffer. None (default): no histogram.

    Example::

        m = CompletionRewardMetric(reward_names=["accuracy", "format"], num_generations=8)
        m.accumulate(rewards={"accuracy": acc, "format": fmt}, completion_lengths=lens,
                     generate_time=12.3, weight_sync_time=0.8)
        m.calculate()   # {'train/accuracy_reward': ..., 'train/accuracy_reward_std': ..., ...}

    Example:
        >>> m = CompletionRewardMetric(reward_names=["acc"])
        >>> _ = m.accumulate(None, None, rewards={"acc": [1.0, 0.0, 1.0]}, completion_lengths=[10, 20, 30])
        >>> {k: round(v, 4) for k, v in m.calculate().items()}  # doctest: +NORMALIZE_WHITESPACE
        {'train/acc_reward': 0.6667, 'train/acc_reward_std': 0.5774, 'train/completion_length': 20.0,
         'train/completion_length_min': 10.0, 'train/completion_length_max': 30.0}
    """

    reads = Reads(keywords=("rewards", "group_ids?"))
    result_keys = ('train/*_reward', 'train/*_reward_std', 'train/*_reward_p*', 'train/completion_length',
                  'train/completion_length_min', 'train/completion_length_max', 'train/completion_length_p*',
                  'train/completion_clipped_ratio', 'train/frac_reward_zero_std', 'train/nonfinite_rewards',
                  'profiling/Time taken: move_model_to_sampler', 'profiling/Time taken: generate',)

    # fixed names or names as they come decide which states are created on the fly: ranks
    # must agree on it, while a checkpoint loads across the two (its states are checked)
    schema = Schema(sync_only=("reward_names",))

    len_count = State("sum", torch.int64)
    len_sum = State("sum", torch.float64)
    len_min = State("min", torch.float64)
    len_max = State("max", torch.float64)
    len_clipped = State("sum", torch.int64)
    groups = State("sum", torch.int64)
    groups_zero_std = State("sum", torch.int64)
    gen_time_sum = State("sum", torch.float64)
    gen_time_n = State("sum", torch.int64)
    sync_time_sum = State("sum", torch.float64)
    sync_time_n = State("sum", torch.int64)
    n_bad = State("sum", torch.int64)  # non-finite rewards
    zero_std_nan = State("sum")  # 0, or NaN when a group's total was non-finite ('propagate')

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *,
                 reward_names: Optional[Sequence[str]] = None,
                 max_completion_length: Optional[int] = None,
                 num_generations: Optional[int] = None,
                 zero_std_reward: Optional[str] = None,
                 nan_policy: str = "skip", quantiles: Optional[Sequence[float]] = None, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.nan_policy = check_nan_policy(_NAME, nan_policy)
        self.quantiles = check_quantiles(_NAME, quantiles)
        if self.quantiles:
            self.add_state(_LENGTHS, LENGTH_HISTOGRAM.state())
        if num_generations is not None and (not isinstance(num_generations, int) or num_generations < 1):
            raise ValueError(f"{_NAME}: num_generations must be a positive int, got {num_generations!r}")
        self.max_completion_length = max_completion_length
        self.num_generations = num_generations
        self.zero_std_reward = zero_std_reward
        self._dynamic = reward_names is None
        if self._dynamic:  # a reward name's (count, mean, M2) state, and its histogram, as names come
            self.add_state_family(_PREFIX, moments_state())
            if self.quantiles:
                self.add_state_family(_HIST, REWARD_HISTOGRAM.state())
        self._ensure_names(sorted(set(reward_names or ())))

    # ----------------------------------------------------------------- states
    def _ensure_names(self, names) -> None:
        for name in names:
            _check_name(name)
            if _PREFIX + name not in self.declarations:
                self.add_state(_PREFIX + name, moments_state())
            if self.quantiles and _HIST + name not in self.declarations:
                self.add_state(_HIST + name, REWARD_HISTOGRAM.state())

    @property
    def reward_names(self) -> List[str]:
        return sorted(k[len(_PREFIX):] for k in self.declarations if k.startswith(_PREFIX) and SEP not in k)

    # ----------------------------------------------------------------- update
    def update(self, inputs: Inputs = None, outputs: Outputs = None, *,
               rewards: Union[Mapping[str, SideInput], SideInput] = None, completion_lengths: SideInput = None,
               completions: SideInput = None, generate_time: Union[float, torch.Tensor, None] = None,
               generation_time: Union[float, torch.Tensor, None] = None,
               weight_sync_time: Union[float, torch.Tensor, None] = None, group_ids: SideInput = None,
               **kwargs: Any) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        lead = cp_lead(self)
        per_name = self._rewards_dict(rewards)
        if not self._dynamic:
            unknown = sorted(set(per_name) - set(self.reward_names))
            if unknown:
                raise ValueError(f"{_NAME}: rewards {unknown} are not in reward_names="
                                 f"{self.reward_names}; add them to reward_names")
        sizes = {name: v.shape[0] for name, v in per_name.items()}
        skip = self.nan_policy == "skip"
        for name, values in per_name.items():
            out[_PREFIX + name] = moments(values, torch.isfinite(values) if skip else None)
            if self.quantiles:
                out[_HIST + name] = REWARD_HISTOGRAM.counts(values, torch.isfinite(values) if skip else None)
            out["n_bad"] = out.get("n_bad", 0) + nonfinite(values).sum()

        lengths = self._lengths(completion_lengths, completions)
        if lengths is not None and lengths.numel():
            out["len_count"] = lengths.numel()
            out["len_sum"] = lengths.sum()
            out["len_min"] = lengths.amin()
            out["len_max"] = lengths.amax()
            if self.max_completion_length is not None:
                out["len_clipped"] = (lengths >= self.max_completion_length).sum()
            if self.quantiles:
                out[_LENGTHS] = LENGTH_HISTOGRAM.counts(lengths)

        if per_name and (group_ids is not None or self.num_generations is not None):
            out.update(self._zero_std_groups(per_name, sizes, group_ids))

        if generate_time is not None and generation_time is not None:
            raise ValueError(f"{_NAME}: got both generate_time and generation_time; pass one")
        gen = generate_time if generate_time is not None else generation_time
        for key, field, value in (("gen_time", "generate_time", gen),
                                  ("sync_time", "weight_sync_time", weight_sync_time)):
            if value is None:
                continue
            t = _as_1d(field, value)
            out[f"{key}_sum"] = t.sum()
            out[f"{key}_n"] = t.numel()
        # CP ranks of one group hold the same rollouts: validate everywhere, count once.
        if not lead:  # zeros are the identity of the moments merge and of the counts; names still get states
            return {k: torch.zeros_like(v) for k, v in out.items() if k.startswith((_PREFIX, _HIST))}
        return out

    def _rewards_dict(self, rewards) -> Dict[str, torch.Tensor]:
        if rewards is None:
            return {}
        if not isinstance(rewards, Mapping):
            rewards = {"reward": rewards}  # a plain list / tensor of one reward function
        for name in rewards:
            _check_name(str(name))
        return {str(name): _reward_values(f"rewards[{name!r}]", v) for name, v in rewards.items()}

    def _lengths(self, completion_lengths, completions) -> Optional[torch.Tensor]:
        if completion_lengths is not None:
            if completions is not None:
                raise ValueError(f"{_NAME}: got both completion_lengths and completions; pass one (the "
                                 "lengths are taken from one of them)")
            return counts(_NAME, "completion_lengths", _reward_values("completion_lengths", completion_lengths))
        if completions is None:
            return None
        if not isinstance(completions, (list, tuple)):
            raise TypeError(f"{_NAME}: completions must be a list of strings or token-id lists, got "
                            f"{type(completions).__name__}")
        lens = []
        for i, c in enumerate(completions):
            if isinstance(c, str):
                lens.append(len(c))  # characters: no tokenizer here
            elif isinstance(c, torch.Tensor):
                lens.append(c.shape[-1] if c.dim() else 1)
            elif isinstance(c, (list, tuple)):
                lens.append(len(c))  # token ids
            else:
                raise TypeError(f"{_NAME}: completions[{i}] is a {type(c).__name__}; expected a "
                                "string (length in characters) or token ids (length in tokens)")
        return torch.tensor(lens, dtype=torch.float64)

    def _zero_std_groups(self, per_name, sizes, group_ids) -> Dict[str, Any]:
        n_values = set(sizes.values())
        if len(n_values) != 1:
            raise ValueError(f"{_NAME}: reward functions returned different numbers of values "
                             f"{sizes}; frac_reward_zero_std needs one value per completion")
        n = n_values.pop()
        if self.zero_std_reward is not None:
            if self.zero_std_reward not in per_name:
                raise ValueError(f"{_NAME}: zero_std_reward={self.zero_std_reward!r} is not among "
                                 f"the rewards of this call {sorted(per_name)}")
            total = per_name[self.zero_std_reward].to(torch.float64)
            # skip: a non-finite reward is left out of its group's std
            ok = ~nonfinite(total) if self.nan_policy == "skip" else None
        else:  # TRL: nansum over reward functions, so a missing reward counts as 0
            values = torch.stack([v.to(torch.float64) for v in per_name.values()])
            if self.nan_policy == "skip":
                values = torch.where(nonfinite(values), 0.0, values)
            total, ok = values.sum(0), None
        out: Dict[str, Any] = {}
        if self.nan_policy == "propagate":  # a NaN std compares False: carry the NaN instead
            out["zero_std_nan"] = (total * 0.0).sum()
        if ok is not None:
            total = torch.where(ok, total, 0.0)
        if group_ids is not None:
            ids = _group_ids(group_ids).to(total.device)
            if ids.shape[0] != n:
                raise ValueError(f"{_NAME}: group_ids has {ids.shape[0]} entries but there are {n} "
                                 "rewards; pass one group id per completion")
            # O(n^2) pairwise sums instead of torch.unique (which waits for the device).
            same = ids[:, None] == ids[None, :]
            member = same if ok is None else same & ok[None, :]
            count = member.to(torch.float64).sum(1)
            mean = torch.where(member, total[None, :], 0.0).sum(1) / count.clamp(min=1.0)  # NaN members: NaN
            dev = torch.where(member, total[None, :] - mean[:, None], 0.0)
            std = ((dev * dev).sum(1) / (count - 1).clamp(min=1.0)).sqrt()
            earlier = torch.ones(n, n, dtype=torch.bool, device=total.device).tril(-1)
            first = (same & earlier).sum(1) == 0
            out.update(groups=first.sum(), groups_zero_std=(first & (std <= _ZERO_STD)).sum())
            return out
        g = cast(int, self.num_generations)  # set: the caller comes here with group_ids or num_generations
        if n % g:
            raise ValueError(f"{_NAME}: {n} rewards are not a multiple of num_generations={g}; "
                             "pass whole prompt groups to each accumulate call, or group_ids")
        grouped = total.reshape(n // g, g)
        if ok is None:
            std = grouped.std(1) if g > 1 else torch.zeros(n // g, dtype=torch.float64, device=total.device)
        else:  # the std of each group's finite members (fewer than two: 0, as for one completion)
            okg = ok.reshape(n // g, g)
            count = okg.to(torch.float64).sum(1)
            mean = grouped.sum(1) / count.clamp(min=1.0)
            dev = torch.where(okg, grouped - mean[:, None], 0.0)
            std = ((dev * dev).sum(1) / (count - 1).clamp(min=1.0)).sqrt()
        out.update(groups=n // g, groups_zero_std=(std <= _ZERO_STD).sum())
        return out

    # ---------------------------------------------------------------- compute
    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if s["len_count"]:
            negative_count(_NAME, "completion_lengths (the smallest)", float(s["len_min"]), self.intervals)
        if s["sync_time_n"]:
            out["profiling/Time taken: move_model_to_sampler"] = s["sync_time_sum"] / s["sync_time_n"]
        if s["gen_time_n"]:
            out["profiling/Time taken: generate"] = s["gen_time_sum"] / s["gen_time_n"]
        for name in self.reward_names:
            n, mean, m2 = s[_PREFIX + name]
            if n < 1:
                continue
            out[f"train/{name}_reward"] = mean
            if n > 1:
                out[f"train/{name}_reward_std"] = (max(m2, 0.0) / (n - 1)) ** 0.5  # max(NaN, 0) is NaN
            else:  # one value: 0, unless that value was NaN/inf ('propagate')
                out[f"train/{name}_reward_std"] = 0.0 if math.isfinite(mean) else math.nan
            if self.quantiles:
                out.update(quantile_keys(f"train/{name}_reward", REWARD_HISTOGRAM, s[_HIST + name],
                                         self.quantiles, propagate_nan=self.nan_policy == "propagate"))
        if s["len_count"]:
            out["train/completion_length"] = s["len_sum"] / s["len_count"]
            out["train/completion_length_min"] = s["len_min"]
            out["train/completion_length_max"] = s["len_max"]
            if self.quantiles:
                out.update(quantile_keys("train/completion_length", LENGTH_HISTOGRAM, s[_LENGTHS],
                                         self.quantiles, propagate_nan=True))
            if self.max_completion_length is not None:
                out["train/completion_clipped_ratio"] = s["len_clipped"] / s["len_count"]
        if s["groups"]:
            out["train/frac_reward_zero_std"] = s["groups_zero_std"] / s["groups"] + s["zero_std_nan"]
        if s["n_bad"]:
            out["train/nonfinite_rewards"] = int(s["n_bad"])
        return out


def _as_1d(field: str, value) -> torch.Tensor:
    real_values(_NAME, field, value, allow_bool=True)  # pass/fail rewards may be bools
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(torch.float64)
    if isinstance(value, Number):
        return torch.tensor([float(cast(SupportsFloat, value))], dtype=torch.float64)  # a complex raises
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, torch.Tensor) for v in value):
            items = []
            for i, v in enumerate(value):
                if v is None:  # a reward function that returned None: missing, as NaN
                    v = float("nan")
                if not (isinstance(v, Number) or (isinstance(v, torch.Tensor) and v.numel() == 1)):
                    raise TypeError(f"{_NAME}: {field}[{i}] is {type(v).__name__}; expected a number, "
                                    "None or a one-element tensor per completion")
                items.append(torch.as_tensor(v).reshape(()).to(torch.float64))
            device = next(t.device for t in items if t.device.type != "cpu") if \
                any(t.device.type != "cpu" for t in items) else None
            return torch.stack([t.to(device, non_blocking=True) if device else t for t in items])
        try:
            return torch.tensor([float("nan") if v is None else v for v in value], dtype=torch.float64)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"{_NAME}: {field} must be a number, a list of numbers or a tensor, got "
                    f"{type(value).__name__}")


def _group_ids(group_ids) -> torch.Tensor:
    """Group ids as an int64 tensor. Host ids of any hashable kind (verl's ``uid`` is a
    uuid string) are numbered on the host in order of first appearance: host data, no
    device wait. A tensor, or a list holding tensors, is used as it is."""
    if isinstance(group_ids, torch.Tensor):
        return group_ids.reshape(-1)
    if isinstance(group_ids, (str, bytes)) or not isinstance(group_ids, Iterable):
        raise TypeError(f"{_NAME}: group_ids must be a tensor or a sequence of hashable ids, got "
                        f"{type(group_ids).__name__}")
    group_ids = list(group_ids)
    if any(isinstance(g, torch.Tensor) for g in group_ids):
        return torch.stack([torch.as_tensor(g).reshape(()) for g in group_ids])
    index: Dict[Any, int] = {}
    for g in group_ids:
        if not isinstance(g, Hashable):
            raise TypeError(f"{_NAME}: group_ids holds a {type(g).__name__}, which is not hashable; pass "
                            "one hashable id (int, str, ...) per completion, or a tensor")
        index.setdefault(g, len(index))
    return torch.tensor([index[g] for g in group_ids], dtype=torch.int64)


def _check_name(name) -> None:
    """A reward name: a non-empty string without the slice separator (``'@'`` would make its
    states read as a slice of another reward's)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"{_NAME}: reward names must be non-empty strings, got {name!r}")
    if SEP in name:
        raise ValueError(f"{_NAME}: reward name {name!r} contains {SEP!r}, which separates a state from its "
                         f"slice in state names; rename the reward (e.g. {name.replace(SEP, '_')!r})")


def _reward_values(field: str, value) -> torch.Tensor:
    """Values of one reward function (or the completion lengths): ``[n]``, ``[n, 1]``, a list
    of numbers, or one number; anything else would be flattened into a wrong mean."""
    shape = list(value.shape) if isinstance(value, torch.Tensor) else None
    if shape is None and isinstance(value, (list, tuple)) and not any(isinstance(v, torch.Tensor) for v in value):
        try:
            shape = list(torch.tensor([float("nan") if v is None else v for v in value],
                                      dtype=torch.float64).shape)
        except (TypeError, ValueError):
            shape = None  # _as_1d raises its TypeError below
    t = _as_1d(field, value)
    if shape is not None and not (len(shape) <= 1 or (len(shape) == 2 and shape[1] == 1)):
        raise ValueError(f"{_NAME}: {field} has shape {shape}; expected one value per completion: [n] or "
                         f"[n, 1] (or a list of numbers); pass one reward function's values per name "
                         "(a dict of names for several functions)")
    return t.reshape(-1)
