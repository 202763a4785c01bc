"""The policy family's columns, declared once, and the configuration of one metric.

``COLUMNS`` is the one table of states: each row a state's name, reduction and dtype, whether
the fused kernel fills it (``kernels.rl_triton`` names its columns after these states, in this
order) and the setting that creates it. A column has one name everywhere: the state, the
kernel's column, the per-sequence column of a sequence ``loss_agg_mode`` (``SEQ_SUMS``,
``SEQ_COUNTS``) and the row the torch path sums into. What each result key divides is written
in ``GRPOMetric.compute``, one line per key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple

import torch

from twinkle_metrics.core.state import State
from twinkle_metrics.metrics.rl.loss_agg import LOSS_AGG_MODES, sequence_mean
from twinkle_metrics.stats.histogram import Histogram

I64, F64 = torch.int64, torch.float64


class Column(NamedTuple):
    """One state of the family."""

    name: str
    reduce: str                # "sum", "max" or "min"
    dtype: torch.dtype
    fused: bool = True         # the fused kernel fills it (False: the torch path only)
    when: Optional[str] = None  # the setting that creates it (None: always there)


COLUMNS = (
    Column("n_tok", "sum", I64),         # counted tokens
    Column("sum_new", "sum", F64),       # logp
    Column("n_old", "sum", I64),         # tokens with an old log-prob
    Column("sum_old", "sum", F64),       # old logp
    Column("sum_diff", "sum", F64),      # d = logp - old logp
    Column("sum_kl", "sum", F64),        # k3 = r - 1 - d, r = e^d
    Column("sum_ratio", "sum", F64),     # r
    # extremes of d: the ratio's and k3's follow in compute (exp is monotone, k3 convex)
    Column("logr_max", "max", F64),
    Column("logr_min", "min", F64),
    Column("n_ent", "sum", I64),         # tokens with an entropy
    Column("sum_ent", "sum", F64),       # entropy
    Column("clip_n", "sum", I64),        # tokens (GSPO: sequences) with an old log-prob and an advantage
    Column("clip_low", "sum", I64),      # of those, clipped low
    Column("clip_high", "sum", I64),     # clipped high
    Column("n_adv", "sum", I64),         # tokens with an advantage
    Column("sum_adv", "sum", F64),       # advantage
    Column("adv_min", "min", F64),
    Column("adv_max", "max", F64),
    Column("n_ref", "sum", I64),         # tokens with a reference log-prob
    Column("sum_ref_kl", "sum", F64),    # k3 of KL(pi || ref)
    Column("n_bad", "sum", I64),         # non-finite tokens
    # 0, or NaN when a clip-gated token held NaN/inf ('propagate'): added to every clip key
    Column("clip_nan", "sum", F64),
    # verl's extra clip keys (token-weighted whatever the mode): the torch path only
    Column("clip_dual", "sum", I64, False, when="clip_ratio_c"),   # dual-clipped tokens, of clip_n
    Column("clip_tok", "sum", I64, False, when="token_counts"),    # GSPO: tokens of clipped sequences
    Column("clip_tok_n", "sum", I64, False, when="token_counts"),  # GSPO: tokens with a clip gate
)
#: what the fused kernel fills: (state, reduction, dtype) in table order
KERNEL_COLUMNS = tuple((c.name, c.reduce, c.dtype) for c in COLUMNS if c.fused)

#: the per-sequence columns of a sequence ``loss_agg_mode``, in the order of the ``seq_sums``
#: state: each a token sum and the count it is a mean over. ``sum_ratio`` is kept as its two
#: parts, the sums of r - 1 and of 1 (``n_old`` as a value), added in compute.
SEQ_SUMS = (("sum_new", "n_tok"), ("sum_ent", "n_ent"), ("sum_adv", "n_adv"), ("sum_ref_kl", "n_ref"),
            ("sum_old", "n_old"), ("sum_diff", "n_old"), ("sum_kl", "n_old"), ("sum_ratio_m1", "n_old"),
            ("n_old", "n_old"), ("clip_low", "clip_n"), ("clip_high", "clip_n"))
#: the counts of the ``seq_counts`` state (numbers of sequences with a counted token), in order
SEQ_COUNTS = ("n_tok", "n_ent", "n_adv", "n_ref", "n_old", "clip_n")
#: ``SEQ_COUNT_OF[f]``: the index in ``SEQ_COUNTS`` of the count of ``SEQ_SUMS[f]``
SEQ_COUNT_OF = tuple(SEQ_COUNTS.index(count) for _, count in SEQ_SUMS)


def token_means(s: Mapping[str, Any]) -> Callable:
    """``mean(total, count)``: ``s[total] / s[count]``, ``total`` a column or a tuple of them
    (summed), from the reduced states ``s``."""
    return lambda total, count: _total(s, total) / s[count]


def sequence_means(s: Mapping[str, Any]) -> Callable:
    """``mean(total, count)`` under a sequence ``loss_agg_mode``: the mean over the sequences
    with a counted token of each one's value of ``total`` (columns of ``SEQ_SUMS``, reduced by
    ``loss_agg.sequence_table``; ``sum_ratio`` is its two parts)."""
    sums = dict(zip((c for c, _ in SEQ_SUMS), s["seq_sums"]))
    sums["sum_ratio"] = sums["sum_ratio_m1"] + sums["n_old"]  # r = (r - 1) + 1
    seqs = dict(zip(SEQ_COUNTS, s["seq_counts"]))
    return lambda total, count: sequence_mean(_total(sums, total), seqs[count])


def _total(values, total):
    return values[total] if isinstance(total, str) else sum(values[c] for c in total)

#: per-token ratio exp(d), k3 KL (often ~1e-9 on policy) and entropy (<= log vocab)
RATIO_HISTOGRAM = Histogram(1e-6, 1e6, signed=False)
KL_HISTOGRAM = Histogram(1e-15, 1e6, signed=False)
ENTROPY_HISTOGRAM = Histogram(1e-12, 1e3, signed=False)


def states(config: "Config") -> Dict[str, State]:
    """The table's states this configuration creates (the settings' columns only with them)."""
    made = {None: True, "clip_ratio_c": config.clip_ratio_c is not None, "token_counts": config.token_counts}
    return {c.name: State(c.reduce, c.dtype) for c in COLUMNS if made[c.when]}


@dataclass(frozen=True)
class Config:
    """One metric's settings, as the per-call functions read them."""

    name: str
    ignore_index: int
    temperature: float
    epsilon: float
    epsilon_high: float
    top_k_kl: int
    entropy_from_logits: bool
    vocab_parallel: bool
    entropy_chunk_size: Optional[int]
    entropy_chunk_bytes: Optional[int]
    nan_policy: str
    quantiles: Optional[Tuple[float, ...]]
    loss_agg_mode: str
    loss_agg_norm: Optional[float]
    clip_ratio_c: Optional[float]
    token_clip_ratio: bool
    #: clip statistics per sequence (GSPO) instead of per token
    sequence_level_clip: bool
    #: clip counts gated by the advantage sign (GRPO/PPO); CISPO clips the weight itself
    clip_by_advantage_sign: bool

    @property
    def per_sequence(self) -> bool:
        """Whether ``loss_agg_mode`` aggregates over sequences (anything but token-mean)."""
        return self.loss_agg_mode != LOSS_AGG_MODES[0]

    @property
    def token_counts(self) -> bool:
        """GSPO's token-weighted clip counts (``token_clip_ratio``)."""
        return self.token_clip_ratio and self.sequence_level_clip

    @property
    def log_bounds(self) -> Tuple[float, float]:
        """(log(1 - epsilon), log(1 + epsilon_high)): r < 1 - eps <=> d < log(1 - eps)."""
        lo = math.log(1 - self.epsilon) if self.epsilon < 1 else -math.inf
        hi = math.log1p(self.epsilon_high) if self.epsilon_high > -1 else -math.inf
        return lo, hi

    @property
    def fusable(self) -> bool:
        """The fused kernel makes no per-sequence table, histogram, dual clip or GSPO token
        counts: with any of them every microbatch takes the torch path (same states and values)."""
        return not (self.per_sequence or self.clip_ratio_c is not None or self.token_counts or self.quantiles)


def check_clip(name: str, sequence_level_clip: bool, by_sign: bool, clip_ratio_c: Any, token_clip_ratio: Any
               ) -> Tuple[Optional[float], bool]:
    """verl's extra clip keys' arguments, validated (their states come from the table)."""
    if clip_ratio_c is not None:
        if sequence_level_clip or not by_sign:
            raise ValueError(f"{name}: clip_ratio_c (dual-clip PPO) applies to GRPOMetric and PPOMetric; "
                             f"verl's {'GSPO' if sequence_level_clip else 'CISPO'} loss has no dual "
                             "clip (its pg_clipfrac_lower is 0); leave it None")
        if isinstance(clip_ratio_c, bool) or not isinstance(clip_ratio_c, (int, float)) or \
                not 1 < clip_ratio_c < math.inf:
            raise ValueError(f"{name}: clip_ratio_c must be a finite number > 1 (verl's dual-clip bound, "
                             f"3.0 in its configs) or None (no dual clip), got {clip_ratio_c!r}")
        clip_ratio_c = float(clip_ratio_c)
    if not isinstance(token_clip_ratio, bool):
        raise TypeError(f"{name}: token_clip_ratio must be True or False, got {token_clip_ratio!r}")
    return clip_ratio_c, token_clip_ratio
