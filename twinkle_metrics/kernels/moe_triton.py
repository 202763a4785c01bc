"""One MoE layer's routing statistics in two launches (Triton, CUDA).

``MoERoutingMetric``'s torch path issues about 36 small kernels per layer and call
(``benchmarks/launches.py``): the routing-map counts, a log-softmax entropy with its
masks and non-finite probe, the loss probes, and the ``[L]`` rows each contribution is
placed in. A model with dozens of MoE layers pays that on every layer of every
microbatch. Here:

1. ``_tokens_kernel`` reads each token's routing-map row, router logits (or
   probabilities) and mask once; each program writes one row of float64 partials for
   a block of tokens: the per-expert counts, the entropy sum, the entropy tokens and
   the non-finite tokens (counts are exact in float64 below 2**53);
2. ``_rows_kernel`` (one program) sums those rows, reads the layer's aux and z losses
   and dropped tokens, and writes every ``[L]`` / ``[L, E]`` contribution whole: the
   layer's values in its row, 0 in the others.

The numbers are the torch path's (``moe._entropy`` and ``MoERoutingMetric._one``):

- entropy from logits: ``-sum p log p`` of the softmax, with ``0 log 0 = 0`` for
  experts at -inf; a row with a NaN or +inf logit, or with every logit at -inf, is
  NaN (as ``log_softmax`` makes it), so it counts as non-finite. Computed in float32
  for 16/32-bit inputs and float64 for float64 ones, as the torch path promotes;
- entropy from probabilities: the rows normalised to sum 1, ``xlogy`` terms (0 where
  p = 0); a row summing to 0 has no distribution and is left out;
- a token counts where ``token_mask`` is set; a non-finite entropy is counted in
  ``nonfinite`` and, under ``'skip'``, left out of the entropy;
- a loss is non-finite when NaN/inf; under ``'skip'`` it is left out (no call counted).

Used on CUDA unless ``TWINKLE_METRICS_TRITON=0`` (see ``dispatch``); tested on CPU under
Triton's interpreter against the torch path, and compiled for sm_80/sm_90 in CI
(``benchmarks/kernel_build.py``).
"""
from __future__ import annotations

from typing import Dict, Optional, Union

import torch
import triton
import triton.language as tl

#: float64 and int64 per-layer contributions ``layer_rows`` writes, in column order
FLOAT_ROWS = ("entropy_sum", "aux_sum", "z_sum")
INT_ROWS = ("entropy_tokens", "nonfinite", "aux_calls", "z_calls", "dropped")
#: elements of one program's tile (tokens x padded experts; half for float64 scores)
TILE = 4096
#: elements of the partial rows ``_rows_kernel`` reads at a time
ROWS_TILE = 2048
#: dropped tokens: none, a tensor, a Python int
DROP_NONE, DROP_TENSOR, DROP_INT = 0, 1, 2


@triton.jit
def _tokens_kernel(map_ptr, x_ptr, mask_ptr, part_ptr, n, map_s0, x_s0, mask_s0,
                   E: tl.constexpr, E_PAD: tl.constexpr, HAS_MAP: tl.constexpr, HAS_X: tl.constexpr,
                   LOGITS: tl.constexpr, F64: tl.constexpr, HAS_MASK: tl.constexpr, SKIP: tl.constexpr,
                   BLOCK_T: tl.constexpr):
    """Partials of ``BLOCK_T`` tokens: ``E`` counts, then entropy sum, tokens, non-finite."""
    pid = tl.program_id(0)
    tok = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    inside = tok < n
    ex = tl.arange(0, E_PAD)
    cell = inside[:, None] & (ex[None, :] < E)
    keep = inside
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + tok * mask_s0, mask=inside, other=0) != 0)
    out = part_ptr + pid * (E + 3)
    if HAS_MAP:
        hit = (tl.load(map_ptr + tok[:, None] * map_s0 + ex[None, :], mask=cell, other=0) != 0) & keep[:, None]
        tl.store(out + ex, tl.sum(hit.to(tl.float64), 0), mask=ex < E)
    if HAS_X:
        x = tl.load(x_ptr + tok[:, None] * x_s0 + ex[None, :], mask=cell, other=0.0)
        if F64:
            x = x.to(tl.float64)
        else:
            x = x.to(tl.float32)
        valid = keep
        if LOGITS:
            z = tl.where(cell, x, float("-inf"))
            top = tl.max(z, 1)
            e = tl.exp(z - top[:, None])  # 0 at -inf; NaN where top is -inf or +inf
            s = tl.sum(e, 1)
            p = e / s[:, None]
            logp = tl.where(p == 0, 0.0, z - top[:, None] - tl.log(s)[:, None])  # 0 log 0 = 0
            h = -tl.sum(p * logp, 1)
            # tl.max need not keep NaN: a NaN or +inf logit makes the row NaN, as in torch
            poison = tl.sum(tl.where(cell & ((x != x) | (x == float("inf"))), 1.0, 0.0), 1)
            h = tl.where(poison > 0, float("nan"), h)
        else:
            total = tl.sum(x, 1)
            valid = valid & (total != 0)
            p = x / tl.where(total == 0, 1.0, total)[:, None]
            h = -tl.sum(p * tl.log(tl.where(p == 0, 1.0, p)), 1)  # xlogy: 0 where p = 0
        bad = (h * 0.0) != (h * 0.0)  # NaN or inf
        nonfinite = bad & valid
        if SKIP:
            valid = valid & ~bad
        tl.store(out + E, tl.sum(tl.where(valid, h.to(tl.float64), 0.0), 0))
        tl.store(out + E + 1, tl.sum(valid.to(tl.float64), 0))
        tl.store(out + E + 2, tl.sum(nonfinite.to(tl.float64), 0))


@triton.jit
def _loss(ptr, one, GIVEN: tl.constexpr, SKIP: tl.constexpr):
    """(value, calls, non-finite) of one layer's loss, each ``[1]``: float64 value and int64
    counts; 0 when not ``GIVEN``; under ``SKIP`` a NaN/inf loss is left out (no call)."""
    value = tl.zeros([1], tl.float64)
    calls = tl.zeros([1], tl.int64)
    bad = tl.zeros([1], tl.int64)
    if GIVEN:
        value = tl.load(ptr + one).to(tl.float64)
        nonfinite = (value * 0.0) != (value * 0.0)
        bad = nonfinite.to(tl.int64)
        calls += 1
        if SKIP:
            value = tl.where(nonfinite, 0.0, value)
            calls -= bad
    return value, calls, bad


@triton.jit
def _rows_kernel(part_ptr, aux_ptr, z_ptr, drop_ptr, counts_ptr, f_ptr, i_ptr, n_parts, layer, drop_value,
                 L: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, HAS_MAP: tl.constexpr,
                 HAS_X: tl.constexpr, HAS_AUX: tl.constexpr, HAS_Z: tl.constexpr, DROP: tl.constexpr,
                 SKIP: tl.constexpr, L_PAD: tl.constexpr, PB: tl.constexpr):
    """Every per-layer contribution whole: ``counts [L, E]``, float rows ``[L, 3]`` and int
    rows ``[L, 5]`` (``FLOAT_ROWS``, ``INT_ROWS``), 0 outside row ``layer``. The token
    kernel's partial rows are read ``PB`` at a time."""
    ex = tl.arange(0, E_PAD)
    counts = tl.zeros([PB, E_PAD], tl.float64)
    ent_v = tl.zeros([PB], tl.float64)
    ent_n_v = tl.zeros([PB], tl.float64)
    bad_n_v = tl.zeros([PB], tl.float64)
    for start in range(0, n_parts, PB):
        p = start + tl.arange(0, PB)
        live = p < n_parts
        rows = part_ptr + p.to(tl.int64) * (E + 3)
        if HAS_MAP:
            counts += tl.load(rows[:, None] + ex[None, :], mask=live[:, None] & (ex[None, :] < E), other=0.0)
        if HAS_X:
            ent_v += tl.load(rows + E, mask=live, other=0.0)
            ent_n_v += tl.load(rows + E + 1, mask=live, other=0.0)
            bad_n_v += tl.load(rows + E + 2, mask=live, other=0.0)
    one = tl.arange(0, 1)
    counts = tl.sum(counts, 0)
    ent = tl.sum(ent_v, 0) + tl.zeros([1], tl.float64)
    ent_n = tl.sum(ent_n_v, 0) + tl.zeros([1], tl.float64)
    bad_n = tl.sum(bad_n_v, 0) + tl.zeros([1], tl.float64)
    aux, aux_n, aux_bad = _loss(aux_ptr, one, HAS_AUX, SKIP)
    z, z_n, z_bad = _loss(z_ptr, one, HAS_Z, SKIP)
    bad = bad_n.to(tl.int64) + aux_bad + z_bad
    dropped = tl.zeros([1], tl.int64)
    if DROP == 1:
        dropped = tl.load(drop_ptr + one).to(tl.int64)
    if DROP == 2:
        dropped += drop_value
    # every layer's row: the values in row ``layer``, 0 elsewhere
    rows = tl.arange(0, L_PAD)
    here = rows == layer
    live = rows < L
    if HAS_MAP:
        cells = rows[:, None] * E + ex[None, :]
        tl.store(counts_ptr + cells, tl.where(here[:, None], counts[None, :], 0.0).to(tl.int64),
                 mask=live[:, None] & (ex[None, :] < E))
    tl.store(f_ptr + rows * 3, tl.where(here, ent, 0.0), mask=live)
    tl.store(f_ptr + rows * 3 + 1, tl.where(here, aux, 0.0), mask=live)
    tl.store(f_ptr + rows * 3 + 2, tl.where(here, z, 0.0), mask=live)
    tl.store(i_ptr + rows * 5, tl.where(here, ent_n.to(tl.int64), 0), mask=live)
    tl.store(i_ptr + rows * 5 + 1, tl.where(here, bad, 0), mask=live)
    tl.store(i_ptr + rows * 5 + 2, tl.where(here, aux_n, 0), mask=live)
    tl.store(i_ptr + rows * 5 + 3, tl.where(here, z_n, 0), mask=live)
    tl.store(i_ptr + rows * 5 + 4, tl.where(here, dropped, 0), mask=live)


def _rows(x: Optional[torch.Tensor], e: int) -> Optional[torch.Tensor]:
    """``[tokens, E]`` with unit column stride (a view where it can be)."""
    if x is None:
        return None
    x = x.reshape(-1, e)
    return x if x.stride(-1) == 1 else x.contiguous()


def layer_rows(*, layers: int, layer: int, experts: int, device: torch.device,
               routing_map: Optional[torch.Tensor] = None, scores: Optional[torch.Tensor] = None,
               from_logits: bool = True,
               token_mask: Optional[torch.Tensor] = None, aux: Optional[torch.Tensor] = None,
               z: Optional[torch.Tensor] = None, dropped: Union[None, int, torch.Tensor] = None,
               skip: bool = False, tile: int = 0) -> Dict[str, torch.Tensor]:
    """One layer's contributions to ``MoERoutingMetric``'s states, each ``[L]`` (``counts``:
    ``[L, E]``) with the layer's values in row ``layer``: the fields given, validated by the
    caller (``routing_map`` and ``scores`` ``[..., E]``, ``token_mask`` their leading dims,
    ``aux`` / ``z`` one float each, ``dropped`` an integer)."""
    e_pad = triton.next_power_of_2(experts)
    m = _rows(routing_map, experts)
    x = _rows(scores, experts)
    n = m.shape[0] if m is not None else x.shape[0] if x is not None else 0
    mask = None if token_mask is None else token_mask.reshape(-1)
    if m is not None and m.dtype == torch.bool:
        m = m.view(torch.uint8)
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    f64 = x is not None and x.dtype == torch.float64
    tile = (tile or TILE) // (2 if f64 else 1)  # float64 logits: half the tile stays in registers
    block_t = max(1, min(tile // e_pad, triton.next_power_of_2(max(n, 1))))
    n_parts = triton.cdiv(n, block_t) if (m is not None or x is not None) else 0
    counts = torch.empty(layers, experts, dtype=torch.int64, device=device)
    f = torch.empty(layers, len(FLOAT_ROWS), dtype=torch.float64, device=device)
    i = torch.empty(layers, len(INT_ROWS), dtype=torch.int64, device=device)
    part = torch.empty(max(n_parts, 1), experts + 3, dtype=torch.float64, device=device)
    if n_parts:
        _tokens_kernel[(n_parts,)](
            m if m is not None else part, x if x is not None else part, mask if mask is not None else part,
            part, n, m.stride(0) if m is not None else 0, x.stride(0) if x is not None else 0,
            mask.stride(0) if mask is not None else 0,
            E=experts, E_PAD=e_pad, HAS_MAP=m is not None, HAS_X=x is not None, LOGITS=from_logits,
            F64=f64, HAS_MASK=mask is not None, SKIP=skip,
            BLOCK_T=block_t, num_warps=4, enable_fp_fusion=False)
    drop_mode = DROP_NONE if dropped is None else DROP_TENSOR if isinstance(dropped, torch.Tensor) else DROP_INT
    drop_int = 0 if dropped is None or isinstance(dropped, torch.Tensor) else int(dropped)  # DROP_INT's
    _rows_kernel[(1,)](
        part, aux if aux is not None else f, z if z is not None else f,
        dropped if drop_mode == DROP_TENSOR else i, counts, f, i, n_parts, layer,
        drop_int,
        L=layers, E=experts, E_PAD=e_pad, HAS_MAP=m is not None, HAS_X=x is not None, HAS_AUX=aux is not None,
        HAS_Z=z is not None, DROP=drop_mode, SKIP=skip, L_PAD=triton.next_power_of_2(layers),
        PB=max(1, ROWS_TILE // e_pad), num_warps=4, enable_fp_fusion=False)
    out: Dict[str, torch.Tensor] = {}
    if m is not None:
        out["counts"] = counts
    if x is not None:
        out.update(entropy_sum=f[:, 0], entropy_tokens=i[:, 0])
    if x is not None or aux is not None or z is not None:
        out["nonfinite"] = i[:, 1]
    if aux is not None:
        out.update(aux_sum=f[:, 1], aux_calls=i[:, 2])
    if z is not None:
        out.update(z_sum=f[:, 2], z_calls=i[:, 3])
    if dropped is not None:
        out["dropped"] = i[:, 4]
    return out
