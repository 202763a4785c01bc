"""The policy family's columns, declared once, and the configuration of one metric.

``COLUMNS`` is the one table: each row a state (its reduction and dtype), the per-token
quantity it reduces (``kernels.rl_triton`` computes the same quantities and returns them
under the names and order of this table), the count it is a mean over, its per-sequence
columns under a sequence ``loss_agg_mode`` and the result keys it feeds. The metric's
states, the torch path (``sums``), the fused kernel and ``compute`` all read it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from twinkle_metrics.core.state import State
from twinkle_metrics.metrics.rl.loss_agg import LOSS_AGG_MODES
from twinkle_metrics.stats.histogram import Histogram

I64, F64 = torch.int64, torch.float64


class Column(NamedTuple):
    """One state of the family and what it means."""

    name: str
    reduce: str                # "sum", "max" or "min"
    dtype: torch.dtype
    quantity: Optional[str]    # the per-token quantity reduced (the fused kernel's name); None: torch only
    count: Optional[str] = None  # the column it is a token mean over
    seq: Tuple[str, ...] = ()  # its ``SEQ_SUMS`` / ``SEQ_COUNTS`` columns (a sequence mode)
    keys: Tuple[str, ...] = ()  # the result keys it feeds
    when: Optional[str] = None  # the setting that creates it (None: always there)


COLUMNS = (
    Column("n_tok", "sum", I64, "tokens", seq=("n_tok",)),
    Column("sum_new", "sum", F64, "logp", "n_tok", ("new",), ("train/mean_new_logp",)),
    Column("n_old", "sum", I64, "tokens_old", seq=("n_old",)),
    Column("sum_old", "sum", F64, "old_logp", "n_old", ("old",), ("train/mean_old_logp",)),
    Column("sum_diff", "sum", F64, "log_ratio", "n_old", ("diff",), ("train/logp_diff_mean",)),
    Column("sum_kl", "sum", F64, "k3", "n_old", ("kl",), ("train/approx_kl",)),
    Column("sum_ratio", "sum", F64, "ratio", "n_old", ("ratio_m1", "ratio_one"), ("train/ratio_mean",)),
    # log-ratio extremes: ratio_min/max and kl_max follow in compute (exp is monotone, k3 convex)
    Column("logr_max", "max", F64, "log_ratio", keys=("train/ratio_max", "train/token_ratio_max")),
    Column("logr_min", "min", F64, "log_ratio", keys=("train/ratio_min", "train/token_kl_max")),
    Column("n_ent", "sum", I64, "tokens_ent", seq=("n_ent",)),
    Column("sum_ent", "sum", F64, "entropy", "n_ent", ("ent",), ("train/entropy",)),
    Column("clip_n", "sum", I64, "tokens_clip", seq=("n_clip",)),
    Column("clip_low", "sum", I64, "clip_low", "clip_n", ("clip_low",), ("train/clip_ratio_low", "train/clip_ratio")),
    Column("clip_high", "sum", I64, "clip_high", "clip_n", ("clip_high",),
           ("train/clip_ratio_high", "train/clip_ratio")),
    Column("n_adv", "sum", I64, "tokens_adv", seq=("n_adv",)),
    Column("sum_adv", "sum", F64, "advantage", "n_adv", ("adv",), ("train/advantage_mean",)),
    Column("adv_min", "min", F64, "advantage", keys=("train/advantage_min",)),
    Column("adv_max", "max", F64, "advantage", keys=("train/advantage_max",)),
    Column("n_ref", "sum", I64, "tokens_ref", seq=("n_ref",)),
    Column("sum_ref_kl", "sum", F64, "ref_k3", "n_ref", ("ref_kl",), ("train/ref_kl",)),
    Column("n_bad", "sum", I64, "nonfinite", keys=("train/nonfinite_tokens",)),
    # 0, or NaN when a clip-gated token held NaN/inf ('propagate'): added to every clip key
    Column("clip_nan", "sum", F64, "clip_nan"),
    # verl's extra clip keys (token-weighted whatever the mode): the torch path only
    Column("clip_dual", "sum", I64, None, "clip_n", keys=("train/clip_ratio_dual",), when="clip_ratio_c"),
    Column("clip_tok", "sum", I64, None, "clip_tok_n", keys=("train/token_clip_ratio",), when="token_counts"),
    Column("clip_tok_n", "sum", I64, None, when="token_counts"),
)
BY_NAME: Dict[str, Column] = {c.name: c for c in COLUMNS}
#: what the fused kernel fills: (state, reduction, quantity, dtype) in table order
KERNEL_COLUMNS = tuple((c.name, c.reduce, c.quantity, c.dtype) for c in COLUMNS if c.quantity is not None)
#: the token means: result key -> (the columns summed, the count); keys of the clip counts get ``clip_nan``
MEANS: Dict[str, Tuple[Tuple[str, ...], str]] = {}
for _c in COLUMNS:
    for _key in _c.keys if _c.count else ():
        MEANS[_key] = (MEANS.get(_key, ((), ""))[0] + (_c.name,), _c.count)
CLIP_COUNTS = ("clip_n", "clip_tok_n")

#: the per-sequence columns of a sequence ``loss_agg_mode`` (the order of the ``seq_sums`` and
#: ``seq_counts`` states): token sums, then token counts (then each sequence's token capacity)
SEQ_SUMS = ("new", "ent", "adv", "ref_kl", "old", "diff", "kl", "ratio_m1", "ratio_one", "clip_low", "clip_high")
SEQ_COUNTS = ("n_tok", "n_ent", "n_adv", "n_ref", "n_old", "n_clip")
#: ``SEQ_COUNT_OF[f]``: the count column of sum column ``f``, from the table
SEQ_COUNT_OF = tuple(next(SEQ_COUNTS.index(BY_NAME[c.count].seq[0]) for c in COLUMNS if f in c.seq and c.count)
                     for f in SEQ_SUMS)

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


def check_clip(name: str, sequence_level_clip: bool, by_sign: bool, clip_ratio_c, token_clip_ratio):
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
