"""Per-token entropy of the softmax of logits, in row chunks, optionally vocab-parallel.

``H = log S - sum(e * y) / S`` with ``y = z / T - max``, ``e = exp(y)``, ``S = sum e``:
each chunk of rows yields the partials ``(S, sum e*y)``, which add over vocab
shards once every shard subtracted the same (global) row max. This torch
implementation (working memory: two buffers of one chunk) is the path everywhere
but on CUDA with Triton installed, where ``entropy_triton`` reads each row once
with no working buffer (``_use_triton``); float64 logits always stay here.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from parallel import comm_device
from parallel.groups import ProcessGroup
from twinkle_metrics.kernels import dispatch as _triton


def work_dtype(z: torch.Tensor) -> torch.dtype:
    """float32 for 16/32-bit logits, float64 for float64 ones."""
    return torch.promote_types(z.dtype, torch.float32)


def row_blocks(z: torch.Tensor) -> List[torch.Tensor]:
    """``[b, s, V]`` as contiguous ``[rows, V]`` views (per sequence when a slice is strided).

    For the Triton path rows need only a unit vocab stride: per-sequence views of a
    strided ``[b, s, V]`` (a slice, a transposed ``[s, b, V]``) are read in place."""
    if z.is_contiguous():
        return [z.reshape(-1, z.shape[-1])]
    if _triton.applies(z) and z.stride(-1) == 1:
        return [z[i] for i in range(z.shape[0])]
    return [z[i] if z[i].is_contiguous() else z[i].contiguous() for i in range(z.shape[0])]


def rows_per_chunk(block: torch.Tensor, job_rows: int, chunk_bytes: Optional[int],
                   chunk_rows: Optional[int]) -> int:
    """Rows per chunk: the byte budget of one working buffer (``None``: 1/64 of the
    job's logits in the working dtype, at least 1 MiB), capped by ``chunk_rows``. The
    Triton path has no working buffer: the whole block is one chunk (one launch)."""
    if _triton.applies(block):
        return max(block.shape[0], 1)
    row = block.shape[-1] * torch.finfo(work_dtype(block)).bits // 8
    budget = chunk_bytes if chunk_bytes is not None else max(job_rows * row // 64, 1 << 20)
    rows = max(1, budget // max(row, 1))  # never less than one token's row
    return min(rows, chunk_rows) if chunk_rows else rows


def partials(c: torch.Tensor, t: float, zmax: Optional[torch.Tensor]) -> torch.Tensor:
    """``[rows, 2]`` float64 ``(S, sum e*y)`` of one chunk, with y = z/T - max, e = exp(y).

    Two buffers of the chunk's size: y (the chunk's own copy, clamped in place so
    that a -inf logit gives e = 0 and e*y = 0, never 0 * -inf) and e; ``sum e*y``
    is a batched dot product, not a third buffer. ``zmax`` is the global row max
    under TP (None: this chunk's own).
    """
    y = c.to(work_dtype(c), copy=True)
    if t != 1.0:
        y.div_(t)
    m = y.amax(-1) if zmax is None else zmax.to(y.dtype)
    y.sub_(m[:, None]).clamp_(min=torch.finfo(y.dtype).min)
    e = torch.exp(y)
    ey = torch.bmm(e.unsqueeze(1), y.unsqueeze(2)).reshape(-1)
    return torch.stack([e.sum(-1), ey], 1).to(torch.float64)


def token_entropy(chunks: Sequence[torch.Tensor], shapes: Sequence[torch.Size], temperature: float,
                  tp_group: ProcessGroup, device: torch.device) -> List[torch.Tensor]:
    """Per-token entropy (float64), one tensor of each shape in ``shapes``, from the row
    ``chunks`` of their logits in order; vocab-parallel over ``tp_group`` (every rank
    of it must hold the same rows, agreed before: ``None`` for whole-vocab logits).

    Two collectives under TP however many chunks: the row maxima of every chunk
    are all-reduced at once (MAX), then every chunk's partials at once (SUM).
    """
    if _use_triton(chunks):
        parts = _triton.attempt("entropy partials", _triton_partials, chunks, temperature)
        if parts is not None:
            return _triton_entropy(parts, shapes, tp_group)
        # whole blocks were one chunk each for the kernel: the torch path's working buffers
        # need its own chunk sizes
        chunks = [p for c in chunks for p in torch.split(c, rows_per_chunk(c, c.shape[0], None, None))]
    t = temperature
    zmax = None
    if tp_group is not None:
        # max(z) / T == max(z / T) (T > 0, rounding is monotone): no scaled copy.
        zmax = torch.cat([c.amax(-1).to(work_dtype(c)) / t for c in chunks]) if chunks else \
            torch.zeros(0, device=device)
        zmax_c = zmax.to(comm_device(tp_group))
        dist.all_reduce(zmax_c, op=dist.ReduceOp.MAX, group=tp_group)          # collective 1
        zmax = zmax_c.to(zmax.device)
    stats, start = [], 0
    for c in chunks:
        stats.append(partials(c, t, None if zmax is None else zmax[start:start + c.shape[0]]))
        start += c.shape[0]
    st = torch.cat(stats) if stats else torch.zeros(0, 2, dtype=torch.float64, device=device)
    if tp_group is not None:
        st_c = st.to(comm_device(tp_group))
        dist.all_reduce(st_c, op=dist.ReduceOp.SUM, group=tp_group)              # collective 2
        st = st_c.to(st.device)
    h = torch.log(st[:, 0]) - st[:, 1] / st[:, 0]
    return [e.reshape(shape) for e, shape in zip(torch.split(h, [math.prod(s) for s in shapes]), shapes)]


def _use_triton(chunks: Sequence[torch.Tensor]) -> bool:
    """Every chunk on CUDA in a 16/32-bit dtype, and triton installed."""
    return bool(chunks) and all(_triton.applies(c) for c in chunks)


def _triton_partials(chunks: Sequence[torch.Tensor], t: float) -> torch.Tensor:
    """Every chunk's ``(m, S, W)`` rows, written by one launch each into one buffer."""
    from twinkle_metrics.kernels.entropy_triton import triton_token_partials
    rows = [math.prod(c.shape[:-1]) for c in chunks]
    out = torch.empty(sum(rows), 3, dtype=torch.float64, device=chunks[0].device)
    start = 0
    for c, n in zip(chunks, rows):
        triton_token_partials(c, t, out=out[start:start + n])
        start += n
    return out


def _triton_entropy(parts, shapes, tp_group) -> List[torch.Tensor]:
    """``token_entropy`` from the one-pass ``(m, S, W)`` partials of every chunk; under TP
    the same two collectives as the torch path, of the same sizes and dtypes: MAX of the
    row maxima (float32), then SUM of every shard's ``(S, W)`` re-based on them (float64)."""
    if tp_group is not None:
        zmax_c = parts[:, 0].to(torch.float32).to(comm_device(tp_group))    # exact: m is a float32
        dist.all_reduce(zmax_c, op=dist.ReduceOp.MAX, group=tp_group)          # collective 1
        st_c = rescale(parts, zmax_c.to(parts.device)).to(comm_device(tp_group))
        dist.all_reduce(st_c, op=dist.ReduceOp.SUM, group=tp_group)              # collective 2
        st = st_c.to(parts.device)
    else:
        st = parts[:, 1:]
    h = torch.log(st[:, 0]) - st[:, 1] / st[:, 0]
    return [e.reshape(shape) for e, shape in zip(torch.split(h, [math.prod(s) for s in shapes]), shapes)]


def rescale(parts: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """``[rows, 2]`` float64 ``(S, W)`` of ``parts [rows, 3]`` re-based on the global row
    max ``row_max`` (the MAX of every shard's ``m``); summing them over the shards gives
    the whole vocab's ``(S, W)`` about ``row_max``:
    ``S = sum S_i e^(m_i - M)``, ``W = sum (W_i + (m_i - M) S_i) e^(m_i - M)``."""
    m, s, w = parts.unbind(1)
    seen = m > float("-inf")  # an all -inf shard adds nothing (and no -inf - -inf)
    d = torch.where(seen, m - row_max.to(m.dtype), torch.zeros_like(m))
    a = torch.where(seen, torch.exp(d), torch.zeros_like(m))
    return torch.stack([a * s, a * (w + d * s)], 1)
