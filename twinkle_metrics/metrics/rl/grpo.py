"""``GRPOMetric``, ``GSPOMetric``, ``CISPOMetric``: policy-optimisation statistics."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from parallel import group_rank, group_size
from twinkle_metrics.core import fold
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import as_tensor, float_tensor, floating_tensor
from twinkle_metrics.inputs.checks import nan_policy as check_nan_policy
from twinkle_metrics.inputs.microbatch import has_field, microbatches
from twinkle_metrics.inputs.rl import (
    _float,
    common_length,
    cp_sum,
    keep_bits,
    masked,
    nonfinite_tokens,
    per_token,
    split_side_input,
    token_mask,
)
from twinkle_metrics.kernels import _triton, entropy
from twinkle_metrics.stats.histogram import Histogram, check_quantiles, quantile_keys
from twinkle_metrics.sync import agreement as exchange

# Columns of one top-k record row.
_FIELDS = ("kl", "gsi", "pos", "token_id", "ratio", "logp_new", "logp_old")
_INT_FIELDS = ("gsi", "pos", "token_id")
#: per-token ratio exp(d), k3 KL (often ~1e-9 on policy) and entropy (<= log vocab)
RATIO_HISTOGRAM = Histogram(1e-6, 1e6, signed=False)
KL_HISTOGRAM = Histogram(1e-15, 1e6, signed=False)
ENTROPY_HISTOGRAM = Histogram(1e-12, 1e3, signed=False)


def _top(key: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the ``k`` largest of ``key`` (1-D), largest first; equal keys in
    the order they come (a stable sort: ``torch.topk`` leaves ties to the device and the
    path). Every caller passes keys in token order (sequence, then position), so a tie goes
    to the earlier token, whatever the microbatches, paths or ranks the tokens went through."""
    values, indices = torch.sort(key, descending=True, stable=True)
    return values[:k], indices[:k]


def _topk_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` rows with the largest first column (the k3 value); -inf rows are empty.

    Rows come in token order (earlier calls, microbatches and data ranks first, each
    block sorted as ``_top`` leaves it), so equal keys keep the earlier token.
    Always ``k`` rows: fewer candidates (a short batch) are padded with empty rows,
    so the fixed-shape state never sees another shape.
    """
    flat = rows.reshape(-1, rows.shape[-1])
    if flat.shape[0] < k:
        pad = flat.new_full((k - flat.shape[0], flat.shape[1]), -math.inf)
        flat = torch.cat([flat, pad])
    return flat[_top(flat[:, 0], k)[1]]


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
      Twinkle keeps per-rank records with local indices.

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
    """

    #: the high-KL records carry global sequence indices: whole-call only
    unsliced_states = ("topk", "n_seq", "dp_index", "cp_index")

    n_tok = State("sum", torch.int64)
    sum_new = State("sum")
    n_old = State("sum", torch.int64)
    sum_old = State("sum")
    sum_diff = State("sum")
    sum_kl = State("sum")
    sum_ratio = State("sum")
    logr_max = State("max")  # log-ratio extremes: ratio_min/max and kl_max follow in compute
    logr_min = State("min")
    n_ent = State("sum", torch.int64)
    sum_ent = State("sum")
    clip_n = State("sum", torch.int64)
    clip_low = State("sum", torch.int64)
    clip_high = State("sum", torch.int64)
    n_adv = State("sum", torch.int64)
    sum_adv = State("sum")
    adv_min = State("min")
    adv_max = State("max")
    n_ref = State("sum", torch.int64)
    sum_ref_kl = State("sum")
    n_bad = State("sum", torch.int64)  # non-finite tokens
    clip_nan = State("sum")  # 0, or NaN when a clip-gated token held NaN/inf ('propagate')

    #: clip statistics per sequence (GSPO) instead of per token
    sequence_level_clip = False
    #: working-memory knobs: they change no number
    fingerprint_exclude = ("entropy_chunk_size", "entropy_chunk_bytes")

    def __init__(self, device_mesh=None, process_group=None, *, ignore_index: int = -100,
                 temperature: float = 1.0, epsilon: float = 0.2, epsilon_high: Optional[float] = None,
                 top_k_kl: int = 0, entropy_from_logits: bool = False, vocab_parallel: bool = False,
                 entropy_chunk_size: Optional[int] = None, entropy_chunk_bytes: Optional[int] = None,
                 nan_policy: str = "propagate", quantiles: Optional[Sequence[float]] = None, **kwargs):
        super().__init__(device_mesh, process_group, **kwargs)
        name = type(self).__name__
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
        if top_k_kl:
            self.add_state("topk", State(self._reduce_topk, torch.float64, shape=(top_k_kl, len(_FIELDS)),
                                         default=-math.inf, local=self._fold_topk))
            self.add_state("n_seq", State("sum", torch.int64))
            # Each rank's place in the data order, for the records' global sequence index: kept
            # as a maximum, so that states loaded from several old ranks (resuming at a smaller
            # DP size: new rank k holds old ranks 2k, 2k+1) keep the order of the new ranks
            # whether or not a rank accumulates after the load.
            self.add_state("dp_index", State("max", torch.int64))
            self.add_state("cp_index", State("max", torch.int64))
        if self.quantiles:
            self.add_state("hist_ratio", RATIO_HISTOGRAM.state())
            self.add_state("hist_kl", KL_HISTOGRAM.state())
            # Vocab-parallel entropies come out of all-reduces whose rounding may differ by
            # an ulp between TP replicas, enough to move a count across a bucket edge; the
            # entropy sum still checks that the replicas agree.
            self.add_state("hist_entropy", ENTROPY_HISTOGRAM.state(per_rank=True))

    def _reduce_topk(self, rows):
        return _topk_rows(rows, self.top_k_kl)

    def _fold_topk(self, old, new):
        return _topk_rows(torch.stack([old, new]), self.top_k_kl)

    # ----------------------------------------------------------------- update
    def exchange_groups(self):
        """TP (vocab-parallel entropy), then CP (GSPO's sequence completion): the groups
        every ``update`` agrees on, in that order."""
        return [g for g in (self._entropy_group(), self._sequence_group()) if g is not None]

    def _entropy_group(self):
        if not (self.entropy_from_logits and self.vocab_parallel):
            return None
        group = self.resolve_mesh().tp_group
        return group if group_size(group) > 1 else None

    def _sequence_group(self):
        return self.sequence_group() if self.sequence_level_clip else None

    def update(self, inputs, outputs, *, old_logps=None, advantages=None, ref_logps=None,
               ref_outputs=None, **kwargs) -> Dict[str, Any]:
        name = type(self).__name__
        tp_group, cp_group = self._entropy_group(), self._sequence_group()
        with exchange.guard(self):
            batch = self._prepare(name, inputs, outputs, old_logps, advantages, ref_logps, ref_outputs)
            jobs = [(i, item["o"]["logits"], item["m"]) for i, item in enumerate(batch["items"])
                    if item["ent"] is None and self.entropy_from_logits and "logits" in item["o"]]
            chunks, shapes = self._entropy_chunks(name, jobs)
            rows = sum(c.shape[0] for c in chunks)
            checks = []
            if tp_group is not None:
                # TP peers must reduce the same rows in the same precision (or all none).
                wide = int(any(entropy.work_dtype(c) == torch.float64 for c in chunks))
                checks.append((tp_group, rows * 2 + wide, "TP", "vocab-parallel logits (token rows x 2 "
                               "+ fp64)", "the same tokens with its own vocab shard"))
            if cp_group is not None:
                checks.append((cp_group, batch["n_seq_parts"], "CP", "numbers of sequences with old "
                               "log-probs and advantages", "the same sequences"))
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
            device = jobs[0][2].device
            ents = dict(zip((job[0] for job in jobs),
                            entropy.token_entropy(chunks, shapes, self.temperature,
                                                 tp_group if rows else None, device)))
        acc, parts = self._sums(batch, ents)
        if parts is not None:
            acc.update(self._sequence_clip(parts))
        return acc

    def _prepare(self, name, inputs, outputs, old_logps, advantages, ref_logps, ref_outputs):
        """This call's inputs, validated and aligned per microbatch; communicates nothing.

        ``{'items': [per microbatch: feat, o, lp, m, full_len, ent, em, adv, has_adv, ref,
        has_ref, old, has_old], 'sizes': sequences per microbatch, 'n_seq_parts': GSPO's
        sequences to complete over CP}``.
        """
        if ref_outputs is not None:
            if ref_logps is not None:
                raise ValueError(f"{name}: got both ref_logps= and ref_outputs=; pass one")
            if not isinstance(ref_outputs, Mapping) or ref_outputs.get("logps") is None:
                got = sorted(map(str, ref_outputs)) if isinstance(ref_outputs, Mapping) else \
                    type(ref_outputs).__name__
                raise ValueError(f"{name}: ref_outputs must be a dict with 'logps' (the reference model's "
                                 f"per-token log-probs), got {got}; or pass ref_logps= directly")
            ref_logps = ref_outputs["logps"]
        empty = {"items": [], "sizes": [], "n_seq_parts": 0}
        if outputs is None:
            return empty
        if inputs is None and has_field(outputs, "logps"):
            raise ValueError(f"{name}: outputs['logps'] given but inputs is None; per-token log-probs need "
                             "the token mask: pass the InputFeature (or list of them) with labels or "
                             "completion_mask")
        pairs = microbatches(name, inputs, outputs, ("logps", "entropies", "logits"))
        if not pairs:
            return empty
        for i, (_, o) in enumerate(pairs):
            if "logps" not in o:
                raise ValueError(f"{name}: outputs of microbatch {i} have no 'logps'; pass per-token "
                                 f"log-probs [batch, seq] (got fields {sorted(o)})")
        lps, masks, full_lens = [], [], []
        for feat, o in pairs:
            lp = float_tensor(name, "outputs['logps']", o["logps"])
            lp = lp.unsqueeze(0) if lp.dim() == 1 else lp
            mask = token_mask(name, feat, self.ignore_index, lp.device)
            full_lens.append(mask.shape[1])
            lp, mask = common_length(name, "outputs['logps']", lp, mask)
            lps.append(lp.to(_float(lp.dtype)))
            masks.append(mask)
        sizes = [m.shape[0] for m in masks]
        olds = split_side_input(name, "old_logps", old_logps, sizes)
        advs = split_side_input(name, "advantages", advantages, sizes)
        refs = split_side_input(name, "ref_logps", ref_logps, sizes)

        items, n_parts = [], 0
        for i, ((feat, o), lp, m) in enumerate(zip(pairs, lps, masks)):
            ent = em = None  # entropies and the tokens that have one
            if "entropies" in o:
                ent = float_tensor(name, "outputs['entropies']", o["entropies"], lp.device)
                ent = ent.unsqueeze(0) if ent.dim() == 1 else ent
                if ent.dim() == 2 and ent.shape == m.shape:
                    em = m
                else:
                    ent, em = common_length(name, "outputs['entropies']", ent, m)
                ent = _floating(ent)
            elif self.entropy_from_logits and o.get("logits") is not None:
                logits = floating_tensor(name, "logits", o["logits"])
                if logits.dim() < 2 or logits.shape[-1] == 0:
                    raise ValueError(f"{name}: outputs['logits'] must be [..., vocab] with a vocab of at least "
                                     f"one entry for entropy_from_logits, got shape {list(logits.shape)}")
            adv = has_adv = ref = has_ref = old = has_old = None
            if m.numel():
                if advs[i] is not None:
                    adv, has_adv = per_token(name, "advantages", advs[i], m, full_lens[i], per_sequence=True)
                if refs[i] is not None:
                    ref, has_ref = per_token(name, "ref_logps", refs[i], m, full_lens[i])
                if olds[i] is not None:
                    old, has_old = per_token(name, "old_logps", olds[i], m, full_lens[i])
                if self.sequence_level_clip and old is not None and adv is not None:
                    n_parts += m.shape[0]
            items.append(dict(feat=feat, o=o, lp=lp, m=m, ent=ent, em=em, adv=adv, has_adv=has_adv,
                              ref=ref, has_ref=has_ref, old=old, has_old=has_old))
        return {"items": items, "sizes": sizes, "n_seq_parts": n_parts}

    def _sums(self, batch, logit_ents):
        """(contributions, GSPO's per-sequence parts or None) of a prepared call; masked
        arithmetic only, nothing raises. ``logit_ents``: entropies computed from logits,
        by microbatch."""
        # Per-token values stay in the input dtype (float32 usually) where that is exact:
        # masking (a bitwise select, so NaN/-inf padding at masked positions, common for prompt
        # tokens, is dropped rather than multiplied into the sums) and sums (accumulated in
        # float64). Log-ratios and k3 = expm1(d) - d are float64: d = logp - old_logp is
        # exact there, and k3 ~ d^2/2 needs d's low bits.
        acc: Dict[str, Any] = {}
        seq_parts: List[torch.Tensor] = []
        candidates: List[torch.Tensor] = []
        mbs = [_Microbatch(item, logit_ents.get(i)) for i, item in enumerate(batch["items"])]
        starts = [0]  # each microbatch's first sequence in the call
        for mb in mbs:
            starts.append(starts[-1] + mb.m.shape[0])
        for mb, start in zip(mbs, starts):
            mb.seq0 = start
        fused, records = self._fused_sums(acc, [mb for mb in mbs if self._fuses(mb)])
        if records is not None:  # every fused microbatch's candidates at once
            candidates.append(self._fused_candidates(records))
        for mb in mbs:
            seq_start = mb.seq0
            if mb in fused:  # the one-kernel path: GSPO's rows, in microbatch order
                if fused[mb] is not None:
                    seq_parts.append(fused[mb])
                continue
            self._count_nonfinite(acc, mb)
            self._token_sums(acc, mb)
            if mb.m.numel():
                if mb.adv is not None:
                    self._advantage_sums(acc, mb)
                if mb.ref is not None:
                    self._ref_sums(acc, mb)
                if mb.old is not None:
                    self._ratio_sums(acc, mb, seq_parts)
                    if self.top_k_kl:
                        k3 = mb.ratio_m1 - mb.d
                        key = torch.where(mb.has_old & (k3 > 0), k3, -math.inf)
                        candidates.append(self._candidates(mb, key, seq_start))
            if self.quantiles:
                self._quantile_counts(acc, mb)

        if self.top_k_kl:
            mesh = self.resolve_mesh()
            # a process_group without CP stands for the data group: its rank orders the sequences
            by_mesh = self.process_group is None or self.sequence_group() is not None
            cp_rank = mesh.cp_rank if by_mesh else 0
            dp_rank = mesh.dp_rank if by_mesh else group_rank(self.process_group)
            acc["n_seq"] = sum(batch["sizes"])
            acc["dp_index"] = dp_rank
            acc["cp_index"] = cp_rank
            if len(candidates) == 1 and candidates[0].shape[0] == self.top_k_kl:
                acc["topk"] = candidates[0]  # torch.topk's rows, largest first: the top k already
            elif candidates:
                acc["topk"] = _topk_rows(torch.cat(candidates), self.top_k_kl)
        parts = torch.cat(seq_parts) if self.sequence_level_clip and seq_parts else None
        return acc, parts

    def _fuses(self, mb: "_Microbatch") -> bool:
        """Whether this microbatch takes the one-kernel path (``kernels.triton_rl``): on CUDA
        with the kernels enabled, no histograms, and every side input covering exactly the
        counted tokens (aligned ``[b, s]``, or ``[b, 1]`` advantages)."""
        m = mb.m
        if self.quantiles or not m.numel() or not _triton.device_ok(mb.lp):
            return False
        b, s = m.shape
        if mb.lp.shape != m.shape:
            return False
        for x, has, widths in ((mb.old, mb.has_old, (s,)), (mb.ref, mb.has_ref, (s,)), (mb.ent, mb.em, (s,)),
                               (mb.adv, mb.has_adv, (1, s))):
            if x is not None and (has is not m or x.dim() != 2 or x.shape[0] != b or x.shape[1] not in widths
                                  or x.device != m.device):
                return False
        return True

    def _fused_sums(self, acc, mbs: List["_Microbatch"]) -> Tuple[Dict["_Microbatch", Any], Any]:
        """Every per-token contribution of ``mbs`` from one kernel each
        (``kernels.triton_rl``), folded into ``acc`` once: the same states and values as
        the steps below. Returns ``({microbatch: GSPO rows or None}, the top-k record
        buffer or None)``."""
        if not mbs:
            return {}, None
        lo, hi = self._log_bounds
        skip = self.nan_policy == "skip"
        both = [mb.old is not None and mb.adv is not None for mb in mbs]

        def launch():
            from twinkle_metrics.kernels import triton_rl
            keyed = bool(self.top_k_kl)
            return triton_rl.token_stats(
                [dict(lp=mb.lp, m=mb.m, old=mb.old, adv=mb.adv, ref=mb.ref, ent=mb.ent, seq0=mb.seq0,
                      tok=self._feature_view(mb, "labels") if keyed else None,
                      pos=self._feature_view(mb, "position_ids") if keyed else None) for mb in mbs],
                lo=lo, hi=hi, token_clip=not self.sequence_level_clip, by_sign=self.clip_by_advantage_sign,
                skip=skip, want_key=bool(self.top_k_kl), want_rows=self.sequence_level_clip and any(both))

        result = _triton.attempt("RL token statistics", launch)
        if result is None:
            return {}, None  # every microbatch takes the torch path
        totals, records, rows = result
        # Every state the kernel writes, by its declared reduction; a column whose input no
        # microbatch gave holds the reduction's identity (0, -inf, +inf) and changes nothing.
        for name, value in totals.items():
            fold.by(acc, name, value, self._specs[name].reduce)
        return {mb: (r if ok else None) for mb, r, ok in zip(mbs, rows, both)}, records

    def _count_nonfinite(self, acc, mb: "_Microbatch") -> None:
        """Count the tokens that count and hold a NaN/inf in any input (padding at masked
        positions is not counted: every term is gated by the tokens the value belongs
        to); under ``nan_policy='skip'`` drop them from every mask and zero their values."""
        m = mb.m
        present = [(x, has) for x, has in ((mb.adv, mb.has_adv), (mb.ref, mb.has_ref), (mb.old, mb.has_old),
                                           (mb.ent, mb.em)) if x is not None]
        bad = nonfinite_tokens(mb.lp, m, present)
        fold.add(acc, "n_bad", bad.sum())
        if self.nan_policy == "skip":  # no NaN * 0 below
            ok = ~bad
            mb.m = m & ok

            def drop(has):
                return has if has is None else mb.m if has is m else has & ok[:, :has.shape[1]]

            mb.has_adv, mb.has_ref, mb.has_old, mb.em = drop(mb.has_adv), drop(mb.has_ref), drop(mb.has_old), \
                drop(mb.em)
            mb.lp, mb.adv, mb.ref, mb.old, mb.ent = (x if x is None else x.nan_to_num(0.0, 0.0, 0.0)
                                                     for x in (mb.lp, mb.adv, mb.ref, mb.old, mb.ent))

    def _token_sums(self, acc, mb: "_Microbatch") -> None:
        """Token count, sum of new log-probs, entropy."""
        m = mb.m
        mb.n_tok = m.sum()
        mb.lpm = mb.keep(mb.lp, m)
        fold.add(acc, "n_tok", mb.n_tok)
        fold.add(acc, "sum_new", mb.lpm.sum(dtype=torch.float64))
        if mb.ent is not None:
            if mb.em is m:
                fold.add(acc, "n_ent", mb.n_tok)
                fold.add(acc, "sum_ent", mb.keep(mb.ent, m).sum(dtype=torch.float64))
            else:
                fold.add(acc, "n_ent", mb.em.sum())
                fold.add(acc, "sum_ent", torch.where(mb.em, mb.ent, 0.0).sum(dtype=torch.float64))

    def _advantage_sums(self, acc, mb: "_Microbatch") -> None:
        """Advantage count, sum, extremes: per token, or one value per sequence."""
        adv, has_adv = mb.adv, mb.has_adv
        fold.add(acc, "n_adv", mb.n_tok if has_adv is mb.m else has_adv.sum())
        if adv.shape[1] == 1 and mb.m.shape[1] != 1:  # one value per sequence: per-row counts
            rows = has_adv.sum(1, dtype=torch.float64)
            # where: the value of a row without tokens (maybe NaN) must not count
            fold.add(acc, "sum_adv", torch.where(rows > 0, adv[:, 0].to(torch.float64) * rows, 0.0).sum())
            lo, hi = _extremes(adv[:, 0], rows > 0)
        else:
            mb.adv = adv = mb.keep(adv, has_adv)  # aligned values may be NaN where masked
            fold.add(acc, "sum_adv", adv.sum(dtype=torch.float64))
            lo, hi = _extremes(adv, has_adv)
        fold.minimum(acc, "adv_min", lo)
        fold.maximum(acc, "adv_max", hi)

    def _ref_sums(self, acc, mb: "_Microbatch") -> None:
        """k3 KL to the reference policy: sum of expm1(ref - logp) - (ref - logp)."""
        if mb.has_ref is mb.m:
            n_ref = mb.n_tok
            mb.lp64 = lpr = mb.lpm.to(torch.float64)
        else:
            n_ref = mb.has_ref.sum()
            lpr = mb.keep(mb.lp, mb.has_ref).to(torch.float64)
        dr = mb.keep(mb.ref, mb.has_ref).to(torch.float64)
        dr.sub_(lpr)  # 0 outside has_ref
        sum_dr = dr.sum()
        fold.add(acc, "n_ref", n_ref)
        fold.add(acc, "sum_ref_kl", dr.expm1_().sum() - sum_dr)

    def _ratio_sums(self, acc, mb: "_Microbatch", seq_parts: List[torch.Tensor]) -> None:
        """Log-ratio d = logp - old_logp: its sums and extremes, clip counts (or GSPO's
        per-sequence parts), ratio and k3 KL sums."""
        m, adv, has_adv, has_old = mb.m, mb.adv, mb.has_adv, mb.has_old
        if has_old is m:
            n_old = mb.n_tok
            lpo = mb.lp64 if mb.lp64 is not None else mb.lpm.to(torch.float64)
        else:
            n_old = has_old.sum()
            lpo = mb.keep(mb.lp, has_old).to(torch.float64)
        oldm = mb.keep(mb.old, has_old)
        d = lpo.clone() if lpo is mb.lp64 else lpo
        d.sub_(oldm)  # exact in float64; 0 outside has_old
        sum_d = d.sum()
        fold.add(acc, "n_old", n_old)
        fold.add(acc, "sum_old", oldm.sum(dtype=torch.float64))
        fold.add(acc, "sum_diff", sum_d)
        # exp is monotone and k3 convex with its minimum at d = 0: the extremes of
        # d give ratio_min/max and kl_max (in compute), with no [b, s] r or k3.
        lo, hi = _extremes(d, has_old)
        fold.minimum(acc, "logr_min", lo)
        fold.maximum(acc, "logr_max", hi)
        if adv is not None:
            gate = has_old if has_adv is m else has_old & has_adv
            if self.nan_policy != "skip":
                # Under 'propagate' a NaN/inf d or A must not vanish in a comparison
                # (NaN < x is False): 0, or NaN when a gated token holds one.
                # (d + A is NaN/inf iff either is; * 0 turns inf into NaN)
                fold.add(acc, "clip_nan", torch.where(gate, d + adv, 0.0).sum() * 0.0)
            if self.sequence_level_clip:
                g = gate.to(torch.float64)
                seq_parts.append(torch.stack([(d * g).sum(1), g.sum(1),
                                              torch.where(gate, adv.to(torch.float64), 0.0).sum(1)], 1))
            else:
                extra = None if self._zero_unclipped else has_old
                if has_adv is not m:
                    extra = has_adv if extra is None else extra & has_adv
                low, high = self._clip_counts(d, adv, extra)
                fold.add(acc, "clip_n", n_old if gate is has_old else gate.sum())
                fold.add(acc, "clip_low", low)
                fold.add(acc, "clip_high", high)
        # r - 1, in place unless the top-k records or the histograms still need d
        em = torch.expm1(d) if self.top_k_kl or self.quantiles else d.expm1_()
        sum_em = em.sum()
        fold.add(acc, "sum_kl", sum_em - sum_d)  # sum of k3 = (r - 1) - d
        fold.add(acc, "sum_ratio", sum_em + n_old)
        mb.d, mb.ratio_m1 = d, em

    def _quantile_counts(self, acc, mb: "_Microbatch") -> None:
        """Histogram counts of the per-token ratio r = 1 + (r - 1) and k3 = (r - 1) - d over
        the tokens with an old log-prob (after ``_ratio_sums``), and of the entropy."""
        if mb.ratio_m1 is not None:
            fold.add(acc, "hist_ratio", RATIO_HISTOGRAM.counts(mb.ratio_m1 + 1.0, mb.has_old))
            fold.add(acc, "hist_kl", KL_HISTOGRAM.counts(mb.ratio_m1 - mb.d, mb.has_old))
        if mb.ent is not None:
            fold.add(acc, "hist_entropy", ENTROPY_HISTOGRAM.counts(mb.ent, mb.em))

    #: clip counts gated by the advantage sign (GRPO/PPO); CISPO clips the weight itself
    clip_by_advantage_sign = True

    def _clip_counts(self, d, adv, gate=None):
        """Counts of clipped-low and clipped-high units from log-ratios d (r = e^d):
        r < 1 - epsilon (and A < 0), r > 1 + epsilon_high (and A > 0).

        ``d`` is 0 outside the units with an old log-prob and a scattered A is 0
        outside the units that have one, so with epsilons >= 0 no gate is needed;
        ``gate`` is applied when one is.
        """
        lo, hi = self._log_bounds
        low, high = d < lo, d > hi
        if gate is not None:
            low, high = low & gate, high & gate
        if not self.clip_by_advantage_sign:
            return low.sum(), high.sum()
        if adv.dim() == 2 and adv.shape[1] == 1 and d.shape[1] != 1:
            # one advantage per sequence: count per row, then weight rows by the sign
            return (low.sum(1) * (adv[:, 0] < 0)).sum(), (high.sum(1) * (adv[:, 0] > 0)).sum()
        return (low & (adv < 0)).sum(), (high & (adv > 0)).sum()

    @property
    def _log_bounds(self):
        """(log(1 - epsilon), log(1 + epsilon_high)): r < 1 - eps <=> d < log(1 - eps)."""
        lo = math.log(1 - self.epsilon) if self.epsilon < 1 else -math.inf
        hi = math.log1p(self.epsilon_high) if self.epsilon_high > -1 else -math.inf
        return lo, hi

    @property
    def _zero_unclipped(self) -> bool:
        """d = 0 (r = 1) is never clipped, so tokens with d = 0 need no gate (epsilons >= 0)."""
        lo, hi = self._log_bounds
        return lo <= 0 <= hi

    def _sequence_clip(self, parts: torch.Tensor) -> Dict[str, Any]:
        """GSPO: gates on exp(mean d) per sequence, from whole-sequence sums over CP."""
        group = self.sequence_group()
        parts = cp_sum(parts, group)
        if group is not None and group_rank(group) != 0:
            return {}  # every CP rank now holds the same totals; count each sequence once
        n = parts[:, 1]
        valid = n > 0
        safe = torch.where(valid, n, 1.0)
        logr = parts[:, 0] / safe
        adv = parts[:, 2] / safe
        low, high = self._clip_counts(logr, adv, valid)
        return {"clip_n": valid.sum(), "clip_low": low, "clip_high": high}

    def _candidates(self, mb: "_Microbatch", key: torch.Tensor, seq_start: int) -> torch.Tensor:
        """This microbatch's top-k rows [k, fields] in ``_FIELDS`` order, with sequence indices
        offset so far; ``key`` [b, s]: each token's k3 where it has an old log-prob and k3 > 0,
        else -inf. Token and position ids where the features give them, else -1 and the column."""
        b, s = mb.m.shape
        val, idx = _top(key.reshape(-1), self.top_k_kl)
        i, p = idx.div(s, rounding_mode="floor"), idx.remainder(s)
        labels, positions = self._feature_view(mb, "labels"), self._feature_view(mb, "position_ids")
        tok = torch.full_like(p, -1) if labels is None else labels[i, p]
        pos = p if positions is None else positions[i, p]
        gsi = i + seq_start + self._states["n_seq"].to(i.device, non_blocking=True)
        lp_k, old_k = mb.lp[i, p].to(torch.float64), mb.old.expand(b, s)[i, p].to(torch.float64)
        # one stack casts the integer columns to float64 (exact below 2**53)
        return torch.stack([val, gsi, pos, tok, torch.exp(lp_k - old_k), lp_k, old_k], 1)

    def _fused_candidates(self, records: torch.Tensor) -> torch.Tensor:
        """The top-k rows of every fused microbatch at once, from the kernel's record buffer
        (``triton_rl.RECORD_ROWS``, in ``_FIELDS`` order with the sequence within the call in
        place of the global one): one top-k, one gather and one add however many microbatches."""
        idx = _top(records[0], self.top_k_kl)[1]
        rows = records[:, idx]
        rows[1] += self._states["n_seq"].to(rows.device, non_blocking=True)  # the global sequence index
        return rows.t()

    @staticmethod
    def _feature_view(mb: "_Microbatch", field: str) -> Optional[torch.Tensor]:
        """``field`` of the microbatch's features as a ``[b, s]`` view over its tokens (a 1-D
        one holds for every sequence), or None when absent."""
        x = mb.feat.get(field)
        if x is None:
            return None
        b, s = mb.m.shape
        x = as_tensor(x, mb.m.device)
        x = x.unsqueeze(0) if x.dim() == 1 else x
        return x.expand(b, -1)[:, :s]

    def _entropy_chunks(self, name, jobs):
        """(row chunks of every job's logits, job shapes): validated, no collective."""
        blocks, shapes = [], []
        for i, logits, m in jobs:
            z = as_tensor(logits, m.device)
            if z.dim() == 2:
                z = z.unsqueeze(0)
            if z.dim() != 3 or z.shape[0] != m.shape[0] or z.shape[1] < m.shape[1]:
                raise ValueError(f"{name}: outputs['logits'] of microbatch {i} has shape "
                                 f"{list(z.shape)}; expected [{m.shape[0]}, >= {m.shape[1]}, vocab] "
                                 "aligned with the log-probs")
            blocks.append(entropy.row_blocks(z[:, :m.shape[1]]))
            shapes.append(m.shape)
        chunks = [c for job in blocks for block in job
                  for c in torch.split(block, entropy.rows_per_chunk(
                      block, sum(b.shape[0] for b in job), self.entropy_chunk_bytes, self.entropy_chunk_size))]
        return chunks, shapes

    def tp_mismatch_hint(self):
        """Why TP replicas may disagree (used by ``calculate()``'s check)."""
        if self.entropy_from_logits and not self.vocab_parallel:
            return ("with entropy_from_logits, logits that are vocab-sharded over the TP group "
                    "need vocab_parallel=True")
        return None

    # ----------------------------------------------------------------- merge
    def merge(self, rows):
        if self.top_k_kl:
            rows = dict(rows)
            counts = rows["n_seq"].to(torch.float64)
            dp, cp = rows["dp_index"], rows["cp_index"]
            # Sequences before rank j's: those of every DP rank below it, counted once per
            # CP group (CP ranks share sequences).
            first = torch.where(cp == 0, counts, torch.zeros_like(counts))
            offset = ((dp[None, :] < dp[:, None]).to(torch.float64) * first[None, :]).sum(1)
            topk = rows["topk"].clone()
            topk[:, :, 1] += offset[:, None]
            rows["topk"] = topk
        return super().merge(rows)

    def _rebase(self, later, earlier):
        # records made after the hand-off counted sequences from 0: they come after earlier's
        if self.top_k_kl and "topk" in later:
            topk = later["topk"].clone()
            topk[:, 1] += earlier._states["n_seq"].to(topk.device, topk.dtype)
            later = {**later, "topk": topk}
        return later

    def _merge_reads(self):
        # merge() only places the top-k records; every other state merges on its own
        return ("topk", "n_seq", "dp_index", "cp_index") if self.top_k_kl else ()

    # ---------------------------------------------------------------- compute
    def compute(self, s):
        out: Dict[str, Any] = {"train/nonfinite_tokens": int(s["n_bad"])} if s["n_bad"] else {}
        if not s["n_tok"]:
            return out
        mean_new = s["sum_new"] / s["n_tok"]
        out.update({"train/policy_confidence": _exp(mean_new), "train/mean_new_logp": mean_new})
        n = s["n_old"]
        if n:
            out.update({
                "train/mean_old_logp": s["sum_old"] / n,
                "train/logp_diff_mean": s["sum_diff"] / n,
                "train/approx_kl": s["sum_kl"] / n,
                "train/token_kl_max": max(_k3(s["logr_max"]), _k3(s["logr_min"]), key=_nan_first),
                "train/token_ratio_max": _exp(s["logr_max"]),
                "train/ratio_mean": s["sum_ratio"] / n,
                "train/ratio_min": _exp(s["logr_min"]),
                "train/ratio_max": _exp(s["logr_max"]),
            })
            if self.quantiles:
                nan = self.nan_policy == "propagate"
                out.update(quantile_keys("train/ratio", RATIO_HISTOGRAM, s["hist_ratio"], self.quantiles, nan))
                out.update(quantile_keys("train/token_kl", KL_HISTOGRAM, s["hist_kl"], self.quantiles, nan))
        if s["n_ent"]:
            out["train/entropy"] = s["sum_ent"] / s["n_ent"]
            if self.quantiles:
                out.update(quantile_keys("train/entropy", ENTROPY_HISTOGRAM, s["hist_entropy"], self.quantiles,
                                         self.nan_policy == "propagate"))
        if s["clip_n"]:
            poison = s["clip_nan"]  # 0.0, or NaN under 'propagate' when a gated token was non-finite
            out["train/clip_ratio_low"] = s["clip_low"] / s["clip_n"] + poison
            out["train/clip_ratio_high"] = s["clip_high"] / s["clip_n"] + poison
            out["train/clip_ratio"] = (s["clip_low"] + s["clip_high"]) / s["clip_n"] + poison
        if s["n_adv"]:
            out["train/advantage_mean"] = s["sum_adv"] / s["n_adv"]
            out["train/advantage_min"] = s["adv_min"]
            out["train/advantage_max"] = s["adv_max"]
        if s["n_ref"]:
            out["train/ref_kl"] = s["sum_ref_kl"] / s["n_ref"]
        if self.top_k_kl:
            records = []
            for row in s["topk"]:
                if row[0] == -math.inf:
                    continue
                rec = dict(zip(_FIELDS, row))
                for f in _INT_FIELDS:
                    rec[f] = int(rec[f])
                records.append(rec)
            if records:
                out["_high_kl_records"] = records
        return out


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
    ``train/clip_ratio*`` count sequences. Under CP the per-sequence sums are
    completed over the CP group first (one agreement and one all_reduce in ``accumulate``; every CP
    rank must call it the same number of times). Other keys are as GRPOMetric.

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


class _Microbatch:
    """One prepared microbatch's tensors while ``_sums`` works through it: the inputs
    (masks may be narrowed by the NaN policy) and values shared between its steps."""

    def __init__(self, item: Dict[str, Any], logit_ent: Optional[torch.Tensor]):
        self.feat, self.lp, self.m = item["feat"], item["lp"], item["m"]
        self.ent, self.em = (item["ent"], item["em"]) if logit_ent is None else (logit_ent, item["m"])
        self.adv, self.has_adv = item["adv"], item["has_adv"]
        self.ref, self.has_ref = item["ref"], item["has_ref"]
        self.old, self.has_old = item["old"], item["has_old"]
        self.n_tok = self.lpm = self.lp64 = self.d = self.ratio_m1 = None
        self.seq0 = 0  # the index of its first sequence in the call
        self._bits: Dict[tuple, torch.Tensor] = {}

    def keep(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` with masked-out positions +0.0; one bit mask per (mask, element width)."""
        key = (id(mask), x.element_size())
        if key not in self._bits:
            self._bits[key] = keep_bits(mask, x.dtype)
        return masked(x, self._bits[key])


def _floating(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.to(torch.float64)


def _extremes(x: torch.Tensor, has: torch.Tensor):
    """(min, max) of x over ``has`` (+inf, -inf when empty), without a host read."""
    x = x.to(torch.float64)
    buf = torch.where(has, x, math.inf)
    lo = buf.amin()
    return lo, torch.where(has, x, x.new_full((), -math.inf), out=buf).amax()  # one buffer for both


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
