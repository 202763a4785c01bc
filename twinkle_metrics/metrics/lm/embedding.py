"""``EmbeddingMetric``: InfoNCE similarity statistics over the whole data group."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping

import torch
import torch.nn.functional as F

from parallel import MeshLike, comm_device
from parallel.groups import ProcessGroup, all_gather_rows, group_rank, group_size
from twinkle_metrics.comm import agreement as exchange
from twinkle_metrics.core.config import Schema
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import as_count, f64, int_tensor, is_bad, nonfinite, pick, plus, scalar
from twinkle_metrics.inputs.checks import nan_policy as check_nan_policy
from twinkle_metrics.inputs.data_format import Inputs, Outputs
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.inputs.microbatch import as_feature_list, has_field, microbatches
from twinkle_metrics.inputs.rl import cp_lead

_NAME = "EmbeddingMetric"


class EmbeddingMetric(Metric):
    """Anchor/positive similarity statistics for contrastive (InfoNCE) training.

    Rows of ``outputs['embeddings']`` (``[n, d]``, or ``[n, s, d]`` whose first
    token is taken; ``outputs['logits']`` as a fallback, as in Twinkle) pair with
    ``labels`` (``[n]`` per batch): a label > 0 marks an anchor, and the positive of
    the anchor in row ``i`` is row ``i + 1`` of the same batch (an anchor in the last
    row has none and is ignored). Keys (Twinkle's):

    * ``pos_sim``, ``pos_sim_min``, ``pos_sim_max``: cosine(anchor, its positive).
    * ``neg_sim``: mean cosine between each anchor and every *other* anchor's
      positive in the data-group batch (in-batch negatives). Cosine, like
      ``pos_sim``; Twinkle uses a raw dot product here, which is not comparable
      to ``pos_sim`` unless the embeddings are normalised.
    * ``loss``: mean of ``outputs['loss']`` over the entries seen; ``grad_norm``: MAX
      over ranks of the last value passed.

    Added: ``in_batch_accuracy``: over the anchors that have in-batch negatives, the
    fraction whose own positive is strictly more similar than every one of them
    (top-1 retrieval; a tie counts as a miss; an anchor alone in its batch ranks
    nothing and is left out); ``margin``: mean over anchors that have negatives of
    ``pos - max(neg)`` (positive minus the hardest in-batch negative).

    In-batch statistics span the whole data group (DP x CP, or ``process_group``):
    each rank gathers the normalised positives of every rank of that group (its
    size, not the world size; TP replicas are not mixed in) and scores its own
    anchors against them; the sums are reduced at ``calculate``. Ranks may hold
    different numbers of rows. Per ``accumulate`` call with a data group of more
    than one rank this costs two collectives, on every rank, whatever its data:

    1. a host-side MAX all-reduce of three integers (row count, embedding dim) over
       a CPU group: ``size_group``, else the mesh's ``host_group`` of the data group
       (the data group itself when it is gloo, Megatron's gloo DP x CP group, or a gloo
       group over its ranks made at the first call, lazily connected), so that no rank
       reads the device; without any CPU group it falls back to a device all-reduce
       read on the host (one device wait, warned).
    2. an all-gather of ``[max rows, d + 1]`` float64 (positives and a validity
       column) on the device. Rows past a rank's count and non-anchor rows carry
       validity 0, so statistics are masked arithmetic and no rank branches on data;
       a batch without anchors contributes zeros everywhere, consistently.

    Under context parallelism the pooled embeddings are expected to be complete and
    the same on every rank of a CP group; only CP rank 0's rows count, so pairs are not
    duplicated. Every rank of the data group must call ``accumulate`` the same number
    of times (an empty list ``[]`` where it has nothing), as with Twinkle.

    Non-finite values (``nan_policy``): an embedding row that feeds a statistic (an
    anchor, or the positive of one) and holds a NaN/inf counts as non-finite; other
    rows (non-anchors, padding) are ignored and not counted. ``'propagate'``
    (default): NaN flows into every key the row feeds (``pos_sim*``, ``neg_sim``,
    ``margin``, and ``in_batch_accuracy``, which is NaN rather than a silently False
    comparison). ``'skip'``: every pair that uses the row is dropped (as anchor,
    positive and in-batch negative). Both report ``nonfinite_rows`` when > 0. A NaN/inf
    ``loss`` is likewise kept (NaN ``loss``) or dropped, and counted in
    ``loss_nonfinite``, as ``LossMetric`` does.

    Args:
        size_group: a CPU (gloo) process group over the data-group ranks for the
            row-count exchange; defaults to the mesh's ``host_group`` of the data group.
        eps: lower bound of the norm in the cosine.
        nan_policy: ``'propagate'`` or ``'skip'`` (see above).

    Example:
        >>> import torch
        >>> emb = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
        >>> m = EmbeddingMetric()  # rows 0 and 2 are anchors, rows 1 and 3 their positives
        >>> _ = m.accumulate({"labels": torch.tensor([1, 0, 1, 0])}, {"embeddings": emb})
        >>> {k: round(v, 4) for k, v in m.calculate().items()}  # doctest: +NORMALIZE_WHITESPACE
        {'pos_sim': 0.9, 'pos_sim_min': 0.8, 'pos_sim_max': 1.0, 'in_batch_accuracy': 1.0, 'neg_sim': 0.3,
         'margin': 0.6}
    """

    reads = (Reads(outputs=("embeddings|logits",), context=Reads(inputs=("labels",))), Reads(outputs=("loss?",)),
             Reads(keywords=("grad_norm?",)))
    result_keys = ('pos_sim', 'pos_sim_min', 'pos_sim_max', 'neg_sim', 'loss', 'grad_norm', 'in_batch_accuracy',
                  'margin', 'nonfinite_rows', 'loss_nonfinite',)

    unsliceable = "its in-batch statistics compare every sequence with the whole data-group batch"
    agree_over = ("data",)  # the row-count agreement and the in-batch gather run over it
    schema = Schema(exclude=("size_group",))  # a group to exchange sizes over, not a setting

    pos_sum = State("sum")
    pos_min = State("min")
    pos_max = State("max")
    pos_count = State("sum", torch.int64)
    neg_sum = State("sum")
    neg_count = State("sum")
    top1_correct = State("sum", torch.int64)
    margin_sum = State("sum")
    margin_count = State("sum", torch.int64)
    loss_total = State("sum")
    loss_count = State("sum", torch.int64)
    grad_norm = State("max", local="last")
    n_bad = State("sum", torch.int64)  # non-finite rows
    loss_bad = State("sum", torch.int64)  # non-finite loss entries

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None, *,
                 size_group: ProcessGroup = None, eps: float = 1e-8, nan_policy: str = "propagate",
                 **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.size_group = size_group
        self.eps = eps
        self.nan_policy = check_nan_policy(_NAME, nan_policy)

    def update(self, inputs: Inputs, outputs: Outputs, *, grad_norm: Any = None, **kwargs: Any) -> Dict[str, Any]:
        with exchange.guard(self):
            emb, labels, losses = self._rows(inputs, outputs)
            out: Dict[str, Any] = {}
            if grad_norm is not None:
                out["grad_norm"] = f64(scalar(_NAME, "grad_norm", grad_norm))
            skip = self.nan_policy == "skip"
            for loss in losses:
                loss = f64(loss)
                bad = is_bad(loss)
                out["loss_total"] = plus(out.get("loss_total"), pick(bad, 0.0, loss) if skip else loss)
                out["loss_count"] = plus(out.get("loss_count"), pick(bad, 0, 1, torch.int64) if skip else 1)
                out["loss_bad"] = plus(out.get("loss_bad"), as_count(bad))
            sizes = self._agree_sizes(emb)
        out.update(self._similarities(emb, labels, sizes))
        return out

    # ------------------------------------------------------------ inputs
    def _rows(self, inputs, outputs):
        """(embeddings [n, d] or None, labels [n] or None, [loss values]) of this call."""
        feats = as_feature_list(_NAME, inputs)
        losses: List[Any] = []
        if isinstance(outputs, Mapping):
            outputs = dict(outputs)
            loss = outputs.pop("loss", None)
            if loss is not None and not isinstance(loss, (list, tuple)):
                losses.append(scalar(_NAME, "outputs['loss']", loss))
            elif loss is not None:
                losses += [scalar(_NAME, f"outputs['loss'][{i}]", x) for i, x in enumerate(loss) if x is not None]
            key = "embeddings" if outputs.get("embeddings") is not None else "logits"
            value = outputs.get(key)
            if isinstance(value, torch.Tensor) and len(feats) > 1:
                # One tensor over several microbatches: split by each one's label count
                # (a host-known shape; labels are 1-D here, so batch_size() does not apply).
                sizes = [self._labels(f, i).numel() for i, f in enumerate(feats)]
                if value.shape[0] != sum(sizes):
                    raise ValueError(f"{_NAME}: outputs[{key!r}] has shape {list(value.shape)} but the "
                                     f"{len(feats)} microbatches hold {sum(sizes)} labels ({sizes}); "
                                     "concatenate the rows in microbatch order, or pass a list")
                outputs[key] = list(torch.split(value, sizes, dim=0))
            outputs = {key: outputs[key]} if outputs.get(key) is not None else {}
        elif isinstance(outputs, (list, tuple)):
            for i, o in enumerate(outputs):
                if isinstance(o, Mapping) and o.get("loss") is not None:
                    losses.append(scalar(_NAME, f"outputs[{i}]['loss']", o["loss"]))
        if not feats and has_field(outputs, "embeddings", "logits"):
            raise ValueError(f"{_NAME}: labels missing: outputs have embeddings but inputs is None; pass "
                             "the InputFeature (or list of them) with labels marking anchors")
        rows, labels = [], []
        for i, (feat, o) in enumerate(microbatches(_NAME, feats, outputs, ("embeddings", "logits"))):
            e = o.get("embeddings", o.get("logits"))
            if e is None:
                continue  # Twinkle skips calls without embeddings
            field = "embeddings" if "embeddings" in o else "logits"
            if not isinstance(e, torch.Tensor) or not e.is_floating_point():
                raise TypeError(f"{_NAME}: outputs[{field!r}] must be a floating tensor, got "
                                f"{getattr(e, 'dtype', type(e).__name__)}")
            if e.dim() == 3:
                e = e[:, 0]
            if e.dim() != 2:
                raise ValueError(f"{_NAME}: outputs[{field!r}] must be [n, d] or [n, s, d], got "
                                 f"{list(e.shape)}")
            lab = self._labels(feat, i).to(e.device, non_blocking=True)
            if lab.numel() != e.shape[0]:
                raise ValueError(f"{_NAME}: labels of microbatch {i} have {lab.numel()} entries "
                                 f"(shape {list(lab.shape)}) but {field} have {e.shape[0]} rows "
                                 f"(shape {list(e.shape)}); pass one label per embedding row")
            rows.append(e)
            labels.append(lab)
        if rows and len({r.shape[1] for r in rows}) > 1:
            raise ValueError(f"{_NAME}: microbatch embeddings have different dims "
                             f"{[list(r.shape) for r in rows]}")
        if not rows:
            return None, None, losses
        # A positive never crosses a microbatch boundary: mark the last row of each.
        ends = [torch.arange(lab.numel(), device=lab.device) + 1 < lab.numel() for lab in labels]
        anchors = torch.cat([(lab > 0) & end for lab, end in zip(labels, ends)])
        nxt = torch.cat([torch.roll(r, -1, dims=0) for r in rows])
        return (torch.cat(rows), nxt), anchors, losses

    @staticmethod
    def _labels(feat: Mapping, i: int) -> torch.Tensor:
        if feat.get("labels") is None:
            raise ValueError(f"{_NAME}: labels missing in microbatch {i}: expected a [n] tensor marking "
                             f"anchors with 1; got keys {sorted(feat)}")
        return int_tensor(_NAME, "labels", feat["labels"]).reshape(-1)

    # ------------------------------------------------------------ statistics
    def _agree_sizes(self, rows):
        """(rows, dim) of this rank and the data group's largest; the agreement of this
        metric (``exchange.agree``), raising on every rank when the dims differ."""
        n = rows[0].shape[0] if rows is not None else 0
        d = rows[0].shape[1] if rows is not None else 0
        for group in self.exchange_groups():
            # Host-known shapes only; -d so that the MAX also yields the smallest dim.
            n_max, d_max, neg_d_min = exchange.agree(self, group, values=[n, d, -d if n else -(1 << 62)],
                                                     cpu_group=self.size_group)
            if n_max and d_max != -neg_d_min:
                raise ValueError(f"{_NAME}: ranks of the data group hold embeddings of different dims "
                                 f"({-neg_d_min} to {d_max}); this rank has {d}; nothing was accumulated")
            return n, d, n_max, d_max
        return n, d, n, d

    def _similarities(self, rows, anchors, sizes) -> Mapping[str, Any]:
        n, d, n_max, d_max = sizes
        group = self.data_group()
        size = group_size(group)
        if n_max == 0:
            return {}  # nobody holds rows: every rank knows it and skips the gather alike
        device = rows[0].device if rows is not None else comm_device(group)
        anchor_vec: Any = None  # tensors when this rank holds rows (n > 0)
        pos_local: Any = None
        valid: Any = None
        if n:
            emb, nxt = rows
            anchor_vec = F.normalize(emb.to(torch.float64), dim=-1, eps=self.eps)
            pos_local = F.normalize(nxt.to(torch.float64), dim=-1, eps=self.eps)
            # Pooled embeddings are whole-sequence values, the same on every rank of a CP
            # group: only CP rank 0's rows count (as anchors and as in-batch negatives).
            lead = cp_lead(self)
            valid = anchors.to(torch.float64) * (1.0 if lead else 0.0)
            # Rows that feed a statistic: anchors and their positives (row i + 1 of an anchor).
            row_bad = nonfinite(emb).sum(-1, dtype=torch.int64) > 0
            used = anchors | torch.roll(anchors, 1)
            bad_rows = (used & row_bad).sum() * (1 if lead else 0)
            if self.nan_policy == "skip":
                pair_bad = row_bad | (nonfinite(nxt).sum(-1, dtype=torch.int64) > 0)
                valid = torch.where(pair_bad, 0.0, valid)
            # Rows that do not count are zeroed, so their values (NaN padding, dropped rows)
            # never reach a product with a 0 weight (NaN * 0 is NaN).
            keep = valid[:, None] > 0
            anchor_vec = torch.where(keep, anchor_vec, 0.0)
            pos_local = torch.where(keep, pos_local, 0.0)
        if size > 1:
            buf = torch.zeros(n_max, d_max + 1, dtype=torch.float64, device=comm_device(group))
            if n:
                buf[:n, :d_max] = pos_local
                buf[:n, d_max] = valid
            gathered = all_gather_rows(buf.reshape(-1), group).reshape(size * n_max, d_max + 1)
            positives, col_valid = gathered[:, :d_max].to(device), gathered[:, d_max].to(device)
            own_offset = group_rank(group) * n_max
        else:
            positives, col_valid, own_offset = pos_local, valid, 0
        if not n:
            return {}
        sim = anchor_vec @ positives.T                                   # [n, N]
        own = torch.arange(n, device=device) + own_offset
        pos = (anchor_vec * pos_local).sum(-1)
        is_own = torch.arange(sim.shape[1], device=device).unsqueeze(0) == own.unsqueeze(1)
        neg_mask = valid.unsqueeze(1) * col_valid.unsqueeze(0) * (~is_own).to(torch.float64)
        neg_count = neg_mask.sum(-1)                                     # per anchor
        hardest = torch.where(neg_mask > 0, sim, -torch.inf).amax(-1)
        has_neg = (neg_count > 0) & (valid > 0)
        is_anchor = valid > 0
        return {
            "n_bad": bad_rows,
            "pos_sum": (pos * valid).sum(),
            "pos_min": torch.where(is_anchor, pos, torch.inf).amin(),
            "pos_max": torch.where(is_anchor, pos, -torch.inf).amax(),
            "pos_count": is_anchor.sum(),
            "neg_sum": (sim * neg_mask).sum(),
            "neg_count": neg_count.sum(),
            "top1_correct": (has_neg & (pos > hardest)).sum(),
            "margin_sum": torch.where(has_neg, pos - hardest, 0.0).sum(),
            "margin_count": has_neg.sum(),
        }

    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if s["pos_count"]:
            # 0, or NaN when a NaN row fed the comparisons ('propagate'; NaN > x is False)
            poison = (s["pos_sum"] + s["neg_sum"] + s["margin_sum"]) * 0.0
            out["pos_sim"] = s["pos_sum"] / s["pos_count"]
            out["pos_sim_min"] = s["pos_min"]
            out["pos_sim_max"] = s["pos_max"]
            if s["margin_count"]:  # anchors with negatives: the ones top-1 retrieval ranks
                out["in_batch_accuracy"] = s["top1_correct"] / s["margin_count"] + poison
        if s["neg_count"]:
            out["neg_sim"] = s["neg_sum"] / s["neg_count"]
        if s["margin_count"]:
            out["margin"] = s["margin_sum"] / s["margin_count"]
        if s["loss_count"]:
            out["loss"] = s["loss_total"] / s["loss_count"]
        if s["grad_norm"] != -float("inf"):
            out["grad_norm"] = s["grad_norm"]
        if s["n_bad"]:
            out["nonfinite_rows"] = int(s["n_bad"])
        if s["loss_bad"]:
            out["loss_nonfinite"] = int(s["loss_bad"])
        return out
