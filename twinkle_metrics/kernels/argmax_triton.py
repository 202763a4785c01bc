"""Argmax over the vocab in one read of the logits (Triton, CUDA), with the label
compare or the vocab-parallel key fused in.

Each program takes one row: per lane it keeps the best order-preserving int32 key
of the value (the ``_order.ordered_f32`` mapping: NaN above +inf, -0.0 == +0.0)
and the first index holding it, then takes the row's largest key and the lowest
index among the lanes holding it, which is ``torch.argmax``'s rule (lowest index
wins a tie, the first NaN wins). The torch implementation in ``argmax.py`` stays
the path on every other device and for float64 logits.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from twinkle_metrics.kernels.triton_common import rows_view

_OUT_INDEX, _OUT_HIT, _OUT_KEY = 0, 1, 2
# The vocab tile and warps per row: on one H200, [16384, 152064] bf16 rows took 0.99x the read
# ceiling (logits.amax(-1)) at 1024 / 4 warps, against 1.12x at 4096 and 1.27x at 8192 / 8 warps.
BLOCK, NUM_WARPS = 1024, 4


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, labels_ptr, n_cols, inner, outer_stride, inner_stride,
                   offset, vocab, MODE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: rows x V overflows int32 offsets
    base = x_ptr + (row // inner) * outer_stride + (row % inner) * inner_stride
    cols = tl.arange(0, BLOCK)
    low31 = 0x7FFFFFFF
    best = tl.full([BLOCK], -low31 - 1, tl.int32)  # below every value's key
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_cols, BLOCK):
        idx = start + cols
        v = tl.load(base + idx, mask=idx < n_cols, other=float("-inf")).to(tl.float32) + 0.0
        bits = v.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ low31)
        key = tl.where(v != v, low31, key)
        key = tl.where(idx < n_cols, key, -low31 - 1)
        take = key > best  # strict: a lane keeps its first index among equal keys
        best = tl.where(take, key, best)
        best_i = tl.where(take, idx, best_i)
    row_best = tl.max(best, 0)
    arg = tl.min(tl.where(best == row_best, best_i, n_cols), 0).to(tl.int64)
    if MODE == 0:
        tl.store(out_ptr + row, arg)
    elif MODE == 1:
        tl.store(out_ptr + row, arg == tl.load(labels_ptr + row).to(tl.int64))
    else:
        tl.store(out_ptr + row, row_best.to(tl.int64) * 4294967296 + (vocab - 1 - (arg + offset)))


def _launch(logits: torch.Tensor, mode: int, labels: Optional[torch.Tensor] = None, offset: int = 0,
            vocab: int = 0, block: int = 0, num_warps: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    x, inner, outer_stride, inner_stride = rows_view(logits)
    n_cols = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    dtype = torch.bool if mode == _OUT_HIT else torch.int64
    if out is None:
        out = torch.empty(logits.shape[:-1], dtype=dtype, device=logits.device)
    if rows == 0:
        return out
    blk = block or min(BLOCK, triton.next_power_of_2(max(n_cols, 16)))
    lab = out if labels is None else labels.reshape(-1).contiguous()
    _argmax_kernel[(rows,)](x, out, lab, n_cols, inner, outer_stride, inner_stride, offset, vocab,
                            MODE=mode, BLOCK=blk, num_warps=num_warps or NUM_WARPS, enable_fp_fusion=False)
    return out


def triton_argmax(logits: torch.Tensor, labels: Optional[torch.Tensor] = None, *, block: int = 0,
                  num_warps: int = 0) -> torch.Tensor:
    """``logits.argmax(-1)`` (int64), or with ``labels`` (shaped like the result) the bool
    ``argmax == labels`` without materialising the argmax. 16/32-bit floats, ``[..., V]``
    strided views read in place. ``block`` and ``num_warps`` override the launch's vocab tile
    width and warps, for tests and benchmarks."""
    if labels is not None and labels.shape != logits.shape[:-1]:
        raise ValueError(f"triton_argmax: labels {list(labels.shape)} do not match logits "
                         f"{list(logits.shape)}; pass labels shaped like logits[..., 0]")
    return _launch(logits, _OUT_INDEX if labels is None else _OUT_HIT, labels, block=block, num_warps=num_warps)


def triton_argmax_hits_joined(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """bool ``x.argmax(-1) == labels`` of every ``(x, labels)`` (labels shaped like
    ``x[..., 0]``), flattened and joined in order: each kernel writes its rows into its
    slice of one buffer, so joining costs nothing."""
    sizes = [labels.numel() for _, labels in pairs]
    out = torch.empty(sum(sizes), dtype=torch.bool, device=pairs[0][0].device)
    start = 0
    for (x, labels), n in zip(pairs, sizes):
        if labels.shape != x.shape[:-1]:
            raise ValueError(f"triton_argmax: labels {list(labels.shape)} do not match logits {list(x.shape)}")
        _launch(x, _OUT_HIT, labels, out=out[start:start + n].view(labels.shape))
        start += n
    return out


def triton_argmax_keys(logits: torch.Tensor, offset: int, vocab: int, *, block: int = 0) -> torch.Tensor:
    """``argmax.argmax_keys`` of this shard's argmax (int64, ``logits.shape[:-1]``), the
    shard starting at global index ``offset`` of a ``vocab``-wide vocab: the MAX over the
    shards' keys picks the global ``torch.argmax``."""
    return _launch(logits, _OUT_KEY, offset=offset, vocab=vocab, block=block)
