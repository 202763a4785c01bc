"""``StalenessMetric``: how many policy versions behind the trainer the rollouts it trains on are."""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from parallel import MeshLike, comm_device, group_rank
from parallel.groups import ProcessGroup, all_gather_rows
from twinkle_metrics.comm import agreement as exchange
from twinkle_metrics.core import fold
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import from_host
from twinkle_metrics.inputs.data_format import Inputs, Outputs, SideInput
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.inputs.microbatch import as_feature_list, batch_size, host_array
from twinkle_metrics.inputs.rl import token_mask
from twinkle_metrics.stats.histogram import Histogram, check_quantiles, quantile_suffix

_NAME = "StalenessMetric"
_FIELD = "rollout_versions"
#: staleness in versions: 0 has its own bucket, [1, 65536) within 1% (exact below 50 once rounded)
STALENESS_HISTOGRAM = Histogram(1.0, 2.0 ** 16, rel_error=0.01, signed=False)
_TOP = 2 ** 16  # staleness above counts as this
_HIST = "hist"
_TABLES: Dict[torch.device, torch.Tensor] = {}
_BIG = torch.iinfo(torch.int64).max


class StalenessMetric(Metric):
    """Policy staleness of the tokens trained on (asynchronous / off-policy RL).

    ``accumulate(inputs, outputs, policy_version=p, rollout_versions=v)``: ``p`` is the
    trainer's current policy version (an int); ``v`` the behaviour-policy version that
    sampled each sequence (a list of ints or an integer ``[batch]`` tensor) or each token
    (an integer ``[batch, seq]`` tensor shaped like the labels, for partial rollouts that
    span weight updates). The staleness of a token is ``p - v``; tokens count where
    ``completion_mask`` is set, else where ``labels != ignore_index`` (as every token
    metric). ``inputs`` may be a list of ``InputFeature`` (pipeline microbatches): then
    ``v`` covers their concatenated sequences (or is a list of one tensor per
    microbatch). ``outputs`` is not read. ``inputs=[]`` (a pipeline stage without the
    loss) counts nothing, whatever ``v`` is.

    Keys (over the whole data group and every call of the interval):

    * ``staleness/mean``: token-weighted mean staleness;
    * ``staleness/seq_mean``: mean over sequences of each sequence's staleness (with
      per-token versions, the mean over the sequence's counted tokens); a sequence
      with no counted token does not count;
    * ``staleness/min``, ``staleness/max``: over counted tokens;
    * ``staleness/p50``, ``staleness/p90``, ``staleness/p99`` (``quantiles``):
      token-weighted nearest-rank quantiles from a merged histogram
      (``twinkle_metrics.stats.histogram``), rounded to whole versions: exact for
      staleness below 50, within 1% above (counted as 65536 above 65536);
    * ``staleness/frac_over_{n}`` with ``max_staleness=n``: fraction of counted tokens
      with staleness > n;
    * ``staleness/span_max``: the largest ``max - min`` of the versions inside one
      sequence (over its counted tokens); only once per-token versions were passed in
      the interval, on some rank: its state defaults to -1 and merges by max, so every
      rank reports the same keys;
    * ``staleness/in_flight_max``, ``staleness/queued_max``: the largest ``in_flight=``
      / ``queued=`` reading (host numbers, e.g. rollouts in flight) over the calls and
      every rank of the mesh; only when passed.

    Nothing counted gives only the reading keys (or ``{}``).

    Context parallelism: each CP rank holds a slice of each sequence's tokens. Token
    sums add over DP x CP; the per-sequence totals (staleness sum, tokens, version
    max and min) are completed over the CP group in ``accumulate`` (one host-side
    agreement on the number of sequences and one ``all_gather`` of ``[sequences, 4]``
    per call, as ``RolloutMismatchMetric``; every CP rank must call it alike), then
    counted on CP rank 0 only, so results equal one process holding whole sequences.

    Bad input: lengths and shapes are checked on the host (``rollout_versions`` with
    another number of sequences than the batch, per-token versions not shaped like the
    labels, non-integer versions) and raise ``ValueError`` / ``TypeError`` in
    ``accumulate``, which then changes no state. Negative staleness (a version newer
    than ``policy_version``): host lists are checked in ``accumulate`` (every sequence,
    counted or not); tensors are not read there (no device wait), their counted
    negative tokens are counted in a state and ``calculate()`` raises ``ValueError`` on
    every rank, keeping the interval's states: ``reset()`` the metric then.

    Args:
        max_staleness: report ``staleness/frac_over_{max_staleness}`` (an int >= 0).
        quantiles: token-weighted quantiles to report, in (0, 1); None: none.
        ignore_index: label value of tokens that do not count.

    Example:
        >>> import torch
        >>> m = StalenessMetric(max_staleness=1)
        >>> labels = torch.tensor([[5, 6, -100], [7, 8, 9]])
        >>> _ = m.accumulate({"labels": labels}, None, policy_version=10, rollout_versions=[9, 7])
        >>> out = m.calculate()  # staleness 1, 1 and 3, 3, 3
        >>> out["staleness/mean"], out["staleness/seq_mean"], out["staleness/max"], out["staleness/frac_over_1"]
        (2.2, 2.0, 3, 0.6)
        >>> versions = torch.tensor([[8, 9, 0], [9, 9, 10]])  # per token: a rollout that spans updates
        >>> _ = m.accumulate({"labels": labels}, None, policy_version=10, rollout_versions=versions, in_flight=4)
        >>> out = m.calculate()
        >>> out["staleness/span_max"], out["staleness/p50"], out["staleness/in_flight_max"]
        (1, 1, 4)
    """

    reads = Reads(keywords=("rollout_versions",),
                  context=Reads(inputs=("labels|completion_mask",), keywords=("policy_version",)))
    result_keys = ('staleness/mean', 'staleness/seq_mean', 'staleness/min', 'staleness/max', 'staleness/p*',
                   'staleness/frac_over_{max_staleness}', 'staleness/span_max', 'staleness/in_flight_max',
                   'staleness/queued_max')

    agree_over = ("cp",)  # per-sequence totals are completed over CP
    # the generic split hands per-call numbers (policy_version) to the whole call only
    unsliceable = "policy_version is one number per call, which the per-slice calls do not receive"

    n_tok = State("sum", torch.int64)
    sum_st = State("sum", torch.int64)
    st_min = State("min", torch.int64)
    st_max = State("max", torch.int64)
    n_over = State("sum", torch.int64)
    n_neg = State("sum", torch.int64)  # counted tokens of tensor versions newer than the policy
    n_seq = State("sum", torch.int64)
    sum_seq = State("sum")  # sum over sequences of their mean staleness
    span_max = State("max", torch.int64, default=-1)  # -1: no per-token versions seen
    in_flight = State("max", scope="model")
    queued = State("max", scope="model")

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *,
                 max_staleness: Optional[int] = None, quantiles: Optional[Sequence[float]] = (0.5, 0.9, 0.99),
                 ignore_index: int = -100, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, Integral)
                                          or max_staleness < 0):
            raise ValueError(f"{_NAME}: max_staleness must be an int >= 0 or None, got {max_staleness!r}")
        self.max_staleness = None if max_staleness is None else int(max_staleness)
        self.quantiles = check_quantiles(_NAME, quantiles)
        if self.quantiles:
            self.add_state(_HIST, STALENESS_HISTOGRAM.state())
        self.ignore_index = ignore_index

    # ----------------------------------------------------------------- update
    def update(self, inputs: Inputs, outputs: Outputs, *, policy_version: Union[int, torch.Tensor, None] = None,
               rollout_versions: SideInput = None, in_flight: Union[float, torch.Tensor, None] = None,
               queued: Union[float, torch.Tensor, None] = None, **kwargs: Any) -> Dict[str, Any]:
        group = self.sequence_group()
        with exchange.guard(self):
            out: Dict[str, Any] = {}
            for key, field, value in (("in_flight", "in_flight", in_flight), ("queued", "queued", queued)):
                if value is not None:
                    out[key] = _reading(field, value)
            items = self._items(inputs, policy_version, rollout_versions)
            rows = sum(m.shape[0] for m, _, _ in items)
            per_token = any(tok for _, _, tok in items)
            if group is not None:
                low, high = exchange.agree_same(self, group, 2 * rows + per_token)
                if low != high:
                    raise ValueError(f"{_NAME}: CP ranks hold different sequences for {_FIELD} ({low // 2} to "
                                     f"{high // 2} sequences, per-token versions on some ranks only: "
                                     f"{low % 2 != high % 2}; this rank {rows}); every rank of a CP group must "
                                     "pass the same sequences, sliced alike; nothing was accumulated")
        # Validated and agreed: nothing below raises.
        if not rows:
            return out
        parts = [self._tokens(out, m, st, tok) for m, st, tok in items]
        out.update(self._sequences(torch.cat(parts) if len(parts) > 1 else parts[0], group, per_token))
        return out

    def _items(self, inputs, policy_version, versions) -> List[Tuple[torch.Tensor, torch.Tensor, bool]]:
        """``(mask [b, s], staleness [b, 1] or [b, s] int64, per_token)`` per microbatch,
        validated on the host; ``[]`` when there is nothing to count."""
        if versions is None:
            return []
        feats = as_feature_list(_NAME, inputs)
        if inputs is None:
            raise ValueError(f"{_NAME}: {_FIELD} given but inputs is None; staleness is counted over tokens: "
                             "pass the InputFeature (or list of them) with labels or completion_mask")
        if not feats:
            return []  # a pipeline stage without the loss: nothing to count
        if isinstance(policy_version, bool) or not isinstance(policy_version, Integral):
            raise TypeError(f"{_NAME}: policy_version must be an int (the trainer's current policy version), "
                            f"got {type(policy_version).__name__}")
        p = int(policy_version)
        sizes = [batch_size(_NAME, f) for f in feats]
        entries = _split(versions, sizes)
        items = []
        for i, (feat, entry) in enumerate(zip(feats, entries)):
            where = _FIELD if len(feats) == 1 else f"{_FIELD} of microbatch {i}"
            raw = feat.get("completion_mask") if feat.get("completion_mask") is not None else feat.get("labels")
            shape = None if raw is None else list(host_array(_NAME, "labels", raw).shape)
            device = entry.device if isinstance(entry, torch.Tensor) else None
            m = token_mask(_NAME, feat, self.ignore_index, device)
            b, s = m.shape
            if isinstance(entry, torch.Tensor):
                if entry.dtype == torch.bool or entry.is_floating_point() or entry.is_complex():
                    raise TypeError(f"{_NAME}: {where} must hold integer versions, got a {entry.dtype} tensor; "
                                    "pass policy version numbers as an integer tensor")
                v = entry.detach()
                if v.dim() == 1 and v.shape[0] == b and not (b == 1 and list(v.shape) == shape and s != 1):
                    items.append((m, (p - v.to(torch.int64))[:, None], False))
                elif list(v.shape) == shape:  # per token, shaped like the labels
                    items.append((m, p - v.to(torch.int64).reshape(b, s), True))
                else:
                    raise ValueError(f"{_NAME}: {where} has shape {list(v.shape)} but the microbatch has {b} "
                                     f"sequences with labels {shape}; expected [{b}] (one version per sequence) "
                                     f"or {shape} (one per token)")
                continue
            if len(entry) != b:
                raise ValueError(f"{_NAME}: {where} has {len(entry)} versions but the microbatch has {b} "
                                 f"sequences; expected {b}, one version per sequence")
            newer = [j for j, x in enumerate(entry) if x > p]
            if newer:
                raise ValueError(f"{_NAME}: {where} holds version {entry[newer[0]]} (sequence {newer[0]}), newer "
                                 f"than policy_version={p}: negative staleness; pass the version of the policy "
                                 "that sampled each sequence (<= policy_version)")
            st = from_host(torch.tensor([p - x for x in entry], dtype=torch.int64), m.device)
            items.append((m, st[:, None], False))
        return items

    def _tokens(self, out: Dict[str, Any], m: torch.Tensor, st: torch.Tensor, per_token: bool) -> torch.Tensor:
        """Fold one microbatch's token statistics into ``out``; return its ``[b, 4]``
        float64 per-sequence (staleness sum, tokens, version max, version min) where the
        version is ``-staleness`` (the span is the same)."""
        n_row = m.sum(1)
        counted = n_row > 0
        if per_token:
            keep = torch.where(m, st, 0)
            fold.add(out, "sum_st", keep.sum())
            lo = torch.where(m, st, _BIG).amin(1)
            hi = torch.where(m, st, -_BIG).amax(1)
            fold.add(out, "n_neg", (m & (st < 0)).sum())
            if self.max_staleness is not None:
                fold.add(out, "n_over", (m & (st > self.max_staleness)).sum())
            if self.quantiles:
                weights = m.view(torch.uint8).to(torch.int64).reshape(-1)
                hist = torch.zeros(STALENESS_HISTOGRAM.n_buckets, dtype=torch.int64, device=st.device)
                fold.add(out, _HIST, hist.index_add_(0, _buckets(st).reshape(-1), weights))
            row_sum = keep.sum(1)
        else:  # one value per sequence: row-wise, weighted by the sequence's tokens
            st = st[:, 0]
            row_sum = st * n_row
            fold.add(out, "sum_st", row_sum.sum())
            lo = hi = st
            fold.add(out, "n_neg", torch.where(st < 0, n_row, 0).sum())
            if self.max_staleness is not None:
                fold.add(out, "n_over", torch.where(st > self.max_staleness, n_row, 0).sum())
            if self.quantiles:
                idx = _buckets(st)
                hist = torch.zeros(STALENESS_HISTOGRAM.n_buckets, dtype=torch.int64, device=st.device)
                fold.add(out, _HIST, hist.index_add_(0, idx, n_row))
        fold.add(out, "n_tok", n_row.sum())
        if lo.numel():
            fold.minimum(out, "st_min", torch.where(counted, lo, _BIG).amin())
            fold.maximum(out, "st_max", torch.where(counted, hi, -_BIG).amax())
        inf = torch.tensor(math.inf, dtype=torch.float64, device=m.device)
        # versions are -staleness (up to the policy version): their max is -min staleness
        vmax = torch.where(counted, -lo.to(torch.float64), -inf)
        vmin = torch.where(counted, -hi.to(torch.float64), inf)
        return torch.stack([row_sum.to(torch.float64), n_row.to(torch.float64), vmax, vmin], 1)

    def _sequences(self, parts: torch.Tensor, group, per_token: bool) -> Dict[str, Any]:
        """Sequence statistics from per-sequence totals, completed over CP."""
        if group is not None:
            dev = comm_device(group)
            rows = all_gather_rows(parts.to(dev, non_blocking=True).reshape(-1), group)
            rows = rows.view(rows.shape[0], *parts.shape).to(parts.device, non_blocking=True)
            parts = torch.cat([rows[..., :2].sum(0), rows[..., 2:3].amax(0), rows[..., 3:].amin(0)], 1)
            if group_rank(group) != 0:
                return {}  # every CP rank holds the same totals now; count each sequence once
        total, n, vmax, vmin = parts.unbind(1)
        valid = n > 0
        out = {"n_seq": valid.sum(), "sum_seq": torch.where(valid, total / torch.where(valid, n, 1.0), 0.0).sum()}
        if per_token:
            out["span_max"] = torch.where(valid, vmax - vmin, -1.0).amax().to(torch.int64)
        return out

    # ---------------------------------------------------------------- compute
    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        if s["n_neg"]:
            raise ValueError(f"{_NAME}: {_FIELD} gave {int(s['n_neg'])} counted tokens a version newer than "
                             "policy_version in this interval (negative staleness); pass the version of the "
                             "policy that sampled each token (<= policy_version), then reset() this metric")
        out: Dict[str, Any] = {}
        n = s["n_tok"]
        if n:
            out["staleness/mean"] = s["sum_st"] / n
            if s["n_seq"]:
                out["staleness/seq_mean"] = s["sum_seq"] / s["n_seq"]
            out["staleness/min"] = int(s["st_min"])
            out["staleness/max"] = int(s["st_max"])
            if self.quantiles:
                values = STALENESS_HISTOGRAM.quantiles(s[_HIST], self.quantiles)
                out.update({f"staleness/{quantile_suffix(q)}": int(round(v)) for q, v in zip(self.quantiles, values)})
            if self.max_staleness is not None:
                out[f"staleness/frac_over_{self.max_staleness}"] = s["n_over"] / n
        if s["span_max"] >= 0:
            out["staleness/span_max"] = int(s["span_max"])
        if s["in_flight"] != -math.inf:
            out["staleness/in_flight_max"] = _whole(s["in_flight"])
        if s["queued"] != -math.inf:
            out["staleness/queued_max"] = _whole(s["queued"])
        return out


def _whole(v: float):
    """A reported count as an int where it is one (NaN and inf stay floats)."""
    return int(v) if math.isfinite(v) and float(v).is_integer() else v


def _buckets(st: torch.Tensor) -> torch.Tensor:
    """``STALENESS_HISTOGRAM.index`` of integer staleness by table lookup (one gather instead
    of the float64 log path): the table holds the bucket of every integer in [0, 65536]."""
    table = _TABLES.get(st.device)
    if table is None:
        # built where it is used: no host-to-device copy
        table = STALENESS_HISTOGRAM.index(torch.arange(_TOP + 1, dtype=torch.float64, device=st.device))
        _TABLES[st.device] = table
    return table[st.clamp(0, _TOP)]


def _reading(field: str, value):
    """An ``in_flight`` / ``queued`` reading: a real number or a one-element real tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{_NAME}: {field} must be one number, got a {value.dtype} tensor of shape "
                            f"{list(value.shape)}")
        return value.detach().reshape(()).to(torch.float64)
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{_NAME}: {field} must be a number (a host reading, e.g. rollouts in flight), got "
                        f"{type(value).__name__}")
    return float(value)


def _split(versions, sizes: List[int]) -> List[Any]:
    """``rollout_versions`` as one entry per microbatch: a tensor (``[b]`` or ``[b, s]``) or a
    list of ints. Accepts one tensor over the concatenated sequences, one list of ints (one per
    sequence), or a list with one tensor / list of ints per microbatch."""
    total, n_micro = sum(sizes), len(sizes)
    if isinstance(versions, torch.Tensor):
        if versions.dim() == 0 or versions.dim() > 2:
            raise ValueError(f"{_NAME}: {_FIELD} has shape {list(versions.shape)}; expected [{total}] (one "
                             f"version per sequence) or [{total}, seq] (one per token)")
        if n_micro == 1:
            return [versions]
        if versions.shape[0] != total:
            raise ValueError(f"{_NAME}: {_FIELD} has shape {list(versions.shape)} but the {n_micro} microbatches "
                             f"hold {total} sequences ({sizes}); expected dim 0 = {total}")
        return list(torch.split(versions, sizes, dim=0))
    if not isinstance(versions, (list, tuple)):
        raise TypeError(f"{_NAME}: {_FIELD} must be a list of ints or an integer tensor, got "
                        f"{type(versions).__name__}")
    if all(_is_int(x) for x in versions):
        if len(versions) != total:
            raise ValueError(f"{_NAME}: {_FIELD} has {len(versions)} versions but the batch has {total} "
                             f"sequences ({sizes} per microbatch); expected {total}, one per sequence")
        out: List[Any] = []
        start = 0
        for n in sizes:
            out.append([int(x) for x in versions[start:start + n]])
            start += n
        return out
    if len(versions) == n_micro and all(isinstance(x, (torch.Tensor, list, tuple)) for x in versions):
        out = []
        for i, x in enumerate(versions):
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif all(_is_int(y) for y in x):
                out.append([int(y) for y in x])
            else:
                raise TypeError(f"{_NAME}: {_FIELD}[{i}] must be a list of ints or an integer tensor")
        return out
    bad = next((x for x in versions if not _is_int(x)), None)
    raise TypeError(f"{_NAME}: {_FIELD} must hold one int per sequence ({total}), or one tensor / list per "
                    f"microbatch ({n_micro}); got a {type(bad).__name__} among {len(versions)} entries")


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)
