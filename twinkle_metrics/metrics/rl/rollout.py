"""``RolloutMismatchMetric``: how far the inference engine's log-probs are from the trainer's."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional

import torch

from parallel import MeshLike, group_rank
from parallel.groups import ProcessGroup
from twinkle_metrics.comm import agreement as exchange
from twinkle_metrics.core import fold
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import nan_policy as check_nan_policy
from twinkle_metrics.inputs.data_format import Inputs, Outputs, SideInput
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.inputs.rl import aligned_microbatches, cp_sum, nonfinite_tokens
from twinkle_metrics.kernels import dispatch as _triton
from twinkle_metrics.metrics.rl.loss_agg import (
    LOSS_AGG_MODES,
    check_loss_agg,
    sequence_mean,
    sequence_table,
)

#: the per-sequence columns (named as the states they sum), and under a sequence-aggregated
#: loss_agg_mode the token sums after them, then the sequence's token capacity
_PARTS = ("sum_d", "n_tok", "sum_abs", "sum_em", "n_high", "n_low", "sum_k3", "sum_lp_train", "sum_lp_rollout",
          "width")
#: the token sums those modes aggregate (the ``seq_sums`` state), all counted by ``n_tok``; the
#: token count as a value too: with ``sum_em`` (of w - 1) it makes the sum of w
_SEQ_SUMS = ("sum_d", "sum_abs", "sum_em", "n_tok", "n_high", "n_low", "sum_k3", "sum_lp_train", "sum_lp_rollout")
_SEQ_COLUMNS = tuple(_PARTS.index(c) for c in _SEQ_SUMS)


def _ess_merge(rows: torch.Tensor) -> torch.Tensor:
    """Merge ``[k, 3]`` rows of (shift m, A = sum e^(s - m), B = sum e^(2 (s - m))).

    A row with A = 0 is empty (the identity, (0, 0, 0)). Rescaling to the largest
    shift keeps every term <= 1: sequence log-ratios of hundreds (long sequences, a
    biased engine) neither overflow nor underflow to 0/0. NaN anywhere stays NaN.
    """
    m, a, b = rows[:, 0], rows[:, 1], rows[:, 2]
    live = a != 0  # NaN != 0: a NaN row takes part and poisons the result
    top = torch.where(live, m, -math.inf).amax()
    scale = torch.where(live, torch.exp(m - top), 0.0)
    a_sum, b_sum = (a * scale).sum(), (b * scale * scale).sum()
    return torch.stack([torch.where(a_sum != 0, top, 0.0), a_sum, b_sum])


def _ess_fold(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return _ess_merge(torch.stack([old, new]))


class RolloutMismatchMetric(Metric):
    """Mismatch between the trainer's and the rollout engine's log-probs of the same tokens.

    ``outputs['logps']`` are the trainer's per-token log-probs under the weights the
    rollout sampled with (the old log-probs of GRPO/PPO; the current ones on the first,
    on-policy step); ``rollout_logps=`` are the inference engine's (vLLM, SGLang) for
    the same tokens, dense ``[N, s]`` or ragged per sequence like GRPOMetric's
    ``old_logps``. Over valid tokens (``completion_mask``, else ``labels !=
    ignore_index``) that have a rollout log-prob, with d = logp_train - logp_rollout
    and the importance weight w = exp(d):

    * ``rollout/logp_abs_diff_mean``, ``_max``: mean and max |d| (TRL's
      ``sampling/sampling_logp_difference/mean``, ``/max``);
    * ``rollout/is_ratio_mean``, ``_std`` (population), ``_min``, ``_max`` of w (verl's
      ``rollout_corr/rollout_is_mean``, ``_std``, ``_min``, ``_max``; TRL's
      ``sampling/importance_sampling_ratio/mean``, ``/min``, ``/max``);
    * ``rollout/is_fraction_high`` / ``_low``: fraction of tokens with w above
      ``is_threshold`` / below ``is_threshold_low``, those truncated (or masked)
      importance sampling clips (verl's ``rollout_is_ratio_fraction_high`` / ``_low``);
    * ``rollout/token_ess``: normalised effective sample size (sum w)^2 / (n sum w^2)
      of the token weights, and ``rollout/seq_ess``: the same over sequences with
      w_i = exp(sum of d over sequence i) (verl's ``rollout_is_eff_sample_size`` for
      token- and sequence-level IS): 1 when all weights are equal, 1/n when one
      dominates;
    * ``rollout/mismatch_kl`` = mean(logp_rollout - logp_train) = -mean d, may be
      negative (verl's ``rollout_corr/kl``, earlier ``mismatch/mismatch_kl``);
    * ``rollout/mismatch_k3_kl`` = mean(e^r - r - 1) with r = -d, Schulman's k3 of
      KL(rollout || train), never negative (verl's ``k3_kl``);
    * ``rollout/training_ppl`` = exp(-mean logp_train), ``rollout/rollout_ppl`` =
      exp(-mean logp_rollout), ``rollout/ppl_ratio`` = training / rollout (verl's
      ``training_ppl``, ``rollout_ppl``, ``ppl_ratio``);
    * ``rollout/log_ppl_abs_diff``: mean over sequences of |mean over the sequence of
      (logp_rollout - logp_train)| (verl's ``log_ppl_abs_diff``).

    Token means are over all tokens of the data group (verl averages its
    perplexities per sequence; here they are token-level, so ``ppl_ratio`` =
    exp(mismatch_kl)). Both ESS are normalised: 1 when every weight is equal, 1/n
    when one dominates. ``is_threshold_low=None`` is 1 / ``is_threshold``, as in
    verl. Sequences are the rows of the batch (as GSPOMetric's); a sequence counts in
    the sequence keys when it has at least one counted token.

    Exact over any layout, from mergeable states only: token statistics are sums
    (w - 1 = expm1(d) and its square in float64, so the spread of w near 1 keeps
    its digits), extremes are max/min of d, and the sequence ESS is a shifted sum
    pair merged by rescaling to the largest shift. Under CP a sequence's tokens
    are split over the CP ranks: its sum of d is completed over the CP group in
    ``accumulate`` (one host-side agreement and one all_reduce, as GSPOMetric; every
    CP rank must call it the same number of times), then counted on CP rank 0 only.
    With ``process_group`` given, the CP rules still follow the mesh (the group must
    then hold its DP x CP ranks).

    Non-finite values (``nan_policy``): a counted token whose trainer or rollout
    log-prob is NaN/inf. ``'propagate'`` (default): it flows into every key
    (fractions become NaN rather than missing a NaN comparison); ``'skip'``: it is
    dropped (a sequence keeps its other tokens). Both report
    ``rollout/nonfinite_tokens`` when > 0.

    Aggregation (``loss_agg_mode``, as GRPOMetric's: verl's ``agg_loss`` modes over
    ``'token-mean'`` (default, as before), ``'seq-mean-token-mean'``, ``'seq-mean-token-sum'``
    and ``'seq-mean-token-sum-norm'`` with ``loss_agg_norm``): applies to the token-mean keys
    ``logp_abs_diff_mean``, ``is_ratio_mean``, ``is_fraction_high`` / ``_low``,
    ``mismatch_kl``, ``mismatch_k3_kl``, and the mean log-probs under ``training_ppl``,
    ``rollout_ppl`` and ``ppl_ratio`` (exp of the aggregated means). Spreads and extremes
    (``is_ratio_std``, ``_min``, ``_max``, ``logp_abs_diff_max``, ``token_ess``) and the
    sequence keys (``seq_ess``, ``log_ppl_abs_diff``) do not change. The per-sequence sums
    travel in the CP all_reduce of the sequence keys (no extra collective); these modes take
    the torch path where the fused kernel would run. The modes are verl 0.9.1's ``agg_loss``
    over the whole batch (``metrics.rl.loss_agg``).

    With GRPOMetric, put both in a ``MetricCollection``; the collection passes
    ``rollout_logps`` to this metric and ``old_logps`` / ``advantages`` to GRPO.

    Args:
        is_threshold: upper importance-weight threshold (truncated IS clips above it).
        is_threshold_low: lower threshold; None: 1 / ``is_threshold``.
        ignore_index: label value of tokens that do not count.
        nan_policy: ``'propagate'`` or ``'skip'``.
        loss_agg_mode: ``'token-mean'`` (default) or a sequence mode (see above); another value
            raises ``ValueError``.
        loss_agg_norm: the constant divisor of ``'seq-mean-token-sum-norm'``; None: each
            sequence's token capacity (its row's length).

    Example:
        >>> import torch
        >>> m = RolloutMismatchMetric(is_threshold=1.2)
        >>> _ = m.accumulate({"labels": torch.tensor([[5, 6, 7, -100]])},
        ...                  {"logps": torch.tensor([[-0.5, -1.0, -0.2, 0.0]], dtype=torch.float64)},
        ...                  rollout_logps=torch.tensor([[-0.75, -1.0, -0.1, 0.0]], dtype=torch.float64))
        >>> out = m.calculate()  # w = exp(0.25), 1, exp(-0.1): one above 1.2
        >>> round(out["rollout/is_ratio_max"], 4), round(out["rollout/is_fraction_high"], 4)
        (1.284, 0.3333)
        >>> m = RolloutMismatchMetric(is_threshold=1.2, loss_agg_mode="seq-mean-token-mean")
        >>> _ = m.accumulate({"labels": torch.tensor([[5, 6, -100], [7, -100, -100]])},
        ...                  {"logps": torch.tensor([[-0.5, -1.0, 0.0], [-0.2, 0.0, 0.0]], dtype=torch.float64)},
        ...                  rollout_logps=torch.tensor([[-0.75, -1.0, 0.0], [-0.1, 0.0, 0.0]], dtype=torch.float64))
        >>> round(m.calculate()["rollout/is_fraction_high"], 4)  # (1/2 + 0/1) / 2
        0.25

    In a training step::

        m = RolloutMismatchMetric(mesh, is_threshold=2.0)
        m.accumulate({"labels": labels}, {"logps": old_logps}, rollout_logps=vllm_logps)
        m.calculate()  # {'rollout/mismatch_kl': ..., 'rollout/seq_ess': ..., ...}
    """

    reads = Reads(keywords=("rollout_logps",), context=Reads(inputs=("labels|completion_mask",), outputs=("logps",)))
    result_keys = ('rollout/nonfinite_tokens', 'rollout/logp_abs_diff_mean', 'rollout/logp_abs_diff_max',
                   'rollout/is_ratio_mean', 'rollout/is_ratio_std', 'rollout/is_ratio_min', 'rollout/is_ratio_max',
                   'rollout/is_fraction_high', 'rollout/is_fraction_low', 'rollout/token_ess', 'rollout/mismatch_kl',
                   'rollout/mismatch_k3_kl', 'rollout/training_ppl', 'rollout/rollout_ppl', 'rollout/ppl_ratio',
                   'rollout/seq_ess', 'rollout/log_ppl_abs_diff')

    agree_over = ("cp",)  # sequence sums are completed over CP

    n_tok = State("sum", torch.int64)
    sum_abs = State("sum")
    abs_max = State("max")
    sum_d = State("sum")
    d_max = State("max")  # extremes of d: w's min/max follow (exp is monotone)
    d_min = State("min")
    sum_em = State("sum")  # sum of w - 1
    sum_em2 = State("sum")  # sum of (w - 1)^2
    n_high = State("sum")  # float: NaN under 'propagate' when a compared token is non-finite
    n_low = State("sum")
    sum_k3 = State("sum")
    sum_lp_train = State("sum")
    sum_lp_rollout = State("sum")
    n_seq = State("sum", torch.int64)
    sum_seq_abs = State("sum")
    seq_ess = State(_ess_merge, torch.float64, shape=(3,), default=0.0, local=_ess_fold)
    n_bad = State("sum", torch.int64)

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *, is_threshold: float = 2.0,
                 is_threshold_low: Optional[float] = None, ignore_index: int = -100,
                 nan_policy: str = "propagate", loss_agg_mode: str = "token-mean",
                 loss_agg_norm: Optional[float] = None, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        name = type(self).__name__
        self.loss_agg_mode, self.loss_agg_norm = check_loss_agg(name, loss_agg_mode, loss_agg_norm)
        self._per_sequence = self.loss_agg_mode != LOSS_AGG_MODES[0]
        if self._per_sequence:  # only for these modes: a token-mean metric's states are as before
            self.add_state("seq_sums", State("sum", torch.float64, shape=(len(_SEQ_SUMS),)))
            self.add_state("seq_counts", State("sum", torch.int64, shape=(1,)))
        self.nan_policy = check_nan_policy(name, nan_policy)
        low = None if is_threshold_low is None else _number(name, "is_threshold_low", is_threshold_low)
        high = _number(name, "is_threshold", is_threshold)
        if not high > 0:
            raise ValueError(f"{name}: is_threshold must be > 0, got {is_threshold!r}; pass the upper "
                             "importance-weight threshold, e.g. 2.0")
        if low is None:
            low = 1.0 / high
        if not 0 <= low <= high:
            raise ValueError(f"{name}: is_threshold_low must be in [0, is_threshold={high}], got {low!r}")
        self.is_threshold = high
        self.is_threshold_low = low
        self.ignore_index = ignore_index

    def _sequence_group(self):
        return self.sequence_group()

    def update(self, inputs: Inputs, outputs: Outputs, *, rollout_logps: SideInput = None,
               **kwargs: Any) -> Dict[str, Any]:
        name = type(self).__name__
        group = self._sequence_group()
        with exchange.guard(self):
            items = [] if rollout_logps is None else aligned_microbatches(
                name, inputs, outputs, "logps", self.ignore_index, {"rollout_logps": (rollout_logps, False)})
            items = [item for item in items if item["rollout_logps"] is not None]
            rows = sum(item["m"].shape[0] for item in items)
            if group is not None:
                low, high = exchange.agree_same(self, group, rows)
                if low != high:
                    raise ValueError(f"{name}: CP ranks hold different numbers of sequences with rollout "
                                     f"log-probs ({low} to {high}; this rank {rows}); every rank of a CP "
                                     "group must pass the same sequences; nothing was accumulated")
        # Validated and agreed: nothing below raises.
        acc: Dict[str, Any] = {}
        fused = self._fused_sums(acc, [i for i, item in enumerate(items) if self._fuses(item)], items)
        # per-sequence parts in microbatch order, whichever path made them
        parts: List[torch.Tensor] = [fused[i] if i in fused else self._token_sums(acc, item)
                                     for i, item in enumerate(items)]
        if rows:
            acc.update(self._sequence_sums(parts[0] if len(parts) == 1 else torch.cat(parts), group))
        return acc

    def _fuses(self, item) -> bool:
        """Whether this microbatch takes the one-kernel path (``kernels.triton_rollout``):
        on CUDA with the kernels enabled, and rollout log-probs given aligned ``[b, s]``
        for every counted token (the ragged forms keep the torch path)."""
        lp, m = item["x"], item["m"]
        roll, has = item["rollout_logps"]
        # the kernel makes no per-sequence table: a sequence-aggregated loss_agg_mode takes the
        # torch path (same states and values, more launches)
        return (not self._per_sequence and has is m and roll.dim() == 2 and roll.shape == lp.shape == m.shape
                and roll.device == lp.device and lp.numel() > 0 and _triton.device_ok(lp))

    def _fused_sums(self, acc, which: List[int], items) -> Dict[int, torch.Tensor]:
        """The token sums of ``items[i]`` for ``i`` in ``which`` from one kernel each, folded
        into ``acc`` once: the same states and values as ``_token_sums``. Returns
        ``{i: [b, 2] per-sequence (sum of d, tokens)}``; ``{}`` when none fuse or the
        kernel failed (nothing folded: every microbatch takes the torch path)."""
        if not which:
            return {}
        batches = [dict(lp=items[i]["x"], roll=items[i]["rollout_logps"][0], has=items[i]["m"]) for i in which]

        def launch():
            from twinkle_metrics.kernels import rollout_triton as triton_rollout
            return triton_rollout.token_stats(batches, lo=_log(self.is_threshold_low),
                                              hi=math.log(self.is_threshold), skip=self.nan_policy == "skip")

        result = _triton.attempt("rollout token statistics", launch)
        if result is None:
            return {}
        totals, rows = result
        for name, value in totals.items():  # every token state, by its declared reduction
            fold.by(acc, name, value, self.declarations[name].reduce)
        return dict(zip(which, rows))

    def _token_sums(self, acc, item) -> torch.Tensor:
        """Add one microbatch's token sums to ``acc``; return its ``[b, 2]`` per-sequence
        (sum of d, tokens), and under a sequence-aggregated loss_agg_mode the other ``_PARTS``
        columns after them."""
        lp, (roll, has) = item["x"], item["rollout_logps"]
        bad = nonfinite_tokens(lp, has, [(roll, has)])
        fold.add(acc, "n_bad", bad.sum())
        if self.nan_policy == "skip":
            has = has & ~bad
        lp, roll = lp.to(torch.float64), roll.to(torch.float64)
        # a select, not a multiply: NaN/-inf padding outside ``has`` never reaches a sum
        d = torch.where(has, lp - roll, 0.0)
        em = torch.expm1(d)
        poison = (d * 0.0).sum()  # 0, or NaN when a counted d is NaN/inf ('skip' dropped those)
        hi, lo = math.log(self.is_threshold), _log(self.is_threshold_low)
        fold.add(acc, "n_tok", has.sum())
        fold.add(acc, "sum_abs", d.abs().sum())
        fold.add(acc, "sum_d", d.sum())
        fold.add(acc, "sum_em", em.sum())
        fold.add(acc, "sum_em2", (em * em).sum())
        fold.add(acc, "sum_k3", (torch.expm1(-d) + d).sum())  # e^r - r - 1 with r = -d; 0 off ``has``
        fold.add(acc, "n_high", ((d > hi) & has).sum() + poison)
        fold.add(acc, "n_low", ((d < lo) & has).sum() + poison)
        fold.add(acc, "sum_lp_train", torch.where(has, lp, 0.0).sum())
        fold.add(acc, "sum_lp_rollout", torch.where(has, roll, 0.0).sum())
        if d.numel():
            fold.maximum(acc, "abs_max", torch.where(has, d.abs(), -math.inf).amax())
            fold.maximum(acc, "d_max", torch.where(has, d, -math.inf).amax())
            fold.minimum(acc, "d_min", torch.where(has, d, math.inf).amin())
        cols = [d.sum(1), has.sum(1, dtype=torch.float64)]
        if self._per_sequence:
            row_poison = (d * 0.0).sum(1)
            cols += [d.abs().sum(1), em.sum(1), ((d > hi) & has).sum(1) + row_poison,
                     ((d < lo) & has).sum(1) + row_poison, (torch.expm1(-d) + d).sum(1),
                     torch.where(has, lp, 0.0).sum(1), torch.where(has, roll, 0.0).sum(1),
                     torch.full_like(cols[1], float(has.shape[1]))]
        return torch.stack(cols, 1)

    def _sequence_sums(self, parts: torch.Tensor, group) -> Dict[str, Any]:
        """Sequence statistics from per-sequence (sum of d, tokens), completed over CP, and the
        sums of a sequence-aggregated loss_agg_mode from the columns after them."""
        parts = cp_sum(parts, group)
        if group is not None and group_rank(group) != 0:
            return {}  # every CP rank holds the same totals now; count each sequence once
        out: Dict[str, Any] = {}
        if parts.shape[1] > 2:  # a sequence-aggregated loss_agg_mode's columns
            values, seqs = sequence_table(parts[:, list(_SEQ_COLUMNS)], parts[:, 1:2], parts[:, -1],
                                          (0,) * len(_SEQ_SUMS), self.loss_agg_mode, self.loss_agg_norm)
            out = {"seq_sums": values, "seq_counts": seqs}
            parts = parts[:, :2]
        elif _triton.device_ok(parts) and parts.dtype == torch.float64:
            fused = _triton.attempt("rollout sequence statistics", _sequence_stats, parts)
            if fused is not None:  # one kernel
                return fused
        s, n = parts[:, 0], parts[:, 1]
        valid = n > 0
        top = torch.where(valid, s, -math.inf).amax()
        e = torch.where(valid, torch.exp(s - top), 0.0)
        a = e.sum()
        ess = torch.stack([torch.where(a != 0, top, 0.0), a, (e * e).sum()])
        mean_d = s / torch.where(valid, n, 1.0)
        out.update({"n_seq": valid.sum(), "sum_seq_abs": torch.where(valid, mean_d.abs(), 0.0).sum(),
                    "seq_ess": ess})
        return out

    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {"rollout/nonfinite_tokens": int(s["n_bad"])} if s["n_bad"] else {}
        n = s["n_tok"]
        if n:
            s1, s2 = s["sum_em"], s["sum_em2"]
            spread = n * s2 - s1 * s1  # n^2 Var(w), from w - 1: no cancellation of the 1s
            # mean(total): the token mean s[total] / n_tok, or under a sequence loss_agg_mode the
            # mean over sequences of each one's value (``loss_agg``)
            per_seq = self._per_sequence
            sums = dict(zip(_SEQ_SUMS, s["seq_sums"])) if per_seq else s
            seqs = s["seq_counts"][0] if per_seq else n

            def mean(total):
                return sequence_mean(sums[total], seqs) if per_seq else s[total] / n

            mean_train, mean_rollout = mean("sum_lp_train"), mean("sum_lp_rollout")
            out["rollout/logp_abs_diff_mean"] = mean("sum_abs")
            out["rollout/logp_abs_diff_max"] = s["abs_max"]
            out["rollout/is_ratio_mean"] = (  # w = (w - 1) + 1
                sequence_mean(sums["sum_em"] + sums["n_tok"], seqs) if per_seq else 1.0 + s1 / n)
            out["rollout/is_ratio_std"] = (max(spread, 0.0) ** 0.5) / n  # max(NaN, 0) is NaN
            out["rollout/is_ratio_min"] = _exp(s["d_min"])
            out["rollout/is_ratio_max"] = _exp(s["d_max"])
            out["rollout/is_fraction_high"] = mean("n_high")
            out["rollout/is_fraction_low"] = mean("n_low")
            out["rollout/token_ess"] = 1.0 - spread / (n * (n + 2 * s1 + s2))
            out["rollout/mismatch_kl"] = -mean("sum_d")
            out["rollout/mismatch_k3_kl"] = mean("sum_k3")
            out["rollout/training_ppl"] = _exp(-mean_train)
            out["rollout/rollout_ppl"] = _exp(-mean_rollout)
            out["rollout/ppl_ratio"] = _exp(mean_rollout - mean_train)
        if s["n_seq"]:
            _, a, b = s["seq_ess"]
            out["rollout/seq_ess"] = a * a / (s["n_seq"] * b)
            out["rollout/log_ppl_abs_diff"] = s["sum_seq_abs"] / s["n_seq"]
        return out


def _sequence_stats(parts: torch.Tensor) -> Dict[str, torch.Tensor]:
    from twinkle_metrics.kernels import rollout_triton as triton_rollout
    return triton_rollout.sequence_stats(parts)


def _number(metric, field, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{metric}: {field} must be a number, got {type(value).__name__}")
    return float(value)


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
