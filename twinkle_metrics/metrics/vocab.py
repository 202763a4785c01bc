"""How far the labels reach into the logits' vocab: the check that catches vocab-sharded
logits given without ``vocab_parallel=True`` from the first interval.

A metric that reads logits keeps two ``"max"`` states (``VOCAB_STATES``): the largest
label id it counted and the logits' last dimension. Both ride in the fused sync; in
``accumulate`` the first is a device reduction (no host read), the second a shape.
``check_reach`` in ``compute`` sees the reduced numbers, the same on every rank, so
every rank raises alike: labels past the last dimension mean the logits hold part of
the vocab (TP shards) or the labels are out of range, and no accuracy or entropy
computed from them is right, whether or not the TP replicas' counts happen to agree.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from parallel.groups import ProcessGroup
from twinkle_metrics.comm import agreement as exchange
from twinkle_metrics.core.state import State
from twinkle_metrics.inputs.microbatch import join
from twinkle_metrics.kernels.argmax import INDEX_LIMIT


def vocab_states() -> Dict[str, State]:
    """The two states: the largest label id counted, and the logits' last dimension."""
    return {"label_reach": State("max", torch.int64), "vocab_width": State("max", torch.int64)}


def reach(labels: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], widths: Sequence[int],
          vocab_parallel: bool = False) -> Optional[Dict[str, object]]:
    """Contributions of one call: the largest counted label id (a device scalar) and the
    widest logits' last dimension (a host int); ``None`` with no microbatch, or with
    ``vocab_parallel`` (shards may be uneven, so TP replicas' widths differ, and the
    vocab-parallel collectives see the whole vocab: nothing to catch)."""
    if not widths or vocab_parallel:
        return None
    lab, mask = join(list(labels)), join(list(masks))
    if lab.numel() == 0:
        return {"vocab_width": max(widths)}
    counted = torch.where(mask, lab.to(torch.int64), torch.full_like(lab, -1, dtype=torch.int64))
    return {"label_reach": counted.amax(), "vocab_width": max(widths)}


def check_reach(metric: str, s: Mapping[str, Any], vocab_parallel: bool, tp_size: int, what: str) -> None:
    """Raise when the counted labels run past the logits' vocab (on every rank: ``s`` is
    the reduced states). ``what`` names the number that would be wrong."""
    top, width = s.get("label_reach"), s.get("vocab_width")
    if vocab_parallel or top is None or width is None or width <= 0 or top < 0 or top < width:
        return
    if tp_size > 1:
        fix = (f"the logits look vocab-sharded over the TP group of {tp_size} ranks (Megatron's "
               "[b, s, v/tp] shards): pass vocab_parallel=True")
    else:
        fix = ("labels must be token ids below the vocab size (or ignore_index); if the logits are a "
               "vocab shard, pass vocab_parallel=True with the mesh's TP group")
    raise ValueError(f"{metric}: labels reach id {top} but the logits' last dimension is {width}, so "
                     f"{what} cannot be right; {fix}. The interval is kept")


def agree_shards(metric: Any, group: ProcessGroup, logits: Sequence[torch.Tensor]) -> None:
    """Agree over the TP ``group`` before a vocab-parallel argmax: TP peers must hold the same
    tokens, vocab shard width and precision, or every one of them raises (the collective
    would mismatch). ``logits``: this call's shards (none: 0 tokens of width 0)."""
    name = type(metric).__name__
    widths = {int(x.shape[-1]) for x in logits}
    if len(widths) > 1:
        raise ValueError(f"{name}: vocab-parallel logits shards have different widths {sorted(widths)}; "
                         "every microbatch must hold the same vocab shard")
    n = sum(x[..., 0].numel() for x in logits)
    width = widths.pop() if widths else 0
    wide = int(any(x.dtype == torch.float64 for x in logits))
    if n >= 1 << 31 or width * dist.get_world_size(group) > INDEX_LIMIT:
        raise ValueError(f"{name}: {n} tokens of vocab shard {width} exceed the packed 32-bit sizes "
                         "(2**31 tokens per call, 2**32 vocab entries)")
    key = (n << 32) | (width << 1) | wide  # one key: equal on every rank iff max == min
    low, high = exchange.agree_same(metric, group, key)
    if low != high:
        def shape(k):
            return f"{k >> 32} tokens x vocab shard {(k & INDEX_LIMIT) >> 1}" + (" (fp64)" if k & 1 else "")
        raise ValueError(f"{name}: TP ranks hold different vocab-parallel logits ({shape(low)} "
                         f"to {shape(high)}; this rank {shape(key)}); every rank of a TP group must "
                         "pass the same tokens with its own equal vocab shard; nothing was accumulated")
