"""Vocab-parallel argmax: ``torch.argmax`` over the whole vocab from TP shards.

The argmax of each shard is packed with its value into one int64 key whose MAX
over the shards is the global argmax, so one ``all_reduce`` per ``accumulate``
finds it with no gather of the logits. This torch implementation is the path
everywhere but on CUDA with Triton installed, where ``argmax_triton`` reads the
logits once and emits the index, the label hit or the packed key directly;
float64 logits always stay here.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from parallel import comm_device
from parallel.groups import ProcessGroup
from twinkle_metrics.comm.order import ordered_f32 as _ordered_f32
from twinkle_metrics.comm.order import ordered_f64 as _ordered_f64
from twinkle_metrics.inputs.microbatch import join
from twinkle_metrics.kernels import dispatch as _triton

_NAME = "vocab_parallel_argmax"
_LOW32 = (1 << 32) - 1
#: the largest global vocab the packed 32-bit index holds
INDEX_LIMIT = _LOW32


def argmax_keys(values: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 keys whose MAX over shards picks what ``torch.argmax`` over the whole vocab
    picks: the value made order-preserving in the high 32 bits (NaN largest, -0.0 ==
    +0.0), the reversed global ``index`` in the low 32 bits (lowest index wins a tie).
    For 16/32-bit values; ``vocab`` is the global vocab size."""
    return _ordered_f32(values).to(torch.int64) * (1 << 32) + (vocab - 1 - index)


def argmax_of_keys(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The global index a MAX-reduced ``argmax_keys`` key stands for."""
    return (vocab - 1) - (keys & _LOW32)


def local_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, by the Triton kernel where it applies."""
    if _triton.applies(x):
        out = _triton.attempt("argmax", _argmax_kernel, x)
        if out is not None:
            return out
    return x.argmax(-1)


def argmax_hits(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """bool ``x.argmax(-1) == labels`` (``labels`` shaped like ``x[..., 0]``); the Triton
    kernel fuses the compare so no index tensor is written."""
    if _triton.applies(x) and labels.shape == x.shape[:-1]:
        out = _triton.attempt("argmax", _argmax_kernel, x, labels)
        if out is not None:
            return out
    return x.argmax(-1) == labels


def joined_hits(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """bool ``x.argmax(-1) == labels`` of every ``(x, labels)``, flattened and joined in
    order: on the Triton path one buffer that the kernels write in place (one launch per
    microbatch, nothing to join); else ``argmax_hits`` of each, joined."""
    if pairs and all(_triton.applies(x) and labels.shape == x.shape[:-1] for x, labels in pairs):
        out = _triton.attempt("argmax", _joined_kernel_hits, pairs)
        if out is not None:
            return out
    return join([argmax_hits(x, labels) for x, labels in pairs])


def vocab_parallel_argmax(logits: List[torch.Tensor], group: ProcessGroup, tp_rank: int,
                          tp_size: int) -> List[torch.Tensor]:
    """Global ``argmax(-1)`` of vocab-sharded logits, exactly as ``torch.argmax`` on the full vocab.

    Each rank holds ``[..., V / tp]`` (shard ``tp_rank`` of equal shards). Ties go to
    the lowest global index and NaN counts as the largest value (first NaN wins),
    as ``torch.argmax`` does. No full-vocab gather, no host read.

    Cost: one int64 ``all_reduce(MAX)`` over ``group`` of one value per token for
    16/32-bit logits (the value, made order-preserving, in the high 32 bits; the
    reversed global index in the low 32 bits, so the max picks the lowest index
    among equal values); fp64 logits need two (MAX of the value, then MIN of the
    index among shards holding it) because a 64-bit value leaves no room for the
    index. Every rank of ``group`` must call it the same number of times, also with
    an empty list (a one-element dummy collective then keeps the ranks in step).

    Args:
        logits: per-microbatch local shards; all reduced in one collective.
        group: the TP group (``None``: a single shard, plain argmax).
    """
    if group is None or tp_size == 1:
        return [local_argmax(x) for x in logits]
    local_vocab = {int(x.shape[-1]) for x in logits}
    if len(local_vocab) > 1:
        raise ValueError(f"{_NAME}: vocab-parallel logits shards have different widths {sorted(local_vocab)}; "
                         "every microbatch must hold the same vocab shard")
    v_local = local_vocab.pop() if local_vocab else 1
    v_global = v_local * tp_size
    if v_global > INDEX_LIMIT:
        raise ValueError(f"{_NAME}: vocab size {v_global} does not fit the packed 32-bit index")
    offset = tp_rank * v_local
    wide = any(x.dtype == torch.float64 for x in logits)
    keys, idx_all, ord_all, shapes = [], [], [], []
    for x in logits:
        if not wide and _triton.applies(x):                  # one read, the key made in-kernel
            key = _triton.attempt("argmax keys", _keys_kernel, x, offset, v_global)
            if key is not None:
                shapes.append(x.shape[:-1])
                keys.append(key.reshape(-1))
                continue
        idx = x.argmax(-1)                                   # one read of the logits
        val = x.gather(-1, idx.unsqueeze(-1)).squeeze(-1)    # [...]: no [.., V] copy
        gidx = idx + offset
        shapes.append(idx.shape)
        if wide:
            ord_all.append(_ordered_f64(val).reshape(-1))
            idx_all.append(gidx.reshape(-1))
        else:
            keys.append(argmax_keys(val, gidx, v_global).reshape(-1))
    device = logits[0].device if logits else comm_device(group)
    if not wide:
        packed = _cat_or_dummy(keys, device)
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
        flat = argmax_of_keys(packed, v_global)
    else:
        ordered = _cat_or_dummy(ord_all, device)
        best = ordered.clone()
        dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
        gidx = _cat_or_dummy(idx_all, device)
        cand = torch.where(ordered == best, gidx, torch.full_like(gidx, v_global))
        dist.all_reduce(cand, op=dist.ReduceOp.MIN, group=group)
        flat = cand
    out, start = [], 0
    for shp in shapes:
        n = shp.numel()
        out.append(flat[start:start + n].reshape(shp))
        start += n
    return out


def _argmax_kernel(x, labels=None):
    from twinkle_metrics.kernels.argmax_triton import triton_argmax
    return triton_argmax(x, labels)


def _joined_kernel_hits(pairs):
    from twinkle_metrics.kernels.argmax_triton import triton_argmax_hits_joined
    return triton_argmax_hits_joined(pairs)


def _keys_kernel(x, offset, vocab):
    from twinkle_metrics.kernels.argmax_triton import triton_argmax_keys
    return triton_argmax_keys(x, offset, vocab)


def _cat_or_dummy(parts: List[torch.Tensor], device) -> torch.Tensor:
    if parts and sum(p.numel() for p in parts):
        return torch.cat(parts)
    return torch.zeros(1, dtype=torch.int64, device=device)
