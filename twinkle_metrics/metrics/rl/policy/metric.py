"""``GRPOMetric``, ``PPOMetric``, ``GSPOMetric``, ``CISPOMetric``: policy-optimisation statistics.

The states come from the columns of ``table.COLUMNS``; ``update`` prepares the call and hands
it to the pure functions of ``sums`` with the metric's ``Config``; ``compute`` writes each
result key once, on the line that divides its states.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence

import torch

from parallel import MeshLike, group_rank, group_size
from parallel.groups import ProcessGroup
from twinkle_metrics.comm import agreement as exchange
from twinkle_metrics.core.config import Schema
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import nan_policy as check_nan_policy
from twinkle_metrics.inputs.data_format import Inputs, Outputs, SideInput
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.kernels import entropy
from twinkle_metrics.metrics.rl.loss_agg import check_loss_agg
from twinkle_metrics.metrics.rl.policy import batch as batch_mod
from twinkle_metrics.metrics.rl.policy import records, sums
from twinkle_metrics.metrics.rl.policy.table import (
    ENTROPY_HISTOGRAM,
    KL_HISTOGRAM,
    RATIO_HISTOGRAM,
    SEQ_COUNTS,
    SEQ_SUMS,
    Config,
    check_clip,
    sequence_means,
    states,
    token_means,
)
from twinkle_metrics.metrics.vocab import check_reach, vocab_states
from twinkle_metrics.stats.histogram import check_quantiles, quantile_keys


class GRPOMetric(Metric):
    """Token-level policy statistics for GRPO/PPO-style training (Twinkle's keys).

    Over masked tokens (``completion_mask``, else ``labels != ignore_index``), with
    ``d = logp - old_logp``, ``r = exp(d)``:

    * ``train/mean_new_logp``, ``train/policy_confidence`` = exp(mean logp);
    * with ``old_logps``: ``train/mean_old_logp``, ``train/logp_diff_mean``,
      ``train/approx_kl`` = mean k3 = mean(r - d - 1) (Schulman's k3 of KL(old||new)),
      ``train/token_kl_max``, ``train/token_ratio_max``, and the additions
      ``train/ratio_mean`` / ``train/ratio_min`` / ``train/ratio_max``. Their
      denominators count only tokens that had an old log-prob (Twinkle divides by
      every masked token);
    * with ``advantages`` too: ``train/clip_ratio_low`` = [r < 1 - epsilon and A < 0],
      ``train/clip_ratio_high`` = [r > 1 + epsilon_high and A > 0], ``train/clip_ratio``,
      and ``train/advantage_mean`` / ``_min`` / ``_max`` over masked tokens (as verl);
      ``train/clip_ratio_dual`` = [A < 0 and r > clip_ratio_c] (verl's ``pg_clipfrac_lower``)
      and ``train/token_clip_ratio`` (verl's ``pg_clipfrac``) when asked for (Args): token
      means whatever ``loss_agg_mode``, as verl logs them;
    * with ``ref_logps`` (or ``ref_outputs={'logps': ...}``): ``train/ref_kl`` = mean of
      k3 for KL(pi || ref), exp(ref - logp) - (ref - logp) - 1, TRL's GRPO estimator;
    * ``train/entropy`` from ``outputs['entropies']``, or, with
      ``entropy_from_logits=True`` and no entropies, from ``outputs['logits']``
      ``[b, s, v]`` aligned with the log-probs: H = logsumexp(z) - sum softmax(z) z
      with z = logits / temperature, in chunks of tokens sized in bytes: two
      working buffers of a chunk each (by default 1/64 of the logits, so ~3% extra
      memory; a full-vocab softmax needs 300%); with ``vocab_parallel=True`` the
      logits are the local vocab shard and the sums are completed over the mesh's
      TP group: one MAX and one SUM all_reduce per ``accumulate``, whatever the
      number of chunks or microbatches, after one host-side agreement over the
      group's CPU twin (``twinkle_metrics.exchange``);
    * ``top_k_kl > 0``: ``_high_kl_records``, the K highest-k3 tokens of the whole
      data group, each ``{'gsi', 'pos', 'token_id', 'kl', 'ratio', 'logp_new',
      'logp_old'}``. ``gsi`` counts sequences over the data group in DP-rank order
      since the last ``calculate()`` (under CP the ranks of one CP group share
      sequences, so they are counted once per DP rank); ``pos`` is the token's
      ``position_ids`` value when the input has them (the global position under CP),
      else its index in the local row. Equal k3 values keep the earlier token (sequence,
      then position), so the records are the same on any layout and either compute path.
      Twinkle keeps per-rank records with local indices. A list of dicts, not a number:
      the loggers write it to ``records.jsonl`` (``integrations.loggers``) and the verl
      drop-in to its ``records=`` dict, never to a sink that takes numbers.

    ``inputs`` are required whenever ``outputs`` hold log-probs (labels or
    ``completion_mask`` give the token mask); ``outputs=None`` or an empty
    microbatch list adds nothing.

    Side inputs (``old_logps``, ``advantages``, ``ref_logps``) may be one tensor
    aligned to the concatenated batch (``[N, s]``; for advantages also ``[N]`` or
    ``[N, 1]``, one value per sequence), a list with one entry per microbatch, or a
    list with one entry per sequence holding only that sequence's valid-token values
    (Twinkle's ragged form), which are scattered onto the mask positions in order.
    Log-probs are never broadcast over a sequence. With micro-batch size 1 both list
    readings give the same result (see ``rl_inputs.split_side_input``).

    Precision and cost: masking selects bitwise in the input dtype, so
    NaN/-inf at masked positions (padding) is ignored (Twinkle multiplies by a 0/1
    mask, so such padding poisons its means); sums accumulate in
    float64; d and k3 = expm1(d) - d are float64, so float32 inputs give the same
    results as float64 arithmetic on the same values (k3 ~ d^2/2 would lose d's low
    bits in float32 at on-policy |d| ~ 1e-4). The states keep the extremes of d, not
    of r and k3: exp is monotone and k3 is convex with its minimum at d = 0, so
    ``ratio_min/max`` = exp(d extremes) and ``token_kl_max`` = the larger k3 of the two.

    Non-finite values (``nan_policy``): a token counts as non-finite when, at a
    token that counts (masked-in, and for side inputs a token that has a value), its
    logp, old logp, ref logp, advantage or entropy is NaN/inf; NaN/-inf padding at
    masked positions is ignored and not counted. ``'propagate'`` (default): the value
    flows into every key it feeds (means, min/max, and the clip ratios, which become
    NaN rather than silently missing a NaN comparison). ``'skip'``: the token is
    dropped from every sum, mean, min and max (exactly the statistics of the same data
    without it; a GSPO sequence keeps its other tokens). Both report the count as
    ``train/nonfinite_tokens`` when > 0 (summed over the data group, like the token
    counts). ``_high_kl_records`` never hold a NaN k3 token.

    Temperature: log-probs are taken as given (they already carry the sampling
    temperature). Twinkle multiplies them by T, which is wrong
    (T * log softmax(z / T) != log softmax(z)); here T only scales logits when the
    metric computes entropy itself.

    Aggregation (``loss_agg_mode``, verl's ``agg_loss`` modes): every key that is a token
    mean (``mean_new_logp`` and ``policy_confidence`` = exp of it, ``mean_old_logp``,
    ``logp_diff_mean``, ``approx_kl``, ``ratio_mean``, ``entropy``, ``clip_ratio*``,
    ``advantage_mean``, ``ref_kl``) is aggregated as the policy loss is. With S_i the sum of
    a key's token values over sequence i and n_i its counted tokens (each key its own: the
    ratio keys count tokens with an old log-prob, the clip keys those with an advantage too):

    * ``'token-mean'`` (default): sum_i S_i / sum_i n_i, as before (the same numbers, states
      and fingerprint);
    * ``'seq-mean-token-mean'``: the mean over sequences of S_i / n_i;
    * ``'seq-mean-token-sum'``: the mean over sequences of S_i;
    * ``'seq-mean-token-sum-norm'``: the mean over sequences of S_i / H_i, with H_i =
      ``loss_agg_norm`` (verl's ``loss_scale_factor``, e.g. the maximum response length) or,
      when None, the sequence's token capacity: the length of its row of the mask (over CP,
      the sum of the ranks' slices), which is verl's ``loss_mask.shape[-1]`` when every row
      has one length.

    These are verl 0.9.1's ``agg_loss`` over the whole batch (``metrics.rl.loss_agg``).

    Sequences with no counted token for a key are left out of its sequence means (verl's
    ``seq_mask``). Rows of the batch are the sequences. Extremes, quantiles, top-k
    records, counts and GSPO's clip keys (already over sequences) do not change. Exact on
    any layout: each rank's per-sequence sums are completed over the CP group in
    ``accumulate`` (one host-side agreement and one all_reduce, shared with GSPO's), then
    folded on CP rank 0 only into float64 sums of per-sequence values and int64 numbers of
    sequences, reduced over the data group like every other state. These modes take the
    torch path where the fused Triton kernel would run (it makes no per-sequence sums).

    Args:
        ignore_index: label value of tokens that do not count.
        temperature: sampling temperature, used only for entropy from logits.
        epsilon: lower clip range; epsilon_high: upper (default epsilon).
        top_k_kl: number of highest-KL token records to keep (0: none).
        entropy_from_logits: compute entropy from ``outputs['logits']`` when no
            ``outputs['entropies']`` are given.
        vocab_parallel: the logits are vocab-sharded over the mesh's TP group.
        entropy_chunk_size: at most this many tokens per entropy chunk (None: the
            byte budget alone decides).
        nan_policy: ``'propagate'`` or ``'skip'`` (see above).
        entropy_chunk_bytes: size of one float32 (float64 for float64 logits)
            working buffer of the entropy computation; two are live at once.
            None: 1/64 of the call's logits, at least 1 MiB. Never less than one
            token's row.
        quantiles: e.g. ``(0.5, 0.9, 0.99)``: also report, over the tokens of the whole
            data group, ``train/ratio_p50`` ... (per-token ratio exp(d), tokens with old
            log-probs), ``train/token_kl_p50`` ... (per-token k3, whose mean is
            ``train/approx_kl``) and ``train/entropy_p50`` ... (``p99.9`` for 0.999).
            Nearest-rank from histograms (``twinkle_metrics.histogram``), within 1%
            relative error of the true value for ratios in [1e-6, 1e6), k3 in
            [1e-15, 1e6) and entropies in [1e-12, 1e3) (0 exact; outside, clamped to the
            bound); under ``'propagate'`` a NaN token makes them NaN. Adds three int64
            states of 1,393 + 2,434 + 1,740 buckets (43.5 KiB) to the sync buffer.
            None (default): no histogram.
        loss_agg_mode: ``'token-mean'`` (default), ``'seq-mean-token-mean'``,
            ``'seq-mean-token-sum'`` or ``'seq-mean-token-sum-norm'`` (see above); another
            value raises ``ValueError``. A non-default mode adds two states (11 float64 sums,
            6 int64 counts).
        loss_agg_norm: the constant divisor of ``'seq-mean-token-sum-norm'`` (> 0); None:
            each sequence's token capacity. Only with that mode.
        clip_ratio_c: dual-clip PPO's bound c > 1 (verl's; 3.0 there), GRPO and PPO only:
            adds ``train/clip_ratio_dual``; takes the torch path, not the fused kernel.
        token_clip_ratio: adds ``train/token_clip_ratio`` (GSPO: takes the torch path).

    Example:
        >>> import torch
        >>> m = GRPOMetric()  # epsilon=0.2: ratios above 1.2 with A > 0 are clipped
        >>> _ = m.accumulate({"labels": torch.tensor([[5, 6, 7, -100]])},
        ...                  {"logps": torch.tensor([[-0.5, -1.0, -0.2, 0.0]], dtype=torch.float64)},
        ...                  old_logps=torch.tensor([[-0.75, -1.0, -0.5, 0.0]], dtype=torch.float64),
        ...                  advantages=torch.tensor([1.0]))
        >>> out = m.calculate()
        >>> round(out["train/ratio_max"], 4), round(out["train/clip_ratio_high"], 4)
        (1.3499, 0.6667)

        Per-sequence aggregation: one sequence with 2 of 3 tokens clipped, one with none
        of 1, so the token mean is 2/4 and the mean of the sequences' fractions (2/3 + 0)/2:

        >>> m = GRPOMetric(loss_agg_mode="seq-mean-token-mean")
        >>> _ = m.accumulate({"labels": torch.tensor([[5, 6, 7], [5, -100, -100]])},
        ...                  {"logps": torch.tensor([[-0.5, -1.0, -0.2], [-1.0, 0.0, 0.0]], dtype=torch.float64)},
        ...                  old_logps=torch.tensor([[-0.75, -1.0, -0.5], [-1.0, 0.0, 0.0]], dtype=torch.float64),
        ...                  advantages=torch.tensor([1.0, 1.0]))
        >>> round(m.calculate()["train/clip_ratio_high"], 4)
        0.3333
    """


    reads = Reads(outputs=("logps", "entropies?"), keywords=("old_logps?", "ref_logps?", "ref_outputs?"),
                  context=Reads(inputs=("labels|completion_mask",), outputs=("logits?",), keywords=("advantages?",)))
    result_keys = ('train/advantage_max', 'train/advantage_mean', 'train/advantage_min', 'train/approx_kl',
                  'train/clip_ratio', 'train/clip_ratio_dual', 'train/clip_ratio_high', 'train/clip_ratio_low',
                  'train/entropy', 'train/logp_diff_mean', 'train/mean_new_logp', 'train/mean_old_logp',
                  'train/nonfinite_tokens', 'train/policy_confidence', 'train/ratio_max', 'train/ratio_mean',
                  'train/ratio_min', 'train/ref_kl', 'train/token_clip_ratio', 'train/token_kl_max',
                  'train/token_ratio_max', 'train/ratio_p*', 'train/token_kl_p*', 'train/entropy_p*',
                  '_high_kl_records',)

    #: the high-KL records carry global sequence indices: whole-call only
    unsliced_states: Sequence[str] = ("topk",)
    #: clip statistics per sequence (GSPO) instead of per token
    sequence_level_clip = False
    #: clip counts gated by the advantage sign (GRPO/PPO); CISPO clips the weight itself
    clip_by_advantage_sign = True
    #: working-memory knobs change no number; the arguments added after checkpoints were
    #: written name a state's meaning, and a checkpoint without them held their defaults
    schema = Schema(exclude=("entropy_chunk_size", "entropy_chunk_bytes"))

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *, ignore_index: int = -100,
                 temperature: float = 1.0, epsilon: float = 0.2, epsilon_high: Optional[float] = None,
                 top_k_kl: int = 0, entropy_from_logits: bool = False, vocab_parallel: bool = False,
                 entropy_chunk_size: Optional[int] = None, entropy_chunk_bytes: Optional[int] = None,
                 nan_policy: str = "propagate", quantiles: Optional[Sequence[float]] = None,
                 loss_agg_mode: str = "token-mean", loss_agg_norm: Optional[float] = None,
                 clip_ratio_c: Optional[float] = None, token_clip_ratio: bool = False, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        name = type(self).__name__
        self.loss_agg_mode, self.loss_agg_norm = check_loss_agg(name, loss_agg_mode, loss_agg_norm)
        self.clip_ratio_c, self.token_clip_ratio = check_clip(
            name, self.sequence_level_clip, self.clip_by_advantage_sign, clip_ratio_c, token_clip_ratio)
        self.nan_policy = check_nan_policy(name, nan_policy)
        self.quantiles = check_quantiles(name, quantiles)
        if temperature <= 0:
            raise ValueError(f"{name}: temperature must be > 0, got {temperature}")
        if not isinstance(top_k_kl, int) or top_k_kl < 0:
            raise ValueError(f"{name}: top_k_kl must be an int >= 0, got {top_k_kl!r}")
        if entropy_chunk_size is not None and (not isinstance(entropy_chunk_size, int) or entropy_chunk_size < 1):
            raise ValueError(f"{name}: entropy_chunk_size (tokens per chunk) must be an int >= 1 or None, "
                             f"got {entropy_chunk_size!r}")
        if entropy_chunk_bytes is not None and (not isinstance(entropy_chunk_bytes, int) or entropy_chunk_bytes < 1):
            raise ValueError(f"{name}: entropy_chunk_bytes must be an int >= 1 or None (1/64 of the "
                             f"logits), got {entropy_chunk_bytes!r}")
        self.ignore_index = ignore_index
        self.temperature = float(temperature)
        self.epsilon = float(epsilon)
        self.epsilon_high = float(epsilon if epsilon_high is None else epsilon_high)
        self.top_k_kl = top_k_kl
        self.entropy_from_logits = bool(entropy_from_logits)
        self.vocab_parallel = bool(vocab_parallel)
        self.entropy_chunk_size = entropy_chunk_size
        self.entropy_chunk_bytes = entropy_chunk_bytes
        cfg = self.config
        for state_name, state in states(cfg).items():  # the table's columns
            self.add_state(state_name, state)
        # TP (vocab-parallel entropy), then CP (GSPO's and the sequence-aggregated modes'
        # sequence completion): the groups every update agrees on, in that order
        self.agree_over = (("tp",) if self.entropy_from_logits and self.vocab_parallel else ()) + (
            ("cp",) if self.sequence_level_clip or cfg.per_sequence else ())
        if self.entropy_from_logits:  # labels past the logits' vocab: checked in compute
            for state_name, state in vocab_states().items():
                self.add_state(state_name, state)
            self.unsliced_states = (*type(self).unsliced_states, *vocab_states())
        if self.entropy_from_logits and not self.vocab_parallel:  # why TP replicas could differ
            self.tp_mismatch_hint = ("with entropy_from_logits, logits that are vocab-sharded over the TP "
                                     "group need vocab_parallel=True")
        if top_k_kl:  # the records and their header row (``records``): one state, its own merge
            self.add_state("topk", State(self._reduce_topk, torch.float64, shape=(top_k_kl + 1, len(records.FIELDS)),
                                         default=-math.inf, local=self._fold_topk))
        if self.quantiles:
            self.add_state("hist_ratio", RATIO_HISTOGRAM.state())
            self.add_state("hist_kl", KL_HISTOGRAM.state())
            # Vocab-parallel entropies come out of all-reduces whose rounding may differ by
            # an ulp between TP replicas, enough to move a count across a bucket edge; the
            # entropy sum still checks that the replicas agree.
            self.add_state("hist_entropy", ENTROPY_HISTOGRAM.state(per_rank=True))
        if cfg.per_sequence:
            # created only for these modes: a token-mean metric's states (and checkpoints) are
            # those of earlier releases
            self.add_state("seq_sums", State("sum", torch.float64, shape=(len(SEQ_SUMS),)))
            self.add_state("seq_counts", State("sum", torch.int64, shape=(len(SEQ_COUNTS),)))

    @property
    def config(self) -> Config:
        """The settings as the per-call functions read them (taken from the attributes, so a
        metric reconfigured after construction computes as it is fingerprinted)."""
        return Config(type(self).__name__, self.ignore_index, self.temperature, self.epsilon, self.epsilon_high,
                      self.top_k_kl, self.entropy_from_logits, self.vocab_parallel, self.entropy_chunk_size,
                      self.entropy_chunk_bytes, self.nan_policy, self.quantiles, self.loss_agg_mode,
                      self.loss_agg_norm, self.clip_ratio_c, self.token_clip_ratio, self.sequence_level_clip,
                      self.clip_by_advantage_sign)

    def _reduce_topk(self, rows):
        return records.merge_records(rows, self.top_k_kl)

    def _fold_topk(self, old, new):
        return records.fold_records(old, new, self.top_k_kl)

    # ----------------------------------------------------------------- update
    def update(self, inputs: Inputs, outputs: Outputs, *, old_logps: SideInput = None, advantages: SideInput = None,
               ref_logps: SideInput = None, ref_outputs: Outputs = None, **kwargs: Any) -> Dict[str, Any]:
        cfg = self.config
        name = cfg.name
        tp_group = self.resolve_mesh().tp_group if cfg.entropy_from_logits and cfg.vocab_parallel else None
        tp_group = tp_group if tp_group is not None and group_size(tp_group) > 1 else None
        cp_group = self.sequence_group() if cfg.sequence_level_clip or cfg.per_sequence else None
        with exchange.guard(self):
            batch = batch_mod.prepare(cfg, inputs, outputs, old_logps, advantages, ref_logps, ref_outputs)
            jobs = batch_mod.entropy_jobs(cfg, batch)
            chunks, shapes = batch_mod.entropy_chunks(cfg, jobs)
            rows = sum(c.shape[0] for c in chunks)
            checks = []
            if tp_group is not None:
                # TP peers must reduce the same rows in the same precision (or all none).
                wide = int(any(entropy.work_dtype(c) == torch.float64 for c in chunks))
                checks.append((tp_group, rows * 2 + wide, "TP", "vocab-parallel logits (token rows x 2 "
                               "+ fp64)", "the same tokens with its own vocab shard"))
            if cp_group is not None and not cfg.per_sequence:
                checks.append((cp_group, batch.n_seq_parts, "CP", "numbers of sequences with old "
                               "log-probs and advantages", "the same sequences"))
            elif cp_group is not None:  # both numbers in one key: one agreement
                checks.append((cp_group, sum(batch.sizes) << 32 | batch.n_seq_parts, "CP",
                               "numbers of sequences (all x 2**32 + those with old log-probs and "
                               "advantages)", "the same sequences"))
            for group, key, axis, what, fix in checks:
                low, high = exchange.agree_same(self, group, key)
                if low != high:
                    raise ValueError(f"{name}: {axis} ranks hold different {what} ({low} to {high}; this "
                                     f"rank {key}); every rank of a {axis} group must pass {fix}; nothing "
                                     "was accumulated")
        # Validated and agreed: nothing below raises. Entropy from logits first (its TP
        # collectives), so that a token whose entropy is NaN/inf counts as non-finite too.
        ents = {}
        if jobs:
            ents = dict(zip((job[0] for job in jobs),
                            entropy.token_entropy(chunks, shapes, cfg.temperature, tp_group if rows else None,
                                                  jobs[0][2].device)))
        dp_rank = cp_rank = 0
        if cfg.top_k_kl:  # a process_group without CP stands for the data group: its rank orders the sequences
            mesh = self.resolve_mesh()
            by_mesh = self.process_group is None or self.sequence_group() is not None
            cp_rank = mesh.cp_rank if by_mesh else 0
            dp_rank = mesh.dp_rank if by_mesh else group_rank(self.process_group)
        acc, parts, seq_rows = sums.call_sums(cfg, batch, ents, dp_rank, cp_rank)
        if parts is not None or seq_rows is not None:
            acc.update(sums.sequence_stats(cfg, parts, seq_rows, self.sequence_group()))
        if jobs and not cfg.vocab_parallel:
            acc.update(batch_mod.label_reach(batch.items, jobs))
        return acc

    # ---------------------------------------------------------------- compute
    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        cfg = self.config
        if cfg.entropy_from_logits:
            check_reach(cfg.name, s, cfg.vocab_parallel, self.resolve_mesh().tp_size, "the entropy from logits")
        out: Dict[str, Any] = {"train/nonfinite_tokens": int(s["n_bad"])} if s["n_bad"] else {}
        if not s["n_tok"]:
            return out
        # mean(total, count): s[total] / s[count], or under a sequence loss_agg_mode the mean over
        # sequences of each one's (``table``); GSPO's clip counts are sequences already, and verl's
        # extra clip keys token-weighted whatever the mode. Every clip key carries clip_nan (0, or
        # NaN when a gated token was non-finite under 'propagate').
        mean = sequence_means(s) if cfg.per_sequence else token_means(s)
        clip = token_means(s) if cfg.sequence_level_clip else mean
        nan = s["clip_nan"]
        out["train/mean_new_logp"] = mean("sum_new", "n_tok")
        if s["n_old"]:
            out["train/mean_old_logp"] = mean("sum_old", "n_old")
            out["train/logp_diff_mean"] = mean("sum_diff", "n_old")
            out["train/approx_kl"] = mean("sum_kl", "n_old")
            out["train/ratio_mean"] = mean("sum_ratio", "n_old")
        if s["n_ent"]:
            out["train/entropy"] = mean("sum_ent", "n_ent")
        if s["clip_n"]:
            out["train/clip_ratio_low"] = clip("clip_low", "clip_n") + nan
            out["train/clip_ratio"] = clip(("clip_low", "clip_high"), "clip_n") + nan
            out["train/clip_ratio_high"] = clip("clip_high", "clip_n") + nan
        if s["n_adv"]:
            out["train/advantage_mean"] = mean("sum_adv", "n_adv")
        if s["n_ref"]:
            out["train/ref_kl"] = mean("sum_ref_kl", "n_ref")
        if s["clip_n"] and "clip_dual" in s:  # verl's pg_clipfrac_lower (clip_ratio_c)
            out["train/clip_ratio_dual"] = s["clip_dual"] / s["clip_n"] + nan
        if s["clip_n"] and cfg.token_clip_ratio:  # verl's pg_clipfrac
            if not cfg.sequence_level_clip:
                out["train/token_clip_ratio"] = (s["clip_low"] + s["clip_high"]) / s["clip_n"] + nan
            elif "clip_tok" in s and s["clip_tok_n"]:  # GSPO: tokens of clipped sequences, by their own A
                out["train/token_clip_ratio"] = s["clip_tok"] / s["clip_tok_n"] + nan
        out["train/policy_confidence"] = _exp(out["train/mean_new_logp"])
        nan_flows = cfg.nan_policy == "propagate"
        if s["n_old"]:
            out["train/token_kl_max"] = max(_k3(s["logr_max"]), _k3(s["logr_min"]), key=_nan_first)
            out["train/token_ratio_max"] = _exp(s["logr_max"])
            out["train/ratio_min"] = _exp(s["logr_min"])
            out["train/ratio_max"] = _exp(s["logr_max"])
            if cfg.quantiles:
                out.update(quantile_keys("train/ratio", RATIO_HISTOGRAM, s["hist_ratio"], cfg.quantiles, nan_flows))
                out.update(quantile_keys("train/token_kl", KL_HISTOGRAM, s["hist_kl"], cfg.quantiles, nan_flows))
        if s["n_ent"] and cfg.quantiles:
            out.update(quantile_keys("train/entropy", ENTROPY_HISTOGRAM, s["hist_entropy"], cfg.quantiles,
                                     nan_flows))
        if s["n_adv"]:
            out["train/advantage_min"] = s["adv_min"]
            out["train/advantage_max"] = s["adv_max"]
        found = records.as_records(s["topk"], cfg.top_k_kl) if cfg.top_k_kl else None
        if found:
            out["_high_kl_records"] = found
        return out


def _exp(d: float) -> float:
    try:
        return math.exp(d)
    except OverflowError:
        return math.inf


def _k3(d: float) -> float:
    """k3 = r - log r - 1 with r = e^d, as expm1(d) - d (accurate for small d)."""
    try:
        return math.expm1(d) - d if d != math.inf else math.inf
    except OverflowError:
        return math.inf


def _nan_first(v: float):
    return (v != v, v)  # max() picks a NaN if there is one


class PPOMetric(GRPOMetric):
    """PPO policy metric: the same token-level ratio and clip statistics as GRPO.

    Example:
        >>> import torch
        >>> m = PPOMetric(epsilon=0.3)
        >>> _ = m.accumulate({"labels": torch.tensor([[5, 6, 7]])},
        ...                  {"logps": torch.tensor([[-0.5, -1.0, -0.2]], dtype=torch.float64)},
        ...                  old_logps=torch.tensor([[-0.75, -1.0, -0.5]], dtype=torch.float64),
        ...                  advantages=torch.tensor([1.0]))
        >>> round(m.calculate()["train/clip_ratio_high"], 4)  # only exp(0.3) > 1.3
        0.3333
    """


class GSPOMetric(GRPOMetric):
    """GRPO metrics with GSPO's sequence-level clip statistics.

    Clip gates apply to each sequence's ratio exp(mean over its tokens of d), with
    the sequence's advantage (the mean over its tokens when given per token);
    ``train/clip_ratio*`` are fractions of sequences (whatever ``loss_agg_mode``). verl logs
    a token-weighted fraction instead (``actor/pg_clipfrac``: tokens whose sequence ratio is
    clipped, each gated by its own advantage's sign, over all tokens):
    ``token_clip_ratio=True`` adds it as ``train/token_clip_ratio``. Under CP the
    per-sequence sums are completed over the CP group first (one agreement and one all_reduce in
    ``accumulate``; every CP rank must call it the same number of times). Other keys are as
    GRPOMetric.

    Example:
        >>> import torch
        >>> m = GSPOMetric(epsilon=0.1, epsilon_high=0.1)
        >>> _ = m.accumulate({"labels": torch.tensor([[5, 6, 7], [5, 6, 7]])},
        ...                  {"logps": torch.tensor([[-0.5, -1.0, -0.2], [-1.0, -1.0, -1.0]], dtype=torch.float64)},
        ...                  old_logps=torch.tensor([[-0.75, -1.0, -0.5], [-1.0, -1.0, -1.0]], dtype=torch.float64),
        ...                  advantages=torch.tensor([1.0, 1.0]))
        >>> m.calculate()["train/clip_ratio_high"]  # sequence 0: exp(0.55 / 3) > 1.1
        0.5
    """

    sequence_level_clip = True


class CISPOMetric(GRPOMetric):
    """GRPO metrics with CISPO's clip statistics: r < 1 - epsilon or r > 1 + epsilon_high
    per token, not gated by the advantage sign (CISPO clips the importance weight itself).

    Example:
        >>> import torch
        >>> m = CISPOMetric(epsilon=0.2, epsilon_high=0.2)
        >>> _ = m.accumulate({"labels": torch.tensor([[5, 6, 7]])},
        ...                  {"logps": torch.tensor([[-0.5, -1.0, -0.5]], dtype=torch.float64)},
        ...                  old_logps=torch.tensor([[-0.75, -1.0, -0.2]], dtype=torch.float64),
        ...                  advantages=torch.tensor([1.0]))
        >>> out = m.calculate()  # not gated by the advantage sign: exp(-0.3) < 0.8 counts
        >>> round(out["train/clip_ratio_low"], 4), round(out["train/clip_ratio_high"], 4)
        (0.3333, 0.3333)
    """

    clip_by_advantage_sign = False
