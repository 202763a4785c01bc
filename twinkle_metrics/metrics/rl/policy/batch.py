"""One call of the policy family, prepared: ``prepare`` validates and aligns the inputs of
every microbatch into a ``Batch`` (nothing communicated, nothing folded); ``Microbatch`` is
one of them while ``sums.call_sums`` works through it."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, cast

import torch

from twinkle_metrics.inputs.checks import as_tensor, float_tensor, floating_tensor
from twinkle_metrics.inputs.data_format import Inputs, Outputs, SideInput
from twinkle_metrics.inputs.microbatch import has_field, microbatches
from twinkle_metrics.inputs.rl import (
    common_length,
    float_dtype,
    keep_bits,
    masked,
    per_token,
    split_side_input,
    token_mask,
)
from twinkle_metrics.kernels import entropy
from twinkle_metrics.metrics.rl.policy.table import SEQ_COUNTS, SEQ_SUMS, Config
from twinkle_metrics.metrics.vocab import reach


class Batch(NamedTuple):
    """One call's inputs, validated and aligned: per microbatch a dict (feat, o, lp, m, ent,
    em, adv, has_adv, ref, has_ref, old, has_old), the sequences of each, and GSPO's
    sequences to complete over CP."""

    items: List[Dict[str, Any]]
    sizes: List[int]
    n_seq_parts: int


class Microbatch:
    """One prepared microbatch's tensors while ``call_sums`` works through it: the inputs
    (masks may be narrowed by the NaN policy) and values shared between its steps."""

    def __init__(self, item: Dict[str, Any], logit_ent: Optional[torch.Tensor]) -> None:
        self.feat, self.lp, self.m = item["feat"], item["lp"], item["m"]
        self.ent: Any = item["ent"] if logit_ent is None else logit_ent  # entropies and their mask, or None
        self.em: Any = item["em"] if logit_ent is None else item["m"]
        self.adv, self.has_adv = item["adv"], item["has_adv"]
        self.ref, self.has_ref = item["ref"], item["has_ref"]
        self.old, self.has_old = item["old"], item["has_old"]
        # tensors the steps of ``call_sums`` leave for the next ones (None until then)
        self.n_tok: Any = None
        self.lpm: Any = None
        self.lp64: Any = None
        self.d: Any = None
        self.ratio_m1: Any = None
        self.seq0 = 0  # the index of its first sequence in the call
        self._bits: Dict[tuple, torch.Tensor] = {}
        #: per-sequence token sums and counts (``SEQ_SUMS``, ``SEQ_COUNTS``) under a
        #: sequence-aggregated loss_agg_mode, else None
        self.rows: Optional[Dict[str, torch.Tensor]] = None

    def total(self, key: str, x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``x.sum()``; under a sequence mode also its per-row sums as ``rows[key]``, the
        total taken from them (one [b, s] pass either way)."""
        if self.rows is None:
            return x.sum() if dtype is None else x.sum(dtype=dtype)
        per = x.sum(1) if dtype is None else x.sum(1, dtype=dtype)
        self.rows[key] = per
        return per.sum()

    def same(self, key: str, like: str, value: torch.Tensor) -> torch.Tensor:
        """``value``, a total already taken as ``rows[like]`` (the same mask): its rows too."""
        if self.rows is not None:
            self.rows[key] = self.rows[like]
        return value

    def table(self) -> torch.Tensor:
        """``[b, F + G + 1]`` float64: ``SEQ_SUMS``, ``SEQ_COUNTS`` (0 where an input is
        absent) and the token capacity of each row (the mask's length)."""
        b, s = self.m.shape
        zero = torch.zeros(b, dtype=torch.float64, device=self.m.device)
        names = [c for c, _ in SEQ_SUMS] + list(SEQ_COUNTS)
        rows = cast(Dict[str, torch.Tensor], self.rows)  # set: only a sequence mode asks for the table
        cols = [rows.get(k, zero).to(torch.float64) for k in names]
        return torch.stack(cols + [torch.full_like(zero, float(s))], 1)

    def keep(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` with masked-out positions +0.0; one bit mask per (mask, element width)."""
        key = (id(mask), x.element_size())
        if key not in self._bits:
            self._bits[key] = keep_bits(mask, x.dtype)
        return masked(x, self._bits[key])


def prepare(cfg: Config, inputs: Inputs, outputs: Outputs, old_logps: SideInput, advantages: SideInput,
            ref_logps: Any, ref_outputs: Outputs) -> Batch:
    """This call's inputs, validated and aligned per microbatch; communicates nothing."""
    name = cfg.name
    if ref_outputs is not None:
        if ref_logps is not None:
            raise ValueError(f"{name}: got both ref_logps= and ref_outputs=; pass one")
        if not isinstance(ref_outputs, Mapping) or ref_outputs.get("logps") is None:
            got = sorted(map(str, ref_outputs)) if isinstance(ref_outputs, Mapping) else \
                type(ref_outputs).__name__
            raise ValueError(f"{name}: ref_outputs must be a dict with 'logps' (the reference model's "
                             f"per-token log-probs), got {got}; or pass ref_logps= directly")
        ref_logps = ref_outputs["logps"]
    empty = Batch([], [], 0)
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
        mask = token_mask(name, feat, cfg.ignore_index, lp.device)
        full_lens.append(mask.shape[1])
        lp, mask = common_length(name, "outputs['logps']", lp, mask)
        lps.append(lp.to(float_dtype(lp.dtype)))
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
            ent = ent if ent.is_floating_point() else ent.to(torch.float64)
        elif cfg.entropy_from_logits and o.get("logits") is not None:
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
            if cfg.sequence_level_clip and old is not None and adv is not None:
                n_parts += m.shape[0]
        items.append(dict(feat=feat, o=o, lp=lp, m=m, ent=ent, em=em, adv=adv, has_adv=has_adv,
                          ref=ref, has_ref=has_ref, old=old, has_old=has_old))
    return Batch(items, sizes, n_parts)


def entropy_jobs(cfg: Config, batch: Batch) -> list:
    """``(microbatch index, logits, mask)`` of the microbatches whose entropy comes from logits."""
    if not cfg.entropy_from_logits:
        return []
    return [(i, item["o"]["logits"], item["m"]) for i, item in enumerate(batch.items)
            if item["ent"] is None and "logits" in item["o"]]


def entropy_chunks(cfg: Config, jobs: list) -> Tuple[List[torch.Tensor], List[torch.Size]]:
    """(row chunks of every job's logits, job shapes): validated, no collective."""
    blocks, shapes = [], []
    for i, logits, m in jobs:
        z = as_tensor(logits, m.device)
        if z.dim() == 2:
            z = z.unsqueeze(0)
        if z.dim() != 3 or z.shape[0] != m.shape[0] or z.shape[1] < m.shape[1]:
            raise ValueError(f"{cfg.name}: outputs['logits'] of microbatch {i} has shape "
                             f"{list(z.shape)}; expected [{m.shape[0]}, >= {m.shape[1]}, vocab] "
                             "aligned with the log-probs")
        blocks.append(entropy.row_blocks(z[:, :m.shape[1]]))
        shapes.append(m.shape)
    chunks = [c for job in blocks for block in job
              for c in torch.split(block, entropy.rows_per_chunk(
                  block, sum(b.shape[0] for b in job), cfg.entropy_chunk_bytes, cfg.entropy_chunk_size))]
    return chunks, shapes


def label_reach(items: List[Dict[str, Any]], jobs: list) -> Dict[str, Any]:
    """How far the labels of the microbatches with logits reach (``metrics.vocab``)."""
    labels, masks = [], []
    for i, _, m in jobs:
        lab = items[i]["feat"].get("labels")
        if lab is None:
            continue
        lab = as_tensor(lab, m.device)
        lab = (lab.unsqueeze(0) if lab.dim() == 1 else lab).expand(m.shape[0], -1)[:, :m.shape[1]]
        labels.append(lab)
        masks.append(m[:, :lab.shape[1]])
    return reach(labels, masks, [int(logits.shape[-1]) for _, logits, _ in jobs]) or {}
