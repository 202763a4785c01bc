"""``PassAtKMetric``: pass@k, pass^k, maj@k and best/worst@k over prompts, exact whatever
the split of a prompt's samples over calls, microbatches and data-parallel ranks.

Its states are the keyed tables of ``keyed_tables``; ``compute`` averages the estimators of
``subset_estimators`` over the prompts."""
from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from parallel import MeshLike
from parallel.groups import ProcessGroup
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import from_host
from twinkle_metrics.inputs.data_format import Inputs, Outputs, SideInput
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.inputs.rl import cp_lead
from twinkle_metrics.metrics.rl.keyed_tables import fold_tables, id_key, merge_rows, tensor_keys
from twinkle_metrics.metrics.rl.subset_estimators import (
    expected_max,
    expected_min,
    majority_at_k,
    pass_at_k,
    pass_hat_k,
)

_NAME = "PassAtKMetric"


# ---------------------------------------------------------------------------- metric
class PassAtKMetric(Metric):
    """pass@k, pass^k, maj@k, best@k and worst@k over the prompts of the interval, with
    bootstrap confidence intervals.

    ``accumulate(inputs, outputs, *, prompt_ids, correct, answers=None, rewards=None)``
    takes one entry per sample (completion): ``prompt_ids`` (ints or strs, or an int tensor;
    ``1`` and ``"1"`` are different prompts), ``correct`` (bools or 0/1, a list or a tensor
    on any device: a tensor's nonzero entries count as correct, its values are not checked,
    which would read the device), with ``with_answers=True`` also ``answers`` (an int or str
    per sample, or an int tensor) and with ``with_rewards=True`` ``rewards`` (numbers per
    sample, or a tensor). ``correct`` is required in every call (pass@k is always reported),
    and ``answers`` / ``rewards`` in every call of a metric built to take them.
    ``inputs`` / ``outputs`` are not read (except for the ``slice_by`` field): pass None,
    a dict or a list of them. Samples of one prompt may come in any calls and microbatches
    and on any data-parallel ranks: states merge by prompt, so every number is exact.

    Keys, for each ``k``, over the prompts with n >= k samples (a prompt with fewer does
    not count for that k):

    * ``pass@{k}``: mean of 1 - C(n - c, k) / C(n, k) (unbiased, Chen et al. 2021; c
      correct samples);
    * ``pass^{k}``: mean of C(c, k) / C(n, k), all k of k samples correct;
    * ``maj@{k}`` (``with_answers``): the expected correctness of the majority answer of k
      samples drawn without replacement, exact over all C(n, k) subsets (a dynamic
      programme over the answers' vote counts, ``majority_at_k``). A tie at the top is
      broken uniformly at random; an answer is correct with weight (its correct samples) /
      (its samples), i.e. correct when its samples are marked correct. Cost: about
      answers**2 * k**3 integer steps per prompt, once per distinct answer-count profile;
    * ``best@{k}`` / ``worst@{k}`` (``with_rewards``): expected max / min reward of k
      samples drawn without replacement, sum_i r_(i) C(i-1, k-1) / C(n, k) over the
      ascending rewards (NaN rewards propagate);
    * each with ``_ci_low`` / ``_ci_high``: a percentile bootstrap over prompts
      (``num_bootstrap`` resamples of the eligible prompts with replacement, seeded with
      ``bootstrap_seed``, level ``confidence``), computed from the reduced states, so the
      same on every rank and layout. Where needed the interval is widened to hold the
      estimate (rounding can leave it out by an ulp when every prompt has the same value);
    * ``num_prompts``, ``num_samples``.

    Nothing seen gives ``{}``. ``calculate()`` raises ``ValueError`` on every rank, keeping
    the interval (``reset()`` drops it), when some ``k`` exceeds every prompt's sample count,
    and when the bounded states overflowed. With ``slice_by`` (one interval per data source,
    say) each slice holds its own copy of the states and the k check applies per slice:
    pass ``inputs={"data_source": [...]}`` with one entry per sample.

    States (int64, fixed shapes, merged by key with sort / cumsum / index_add, never read
    in ``accumulate``): ``prompts`` ``[max_prompts + 1, 3]`` rows (prompt key, samples,
    correct); with answers ``answers`` ``[max_samples + 1, 4]`` rows (prompt key, answer key,
    samples, correct) per distinct (prompt, answer); with rewards ``rewards``
    ``[max_samples + 1, 2]`` rows (prompt key, reward float64 bits) per sample. The last row
    of each counts rows left out; keys are ``id_key`` (exact for ints in [0, 2**62 - 1),
    a 61-bit blake2b / splitmix64 hash otherwise). Each adds its size to the sync buffer,
    per slice with ``slice_by``: 24 KiB by default, 512 KiB for answers and 256 KiB for rewards.
    Under context parallelism the ranks of a CP group hold the same samples: only CP rank
    0 counts them.

    Args:
        k: one k or several (ints >= 1).
        max_prompts: distinct prompts one interval may hold (default 1024) over the whole
            data group; more raise at ``calculate()``.
        max_samples: (prompt, answer) pairs and rewarded samples one interval may hold
            (default 16384), when answers / rewards are taken.
        with_answers: take ``answers`` and report ``maj@{k}``.
        with_rewards: take ``rewards`` and report ``best@{k}`` / ``worst@{k}``.
        num_bootstrap: bootstrap resamples (default 1000; 0: no ``_ci_`` keys).
        bootstrap_seed: seed of the resampling (default 0).
        confidence: level of the interval (default 0.95).

    Example:
        >>> m = PassAtKMetric(k=(1, 2), num_bootstrap=0)
        >>> _ = m.accumulate(None, None, prompt_ids=["a", "a", "b"], correct=[1, 0, 1])
        >>> _ = m.accumulate(None, None, prompt_ids=["b", "a"], correct=[False, True])
        >>> out = m.calculate()  # a: 2 of 3 samples correct, b: 1 of 2
        >>> {key: round(v, 4) for key, v in out.items()}
        {'num_prompts': 2, 'num_samples': 5, 'pass@1': 0.5833, 'pass^1': 0.5833,
         'pass@2': 1.0, 'pass^2': 0.1667}
    """

    reads = Reads(keywords=("prompt_ids", "correct", "answers?", "rewards?"))
    #: ``{key}_ci_low`` / ``_ci_high``: the bootstrap interval of each pass@k, pass^k, maj@k, best@k, worst@k
    result_keys = ('pass@*', 'pass^*', 'maj@*', 'best@*', 'worst@*', '*_ci_low', '*_ci_high', 'num_prompts',
                   'num_samples',)

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *,
                 k: Union[int, Sequence[int]] = (1,), max_prompts: int = 1024, max_samples: int = 16384,
                 with_answers: bool = False, with_rewards: bool = False, num_bootstrap: int = 1000,
                 bootstrap_seed: int = 0, confidence: float = 0.95, **kwargs: Any) -> None:
        ks = (k,) if isinstance(k, numbers.Integral) and not isinstance(k, bool) else k
        if isinstance(ks, (str, bytes)) or not isinstance(ks, (list, tuple)) or not ks:
            raise TypeError(f"{_NAME}: k must be an int >= 1 or a non-empty list of them, got {k!r}")
        for v in ks:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{_NAME}: k must hold ints >= 1, got {v!r} in k={k!r}")
        for field, value, low in (("max_prompts", max_prompts, 1), ("max_samples", max_samples, 1),
                                  ("num_bootstrap", num_bootstrap, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{_NAME}: {field} must be an int >= {low}, got {value!r}")
        if isinstance(bootstrap_seed, bool) or not isinstance(bootstrap_seed, int):
            raise TypeError(f"{_NAME}: bootstrap_seed must be an int, got {bootstrap_seed!r}")
        if not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
            raise ValueError(f"{_NAME}: confidence must be in (0, 1), got {confidence!r}")
        super().__init__(device_mesh, process_group, **kwargs)
        self.k = tuple(sorted({int(v) for v in ks}))
        self.max_prompts, self.max_samples = max_prompts, max_samples
        self.with_answers, self.with_rewards = bool(with_answers), bool(with_rewards)
        self.num_bootstrap, self.bootstrap_seed, self.confidence = num_bootstrap, bootstrap_seed, float(confidence)
        self.add_state("prompts", State(self._reduce_prompts, torch.int64, shape=(max_prompts + 1, 3),
                                        default=0, local=self._fold_prompts))
        if self.with_answers:
            self.add_state("answers", State(self._reduce_answers, torch.int64, shape=(max_samples + 1, 4),
                                            default=0, local=self._fold_answers))
        if self.with_rewards:
            self.add_state("rewards", State(self._reduce_rewards, torch.int64, shape=(max_samples + 1, 2),
                                            default=0, local=self._fold_rewards))

    # ------------------------------------------------------------- reductions
    def _reduce_prompts(self, rows):
        return fold_tables(rows, 1, True)

    def _fold_prompts(self, old, new):
        return fold_tables(torch.stack([old, new]), 1, True)

    def _reduce_answers(self, rows):
        return fold_tables(rows, 2, True)

    def _fold_answers(self, old, new):
        return fold_tables(torch.stack([old, new]), 2, True)

    def _reduce_rewards(self, rows):
        return fold_tables(rows, 1, False)

    def _fold_rewards(self, old, new):
        return fold_tables(torch.stack([old, new]), 1, False)

    # ----------------------------------------------------------------- update
    def update(self, inputs: Inputs = None, outputs: Outputs = None, *, prompt_ids: SideInput = None,
               correct: SideInput = None, answers: SideInput = None, rewards: SideInput = None,
               **kwargs: Any) -> Dict[str, Any]:
        if prompt_ids is None:
            given = [f for f, v in (("correct", correct), ("answers", answers), ("rewards", rewards))
                     if v is not None]
            if given:
                raise ValueError(f"{_NAME}: got {', '.join(given)} without prompt_ids; pass prompt_ids, "
                                 "one per sample")
            return {}
        keys, keyed, distinct = _ids("prompt_ids", prompt_ids)
        n = keys.shape[0]
        if correct is None:
            raise ValueError(f"{_NAME}: correct is required with prompt_ids (pass@k counts correct "
                             f"samples); pass one bool or 0/1 per sample ({n})")
        flags = _flags(correct, n)
        answer_keys: Any = None
        reward_values: Any = None
        answers_keyed = False
        if self.with_answers:
            if answers is None:
                raise ValueError(f"{_NAME}: built with with_answers=True, so every call needs answers; "
                                 f"pass one answer (int or str) per sample ({n})")
            answer_keys, answers_keyed, _ = _ids("answers", answers, n)
        elif answers is not None:
            raise ValueError(f"{_NAME}: got answers, but the metric was built without with_answers=True; "
                             "build it with PassAtKMetric(..., with_answers=True) for maj@k")
        if self.with_rewards:
            if rewards is None:
                raise ValueError(f"{_NAME}: built with with_rewards=True, so every call needs rewards; "
                                 f"pass one number per sample ({n})")
            reward_values = _rewards(rewards, n)
        elif rewards is not None:
            raise ValueError(f"{_NAME}: got rewards, but the metric was built without with_rewards=True; "
                             "build it with PassAtKMetric(..., with_rewards=True) for best@k / worst@k")
        if distinct is not None and distinct > self.max_prompts:
            raise ValueError(f"{_NAME}: this call holds {distinct} distinct prompt_ids, more than "
                             f"max_prompts={self.max_prompts}; build the metric with a larger max_prompts")
        if self.with_rewards and n > self.max_samples:
            raise ValueError(f"{_NAME}: this call holds {n} rewarded samples, more than "
                             f"max_samples={self.max_samples}; build the metric with a larger max_samples")
        if n == 0 or not cp_lead(self):  # CP peers hold the same samples: validated, counted once
            return {}
        tensors = [t for t in (keys, flags, answer_keys, reward_values) if isinstance(t, torch.Tensor)]
        device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
        pk = _key_tensor(keys, keyed, device)
        ones = torch.ones(n, dtype=torch.int64, device=device)
        hit = _flag_tensor(flags, device)
        out = {"prompts": merge_rows(torch.stack([pk, ones, hit], 1), 1, self.max_prompts, True)}
        if self.with_answers:
            ak = _key_tensor(answer_keys, answers_keyed, device)
            out["answers"] = merge_rows(torch.stack([pk, ak, ones, hit], 1), 2, self.max_samples, True)
        if self.with_rewards:
            bits = from_host(reward_values, device).to(torch.float64).contiguous().view(torch.int64)
            out["rewards"] = merge_rows(torch.stack([pk, bits], 1), 1, self.max_samples, False)
        return out

    # ---------------------------------------------------------------- compute
    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        p, q = self.max_prompts, self.max_samples
        bounds = [("prompts", "max_prompts", p, "distinct prompts")]
        if self.with_answers:
            bounds.append(("answers", "max_samples", q, "distinct (prompt, answer) pairs"))
        if self.with_rewards:
            bounds.append(("rewards", "max_samples", q, "rewarded samples"))
        for state, field, bound, what in bounds:
            left_out = s[state][bound][0]
            if left_out:
                raise ValueError(f"calculate(): {_NAME} holds more than {field}={bound} {what} over the "
                                 f"interval's calls and data-parallel ranks together (at least {left_out} "
                                 f"more); build the metric with a larger {field} (e.g. {field}="
                                 f"{2 * bound}) or calculate() more often. The interval's states are kept; "
                                 "reset() drops them")
        table = [(row[0], row[1], row[2]) for row in s["prompts"][:p] if row[0]]
        if not table:
            return {}
        groups: Dict[int, List[Tuple[int, int]]] = {}
        if self.with_answers:
            for key, _, count, hit in s["answers"][:q]:
                if key:
                    groups.setdefault(key, []).append((count, hit))
        rewards: Dict[int, List[float]] = {}
        if self.with_rewards:
            rows = [row for row in s["rewards"][:q] if row[0]]
            values = torch.tensor([r[1] for r in rows], dtype=torch.int64).view(torch.float64).tolist()
            for (key, _), v in zip(rows, values):
                rewards.setdefault(key, []).append(v)
        largest = max(n for _, n, _ in table)
        out: Dict[str, Any] = {"num_prompts": len(table), "num_samples": sum(n for _, n, _ in table)}
        maj_cache: Dict[Tuple, float] = {}
        for k in self.k:
            chosen = [(key, n, c) for key, n, c in table if n >= k]
            if not chosen:
                raise ValueError(f"calculate(): {_NAME}: k={k} is larger than every prompt's number of "
                                 f"samples (the largest n seen is {largest}, over {len(table)} prompts); "
                                 f"pass k <= {largest}, or more samples per prompt. The interval's states "
                                 "are kept; reset() drops them")
            per_key = {f"pass@{k}": [pass_at_k(n, c, k) for _, n, c in chosen],
                       f"pass^{k}": [pass_hat_k(n, c, k) for _, n, c in chosen]}
            if self.with_answers:
                values = []
                for key, _, _ in chosen:
                    g = tuple(sorted(groups.get(key, ())))
                    if (g, k) not in maj_cache:
                        maj_cache[g, k] = majority_at_k(g, k)
                    values.append(maj_cache[g, k])
                per_key[f"maj@{k}"] = values
            if self.with_rewards:
                per_key[f"best@{k}"] = [expected_max(rewards[key], k) for key, _, _ in chosen]
                per_key[f"worst@{k}"] = [expected_min(rewards[key], k) for key, _, _ in chosen]
            index = self._resamples(len(chosen))
            for name, values in per_key.items():
                out[name] = _mean(values)
                if index is not None:
                    out[f"{name}_ci_low"], out[f"{name}_ci_high"] = self._interval(values, index, out[name])
        return out

    def _resamples(self, m: int) -> Optional[torch.Tensor]:
        """``[num_bootstrap, m]`` prompt indices drawn with replacement (CPU, seeded: the same on
        every rank), or None without a bootstrap."""
        if not self.num_bootstrap:
            return None
        g = torch.Generator().manual_seed(self.bootstrap_seed)
        return torch.randint(m, (self.num_bootstrap, m), generator=g)

    def _interval(self, values: List[float], index: torch.Tensor, estimate: float) -> Tuple[float, float]:
        means = torch.tensor(values, dtype=torch.float64)[index].mean(1)
        tail = (1.0 - self.confidence) / 2
        low, high = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
        if math.isnan(estimate):
            return low, high
        return min(low, estimate), max(high, estimate)


def _mean(values: List[float]) -> float:
    try:
        return math.fsum(values) / len(values)  # exactly rounded: the order of prompts cannot matter
    except (ValueError, OverflowError):  # inf - inf: as plain floats do
        return sum(values) / len(values)


# ------------------------------------------------------------------------- inputs
def _ids(field: str, value, n: Optional[int] = None) -> Tuple[torch.Tensor, bool, Optional[int]]:
    """``(tensor, keyed, distinct)``: a list of ids as a host tensor of their keys
    (``keyed``) and their number of distinct values, or an int tensor as given ([n] or
    [n, 1]; its keys are taken on its device, ``tensor_keys``) and None."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise TypeError(f"{_NAME}: {field} must be an integer tensor (or a list of ints / strs), got a "
                            f"{value.dtype} tensor of shape {list(value.shape)}")
        if not (value.dim() == 1 or (value.dim() == 2 and value.shape[1] == 1)):
            raise ValueError(f"{_NAME}: {field} has shape {list(value.shape)}; expected one id per sample: "
                             "[n] or [n, 1]")
        value = value.reshape(-1)
        _check_length(field, value.shape[0], n)
        return value, False, None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{_NAME}: {field} must be a list or tuple with one int or str per sample, or an "
                        f"int tensor, got {type(value).__name__}")
    _check_length(field, len(value), n)
    kinds = set(map(type, value))
    if kinds <= {int}:  # plain ints (the common case): keyed in one vectorised pass
        try:
            return tensor_keys(torch.tensor(value, dtype=torch.int64)), True, len(set(value))
        except (OverflowError, RuntimeError):  # an int beyond int64: hashed on the host below
            pass
    keys = []
    for i, v in enumerate(value):
        kind = type(v)
        if kind is str:
            keys.append(_str_key(v))
        elif kind is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool)):
            keys.append(id_key(v))
        else:
            try:
                hash(v)
            except TypeError:
                raise TypeError(f"{_NAME}: {field}[{i}] is a {kind.__name__}, which is not hashable; "
                                "expected an int or a str per sample") from None
            raise TypeError(f"{_NAME}: {field}[{i}] is a {kind.__name__} ({v!r}); expected an int or a str "
                            "per sample")
    distinct = len(set(value)) if kinds <= {int, str} else len(set(keys))
    return torch.tensor(keys, dtype=torch.int64), True, distinct


@functools.lru_cache(maxsize=1 << 16)
def _str_key(v: str) -> int:
    return id_key(v)


def _check_length(field: str, got: int, n: Optional[int]) -> None:
    if n is not None and got != n:
        raise ValueError(f"{_NAME}: {field} has {got} entries but prompt_ids has {n}; pass one per sample")


def _per_sample(field: str, value: torch.Tensor, n: Optional[int], holds: str, each: str) -> torch.Tensor:
    """A tensor of one entry per sample ([n] or [n, 1]) as [n], left where it is."""
    if value.is_complex():
        raise TypeError(f"{_NAME}: {field} must hold {holds}, got a {value.dtype} tensor")
    if not (value.dim() == 1 or (value.dim() == 2 and value.shape[1] == 1)):
        raise ValueError(f"{_NAME}: {field} has shape {list(value.shape)}; expected one {each} per sample: "
                         "[n] or [n, 1]")
    value = value.reshape(-1)
    _check_length(field, value.shape[0], n)
    return value


def _flags(value, n: int):
    """``correct`` as a host list of 0/1 ints, or a tensor ([n] or [n, 1]) left where it is."""
    if isinstance(value, torch.Tensor):
        return _per_sample("correct", value, n, "bools or 0/1", "flag")
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{_NAME}: correct must be a list of bools / 0-1 or a tensor, got "
                        f"{type(value).__name__}")
    _check_length("correct", len(value), n)
    if any(isinstance(v, torch.Tensor) for v in value):
        parts = []
        for i, v in enumerate(value):
            if not isinstance(v, torch.Tensor) or v.numel() != 1 or v.is_complex():
                raise TypeError(f"{_NAME}: correct[{i}] is {type(v).__name__}; a list holding tensors needs "
                                "one one-element tensor per sample")
            parts.append(v.reshape(()))
        device = next((t.device for t in parts if t.device.type != "cpu"), None)
        return torch.stack([t.to(device, non_blocking=True) if device else t for t in parts])
    if set(map(type, value)) <= {bool, int, float} and set(value) <= {0, 1}:  # the common case, at once
        return torch.tensor(value, dtype=torch.int64)
    flags = []
    for i, v in enumerate(value):
        if isinstance(v, numbers.Real) and v in (0, 1):
            flags.append(1 if v == 1 else 0)
        else:
            raise ValueError(f"{_NAME}: correct[{i}] is {v!r}; expected a bool or 0/1 per sample")
    return flags


def _rewards(value, n: int):
    """``rewards`` as a float64 tensor ([n]), on the device it came on."""
    if isinstance(value, torch.Tensor):
        return _per_sample("rewards", value, n, "real numbers", "number").to(torch.float64)
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{_NAME}: rewards must be a list of numbers or a tensor, got {type(value).__name__}")
    _check_length("rewards", len(value), n)
    if any(isinstance(v, torch.Tensor) for v in value):
        parts = []
        for i, v in enumerate(value):
            if not isinstance(v, torch.Tensor) or v.numel() != 1 or v.is_complex():
                raise TypeError(f"{_NAME}: rewards[{i}] is {type(v).__name__}; a list holding tensors needs "
                                "one one-element tensor per sample")
            parts.append(v.reshape(()).to(torch.float64))
        device = next((t.device for t in parts if t.device.type != "cpu"), None)
        return torch.stack([t.to(device, non_blocking=True) if device else t for t in parts])
    if set(map(type, value)) <= {int, float}:  # the common case, at once
        return torch.tensor(value, dtype=torch.float64)
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{_NAME}: rewards[{i}] is {v!r}; expected a number per sample")
    return torch.tensor([float(v) for v in value], dtype=torch.float64)


def _key_tensor(keys: torch.Tensor, keyed: bool, device) -> torch.Tensor:
    keys = from_host(keys, device) if keys.device.type == "cpu" else keys
    return keys if keyed else tensor_keys(keys)


def _flag_tensor(flags, device) -> torch.Tensor:
    if isinstance(flags, list):
        return from_host(torch.tensor(flags, dtype=torch.int64), device)
    t = flags if flags.device == device or flags.device.type != "cpu" else from_host(flags, device)
    return (t != 0).to(torch.int64)
