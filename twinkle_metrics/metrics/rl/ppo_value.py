"""``PPOValueMetric``: PPO critic statistics (Twinkle's keys), exact over the data group."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import torch

from parallel import MeshLike
from parallel.groups import ProcessGroup
from twinkle_metrics.core import fold
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import nan_policy as check_nan_policy
from twinkle_metrics.inputs.data_format import Inputs, Outputs, SideInput
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.inputs.microbatch import has_field
from twinkle_metrics.inputs.rl import aligned_microbatches, joined_microbatches, nonfinite_tokens
from twinkle_metrics.kernels import dispatch as _triton
from twinkle_metrics.stats.moments import chan, moments, moments_state

_SIDES = ("old_values", "returns", "advantages")


class PPOValueMetric(Metric):
    """Value-head statistics of PPO over valid tokens (Twinkle's keys).

    Tokens count where ``completion_mask`` is set, else where ``labels !=
    ignore_index``. With ``v = outputs['values']``:

    * ``train/value_mean``: mean v;
    * with ``old_values``: ``train/value_clip_ratio``, the fraction of tokens with
      ``|v - v_old| > epsilon`` (those the clipped value loss clips);
    * with ``returns`` R: ``train/return_mean`` and ``train/explained_variance``
      = 1 - Var(R - v) / max(Var(R), 1e-8), population variances;
    * with ``advantages``: ``train/advantage_mean`` and ``train/advantage_std``
      (population).

    A call without ``outputs['values']``, ``old_values`` and ``returns`` adds
    nothing (a policy step of a shared ``MetricCollection``); values are required
    whenever old values or returns are given.

    Each statistic counts the tokens that have its inputs (a ragged side input
    shorter than a sequence's valid tokens leaves the rest out). Twinkle skips a
    call that lacks ``old_values`` or ``returns``; here every key that the given
    inputs define is reported.

    Side inputs (``old_values``, ``returns``, ``advantages``) take the forms of
    GRPOMetric's side inputs: a ``[N, s]`` tensor aligned to the concatenated batch,
    a list per microbatch, or a list per sequence of that sequence's valid-token
    values (Twinkle's ragged form); one number per sequence (``[N]``, ``[N, 1]``, or
    a number in the per-sequence list) holds for each of its tokens.

    Exact over any layout: means and variances are (count, mean, M2) moments in
    float64 merged with Chan's formula (``twinkle_metrics.stats.moments``), the clip count
    is a sum; nothing is gathered. Under CP each rank holds disjoint tokens, so the
    DP x CP reduction counts each token once with no collective in ``accumulate``.
    Twinkle gathers every value as Python floats and computes in float32.

    Non-finite values (``nan_policy``): a counted token whose v, old value, return or
    advantage is NaN/inf. ``'propagate'`` (default): it flows into every key it feeds
    (the clip ratio becomes NaN rather than missing a NaN comparison). ``'skip'``: the
    token is dropped from every statistic. Both report ``train/nonfinite_tokens``
    when > 0.

    Args:
        epsilon: value clip range.
        ignore_index: label value of tokens that do not count.
        nan_policy: ``'propagate'`` or ``'skip'``.

    Example:
        >>> import torch
        >>> m = PPOValueMetric(epsilon=0.2)
        >>> _ = m.accumulate({"labels": torch.tensor([[5, 6, 7, -100]])},
        ...                  {"values": torch.tensor([[1.0, 0.5, 0.25, 9.0]], dtype=torch.float64)},
        ...                  old_values=torch.tensor([[0.5, 0.5, 0.25, 0.0]], dtype=torch.float64),
        ...                  returns=torch.tensor([[1.0, 0.75, 0.0, 0.0]], dtype=torch.float64))
        >>> {k: round(v, 4) for k, v in m.calculate().items()}  # doctest: +NORMALIZE_WHITESPACE
        {'train/value_mean': 0.5833, 'train/value_clip_ratio': 0.3333, 'train/return_mean': 0.5833,
         'train/explained_variance': 0.7692}

    In a training step::

        m = PPOValueMetric(mesh, epsilon=0.2)
        m.accumulate({"labels": labels}, {"values": values},
                     old_values=old_values, returns=returns, advantages=advantages)
        m.calculate()  # {'train/value_mean': ..., 'train/explained_variance': ..., ...}
    """

    reads = Reads(outputs=("values",), keywords=("old_values?", "returns?"),
                  context=Reads(inputs=("labels|completion_mask",), keywords=("advantages?",)))
    result_keys = ('train/value_mean', 'train/return_mean', 'train/value_clip_ratio', 'train/explained_variance',
                  'train/advantage_mean', 'train/advantage_std', 'train/nonfinite_tokens',)

    n_tok = State("sum", torch.int64)
    sum_value = State("sum")
    n_old = State("sum", torch.int64)
    clipped = State("sum")  # float: NaN under 'propagate' when a compared token is non-finite
    ret_moments = moments_state()  # (n, mean, M2) of R
    res_moments = moments_state()  # (n, mean, M2) of R - v, over the same tokens
    adv_moments = moments_state()
    n_bad = State("sum", torch.int64)

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None,
                 epsilon: float = 0.2, ignore_index: int = -100, *, nan_policy: str = "propagate",
                 **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        name = type(self).__name__
        self.nan_policy = check_nan_policy(name, nan_policy)
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon >= 0:
            raise ValueError(f"{name}: epsilon (the value clip range) must be a number >= 0, got {epsilon!r}")
        self.epsilon = float(epsilon)
        self.ignore_index = ignore_index

    def update(self, inputs: Inputs, outputs: Outputs, *, old_values: SideInput = None, returns: SideInput = None,
               advantages: SideInput = None, **kwargs: Any) -> Dict[str, Any]:
        if old_values is None and returns is None and not has_field(outputs, "values"):
            # a call for other metrics of a collection (a policy step sharing advantages)
            return {}
        items = aligned_microbatches(type(self).__name__, inputs, outputs, "values", self.ignore_index,
                                     {"old_values": (old_values, True), "returns": (returns, True),
                                      "advantages": (advantages, True)})
        fused = self._fused(items)
        if fused is not None:  # two kernels for every state, whatever the microbatches
            return fused
        items = joined_microbatches(items, _SIDES)  # one pass of launches for every microbatch
        acc: Dict[str, Any] = {}
        rows: Dict[str, List[torch.Tensor]] = {"ret_moments": [], "res_moments": [], "adv_moments": []}
        skip = self.nan_policy == "skip"
        for item in items:
            v, m = item["x"], item["m"]
            sides = {k: item[k] for k in _SIDES if item[k] is not None}
            bad = nonfinite_tokens(v, m, list(sides.values()))
            fold.add(acc, "n_bad", bad.sum())
            if skip:  # drop those tokens from every mask
                ok = ~bad
                m = m & ok
                sides = {k: (x, has & ok) for k, (x, has) in sides.items()}
            v = v.to(torch.float64)
            fold.add(acc, "n_tok", m.sum())
            fold.add(acc, "sum_value", torch.where(m, v, 0.0).sum())
            if "old_values" in sides:
                old, has = sides["old_values"]
                d = v - old.to(torch.float64)
                hit = (d.abs() > self.epsilon).to(torch.float64)
                if not skip:
                    hit = hit + d * 0.0  # NaN where d is NaN/inf: a NaN comparison must not vanish
                fold.add(acc, "n_old", has.sum())
                fold.add(acc, "clipped", torch.where(has, hit, 0.0).sum())
            if "returns" in sides:
                ret, has = sides["returns"]
                ret = ret.to(torch.float64)
                rows["ret_moments"].append(moments(ret, has))
                rows["res_moments"].append(moments(ret - v, has))
            if "advantages" in sides:
                adv, has = sides["advantages"]
                rows["adv_moments"].append(moments(adv, has))
        for key, parts in rows.items():
            if parts:
                acc[key] = parts[0] if len(parts) == 1 else chan(torch.stack(parts))
        return acc

    def _fused(self, items) -> Optional[Dict[str, Any]]:
        """The contributions from ``kernels.triton_ppo`` (on CUDA with the kernels enabled,
        every microbatch on one device, side inputs ``[b, s]`` or one per sequence), or None
        for the torch path."""
        if not (items and any(item["m"].numel() for item in items) and _triton.device_ok(items[0]["x"])):
            return None
        device = items[0]["x"].device
        if not all(item["x"].device == device and all(item[k] is None or _fits(item["x"], item["m"], item[k])
                                                      for k in _SIDES) for item in items):
            return None
        return _triton.attempt("PPO value statistics", _token_stats, items, epsilon=self.epsilon,
                               skip=self.nan_policy == "skip")

    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {"train/nonfinite_tokens": int(s["n_bad"])} if s["n_bad"] else {}
        if s["n_tok"]:
            out["train/value_mean"] = s["sum_value"] / s["n_tok"]
        if s["n_old"]:
            out["train/value_clip_ratio"] = s["clipped"] / s["n_old"]
        n, mean, m2 = s["ret_moments"]
        if n:
            out["train/return_mean"] = mean
            var_r = m2 / n
            floor = var_r if (var_r != var_r or var_r > 1e-8) else 1e-8  # NaN stays NaN
            out["train/explained_variance"] = 1.0 - (s["res_moments"][2] / n) / floor
        n, mean, m2 = s["adv_moments"]
        if n:
            out["train/advantage_mean"] = mean
            out["train/advantage_std"] = (max(m2, 0.0) / n) ** 0.5  # max(NaN, 0) is NaN
        return out


def _fits(v: torch.Tensor, m: torch.Tensor, side) -> bool:
    """Whether the kernel reads a side input ``(values, has)`` as it is: ``[b, s]`` or ``[b, 1]``
    values on ``v``'s device and a ``[b, s]`` mask (a ragged input's shorter mask keeps the
    torch path)."""
    x, has = side
    b, s = m.shape
    return (x.dim() == 2 and x.shape[0] == b and x.shape[1] in (1, s) and tuple(has.shape) == (b, s)
            and x.device == v.device)


def _token_stats(items, **kwargs) -> Dict[str, torch.Tensor]:
    from twinkle_metrics.kernels import ppo_triton as triton_ppo
    return triton_ppo.token_stats(items, **kwargs)
