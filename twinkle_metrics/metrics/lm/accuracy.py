"""``Accuracy``: token accuracy, exact under data, context and tensor (vocab) parallelism."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch

from parallel import MeshLike
from parallel.groups import ProcessGroup
from twinkle_metrics.comm import agreement as exchange
from twinkle_metrics.core.metric import Metric
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.checks import floating_tensor, int_tensor, right_align
from twinkle_metrics.inputs.data_format import Inputs, Outputs
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.inputs.microbatch import has_field, host_array, join, microbatches
from twinkle_metrics.kernels.argmax import joined_hits, vocab_parallel_argmax
from twinkle_metrics.metrics.vocab import agree_shards, check_reach, reach

_NAME = "Accuracy"


_ALIGNS = ("exact", "right")


class Accuracy(Metric):
    """Token accuracy: ``sum(m * [argmax(logits) == label]) / sum(m)``.

    ``m`` is ``completion_mask`` when the input has one, else ``labels != ignore_index``.
    Labels and mask must have the logits' shape ``[b, s]``: labels longer than the logits
    (the classic one-position shift between unshifted labels and logits of all positions but
    the last) raise instead of being guessed. ``align="right"`` keeps Twinkle's behaviour:
    labels and mask longer than the logits are cut to their last positions (logits of the
    last positions only, e.g. ``logits_to_keep``). Keys: ``accuracy`` (a fraction in [0, 1]),
    ``correct_tokens``, ``total_tokens``; ``{}`` when no token counted.

    Differences from Twinkle: accepts ``List[InputFeature]`` (pipeline microbatches)
    and ``[]`` (non-last stages); plain numbers instead of ``'0.50'``; no ``.item()``
    per call; counts reduced exactly over the data group (DP x CP), never over TP.

    Vocab parallelism (``vocab_parallel=True``): logits are Megatron's vocab shards
    ``[b, s, v/tp]`` (shard ``tp_rank`` covers ``[tp_rank * v/tp, (tp_rank+1) * v/tp)``)
    and the argmax is taken over the whole vocab with one collective per
    ``accumulate`` over the mesh's TP group (see ``vocab_parallel_argmax``), after a
    host-side agreement over the group's CPU twin (``twinkle_metrics.comm.agreement``), with
    ``torch.argmax``'s rules (lowest index among ties, NaN is the largest). bf16/fp16
    values are compared exactly (in fp32); fp64 logits are compared in fp64 with two
    collectives. The caller must make every rank of a TP group call ``accumulate``
    the same number of times, also when a rank has nothing (pass ``[]``): pipeline
    stages that never produce logits should call it on all of their TP ranks or
    on none.

    Labels past the logits' last dimension (vocab-sharded logits without
    ``vocab_parallel=True``, or ids out of range) make ``calculate()`` raise on every
    rank, from the first interval: the largest counted label id and the logits' width
    are two ``"max"`` states of the same fused sync (``metrics.vocab``).

    Memory: the argmax reads the logits once in their own dtype; no softmax and no
    fp32 copy of ``[b, s, V]`` is made (only ``[b, s]`` values and indices).

    Args:
        vocab_parallel: logits are sharded along the vocab over the mesh's TP group.
        ignore_index: label value of tokens without a target.
        align: ``"exact"`` (default: labels match the logits' positions) or ``"right"``
            (Twinkle's: longer labels keep their last positions).

    Example:
        >>> import torch
        >>> logits = torch.tensor([[[0.1, 2.0, 0.3], [1.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])
        >>> m = Accuracy()
        >>> _ = m.accumulate({"labels": torch.tensor([[1, 2, -100]])}, {"logits": logits})
        >>> m.calculate()
        {'accuracy': 0.5, 'correct_tokens': 1, 'total_tokens': 2}
    """

    reads = Reads(inputs=("labels", "completion_mask?"), outputs=("logits",))
    result_keys = ('accuracy', 'correct_tokens', 'total_tokens',)

    correct = State("sum", torch.int64)
    total = State("sum", torch.int64)
    label_reach = State("max", torch.int64)  # the largest label id counted
    vocab_width = State("max", torch.int64)  # the logits' last dimension
    unsliced_states = ("label_reach", "vocab_width")  # checked in compute (metrics.vocab)

    def __init__(self, device_mesh: MeshLike = None, process_group: ProcessGroup = None,
                 *, vocab_parallel: bool = False, ignore_index: int = -100, align: str = "exact",
                 **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.vocab_parallel = bool(vocab_parallel)
        self.ignore_index = ignore_index
        if align not in _ALIGNS:
            raise ValueError(f"{_NAME}: align must be one of {_ALIGNS}, got {align!r}")
        self.align = align
        # the vocab-parallel argmax runs over TP: agreed on in every update
        self.agree_over = ("tp",) if self.vocab_parallel else ()
        if not self.vocab_parallel:  # why TP replicas' counts could differ
            self.tp_mismatch_hint = "logits look vocab-sharded over the TP group: pass vocab_parallel=True"

    def update(self, inputs: Inputs, outputs: Outputs, **kwargs: Any) -> Dict[str, Any]:
        with exchange.guard(self):
            work = self._validate(inputs, outputs)
            for group in self.exchange_groups():
                agree_shards(self, group, [w[0] for w in work])
        hits = self._hits(work)
        if hits is None:  # no work
            return {}
        # every microbatch's tokens at once: a fixed number of launches beyond the kernels
        mask = join([m for _, _, m in work])
        out: Dict[str, Any] = {"correct": (hits & mask).sum(), "total": mask.sum()}
        out.update(reach([lab for _, lab, _ in work], [m for _, _, m in work],
                         [int(x.shape[-1]) for x, _, _ in work], self.vocab_parallel) or {})
        return out

    def _validate(self, inputs, outputs):
        """[(logits, labels, mask)] of this call; raises on bad input, communicates nothing."""
        if inputs is None and has_field(outputs, "logits"):
            raise ValueError(f"{_NAME}: labels missing: outputs have logits but inputs is None; pass the "
                             "InputFeature (or list of them) with labels")
        pairs = microbatches(_NAME, inputs, outputs, ("logits",))
        work = []  # (logits, labels, mask)
        for i, (feat, out) in enumerate(pairs):
            logits = out.get("logits")
            if logits is None:
                continue  # Twinkle skips calls without logits
            where = f"microbatch {i}" if len(pairs) > 1 else "the batch"
            logits = floating_tensor(_NAME, "logits", logits)
            if logits.dim() < 2 or logits.shape[-1] == 0:
                raise ValueError(f"{_NAME}: logits must be [..., vocab] with a vocab of at least one entry, "
                                 f"got shape {list(logits.shape)}")
            target = list(logits.shape[:-1])
            if feat.get("labels") is None:
                raise ValueError(f"{_NAME}: labels missing in {where}: expected labels of shape {target} "
                                 f"for logits {list(logits.shape)}; got keys {sorted(feat)}")
            labels = int_tensor(_NAME, "labels", feat["labels"], logits.device)
            labels = self._aligned("labels", labels, target, logits)
            mask = feat.get("completion_mask")
            if mask is not None:
                # any real dtype: nonzero marks a counted token (mask.bool())
                mask = host_array(_NAME, "completion_mask", mask)
                if mask.is_complex():
                    raise TypeError(f"{_NAME}: completion_mask must be bool, integer or float, got {mask.dtype}")
                mask = mask.to(logits.device, non_blocking=True)
                mask = self._aligned("completion_mask", mask, target, logits) != 0
            else:
                mask = labels != self.ignore_index
            work.append((logits, labels, mask))
        return work

    def _aligned(self, field: str, value: torch.Tensor, target, logits: torch.Tensor) -> torch.Tensor:
        """``value`` (labels or mask) against the logits' ``[b, s]``: equal, or, with
        ``align="right"``, longer and cut to its last positions."""
        got = list(value.shape)
        if got == target or self.align == "right":
            return right_align(_NAME, field, value, target, f"logits {list(logits.shape)}")
        longer = len(got) == len(target) and got[:-1] == target[:-1] and got[-1] > target[-1]
        fix = (f"pass {field} aligned to the logits (for logits that predict the next token, labels[..., 1:] "
               f"of unshifted labels), or build Accuracy(align='right') to keep the last {target[-1]} positions "
               "as Twinkle does (logits of the last positions only)") if longer else \
            f"pass {field} of shape {target}"
        raise ValueError(f"{_NAME}: {field} {got} do not match logits {list(logits.shape)}: expected {target}; {fix}")

    def _hits(self, work) -> Optional[torch.Tensor]:
        """bool ``argmax == label`` of every microbatch's tokens, flattened and joined in
        order (the compare fused in the Triton path, which writes one buffer for all)."""
        if not self.vocab_parallel:
            return joined_hits([(logits, labels) for logits, labels, _ in work]) if work else None
        mesh = self.resolve_mesh()
        # Always enter the TP collective (even with nothing), so TP ranks stay in step.
        preds = vocab_parallel_argmax([w[0] for w in work], mesh.tp_group, mesh.tp_rank, mesh.tp_size)
        return join([pred == labels for pred, (_, labels, _) in zip(preds, work)]) if work else None

    def compute(self, s: Mapping[str, Any]) -> Dict[str, Any]:
        check_reach(_NAME, s, self.vocab_parallel, self.resolve_mesh().tp_size, "the accuracy")
        if not s["total"]:
            return {}
        return {"accuracy": s["correct"] / s["total"], "correct_tokens": s["correct"],
                "total_tokens": s["total"]}
