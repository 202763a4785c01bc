"""Alignment helpers shared by the RL metrics (DPO, GRPO family); coercion of single
values is in ``_checks``.

Everything here runs on the device without waiting for it: masks come from
``completion_mask`` or ``labels``, ragged per-sequence values are scattered onto
mask positions with one ``gather`` (no ``nonzero``), and the one
CP collective sums per-sequence partial totals on the device.
"""
from __future__ import annotations

from numbers import Number
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.types import Device

from parallel import comm_device, group_size
from parallel.groups import ProcessGroup
from twinkle_metrics.inputs.checks import as_tensor, float_tensor, from_host, nonfinite, real_values
from twinkle_metrics.inputs.microbatch import has_field, host_array, join, microbatches


def token_mask(metric: str, feat: Mapping[str, Any], ignore_index: int, device: Device = None) -> torch.Tensor:
    """``[b, s]`` bool mask: ``completion_mask`` when given, else ``labels != ignore_index``."""
    if feat.get("completion_mask") is not None:
        mask = _ne(as_tensor(host_array(metric, "completion_mask", feat["completion_mask"]), device), 0)
    elif feat.get("labels") is not None:
        mask = _ne(as_tensor(host_array(metric, "labels", feat["labels"]), device), ignore_index)
    else:
        raise ValueError(f"{metric}: an input feature has neither 'completion_mask' nor 'labels'; "
                         f"pass one so the valid tokens are known; got keys {sorted(feat)}")
    return mask.unsqueeze(0) if mask.dim() == 1 else mask


_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def keep_bits(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as integers as wide as ``dtype``: all bits set where True, 0 elsewhere."""
    return mask.view(torch.uint8).to(_INT_OF_WIDTH[torch.finfo(dtype).bits // 8]).neg_()


def masked(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``x`` where the mask of ``bits`` (from :func:`keep_bits`) is set, +0.0 elsewhere.

    A bitwise AND of ``x``'s bits: exact, whatever ``x`` holds at masked positions
    (NaN/-inf padding is common there, and a 0/1 multiplier turns it into NaN), and
    as cheap as that multiply; ``torch.where`` with a bool mask is ~5x slower on CPU.
    """
    return (x.view(bits.dtype) & bits).view(x.dtype)


def _ne(x: torch.Tensor, value) -> torch.Tensor:
    """``x != value`` as bool; written as uint8 and viewed (the bool kernel is ~2x slower on CPU)."""
    if x.dtype == torch.bool:
        return x != value
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    return torch.ne(x, value, out=out).view(torch.bool)


def per_token(metric: str, field: str, value: Any, mask: torch.Tensor, full_len: int,
              dtype: Optional[torch.dtype] = None, per_sequence: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """One microbatch's per-token side input aligned to ``mask`` ([b, s]).

    Returns ``(values, has)``: ``values`` is ``[b, s]``, or ``[b, 1]`` (broadcasting
    to ``[b, s]``) for one value per sequence; ``has`` ([b, s] bool, a subset of
    ``mask``) marks masked tokens that received a value, and *is* ``mask`` (the same
    object) when every masked token did, so callers can skip re-masking.
    Outside ``has`` a scattered value is 0; an aligned value is returned as given
    (callers mask with ``torch.where``, so NaN/-inf padding there is harmless).
    Values keep a floating tensor's dtype (at least float32; ``dtype`` forces one);
    Python numbers become float64.

    ``per_sequence`` says what the field is: True for a value that may be one per
    sequence (advantages), False for per-token log-probs, which are never broadcast
    over a sequence. Accepted forms:

    * a ``[b, s]`` tensor aligned to the batch (``s`` = the mask length, or the
      untruncated length ``full_len``);
    * a ``[b, L]`` tensor with another ``L``: right-padded valid-token values;
      for ``per_sequence`` fields ``[b, 1]`` (TRL's ``advantages.unsqueeze(1)``)
      is one value per sequence instead;
    * ``per_sequence`` only: a ``[b]`` tensor or a list of ``b`` numbers, one value
      per sequence;
    * for a one-sequence microbatch, a 1-D tensor is that sequence's row, like 1-D
      log-probs: aligned when its length is ``s`` / ``full_len``, else its valid-token
      values (one value for ``per_sequence`` fields);
    * a list of ``b`` 1-D tensors / lists: each sequence's values for its valid
      tokens only (Twinkle's ragged form), scattered onto its mask positions in
      order; tokens beyond a short entry get no value. For ``per_sequence`` fields an
      entry of one element (or a number) is that sequence's one value.
    """
    b, s = mask.shape
    device = mask.device
    real_values(metric, field, value)
    if isinstance(value, torch.Tensor):
        value = value.to(device=device, dtype=dtype or float_dtype(value.dtype), non_blocking=True)
        if value.dim() == 1:
            if per_sequence and value.shape[0] == b:
                return value[:, None], mask
            if b == 1:
                value = value[None]
        if value.dim() == 2 and value.shape[0] == b:
            if value.shape[1] in (s, full_len):
                return value[:, :s], mask
            if per_sequence and value.shape[1] == 1:
                return value, mask
            return _scatter_padded(value, None, mask)
        forms = f"[{b}, {s}] (aligned), " + (f"[{b}] (one value per sequence), " if per_sequence else "")
        raise ValueError(f"{metric}: {field} has shape {list(value.shape)} but the microbatch has "
                         f"{b} sequences of length {s}; pass {forms}or a list with one 1-D tensor "
                         "of valid-token values per sequence")
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{metric}: {field} must be a tensor or a list, got {type(value).__name__}")
    if len(value) != b:
        raise ValueError(f"{metric}: {field} has {len(value)} per-sequence entries but the "
                         f"microbatch has {b} sequences; pass one entry per sequence")
    if not per_sequence and any(_is_scalar(v) for v in value):
        raise ValueError(f"{metric}: {field} holds per-token values but got one number for a sequence; "
                         "pass a [batch, seq] tensor or one 1-D tensor / list of valid-token values "
                         "per sequence")
    if all(isinstance(v, Number) for v in value):  # one host-to-device copy, not one per value
        return from_host(torch.tensor(value, dtype=dtype or torch.float64), device).reshape(b, 1), mask
    if all(_is_scalar(v) for v in value):
        vals = [as_tensor(v, device, dtype or torch.float64) for v in value]
        return torch.stack([v.to(_common(vals, dtype)).reshape(()) for v in vals])[:, None], mask
    rows: List[torch.Tensor] = []
    for i, v in enumerate(value):
        t = v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else \
            float_tensor(metric, f"{field}[{i}]", v, device)
        if per_sequence and t.dim() <= 1 and t.numel() == 1:
            t = t.reshape(1).expand(s)  # the sequence's one value, on each of its tokens
        elif t.dim() != 1:
            raise ValueError(f"{metric}: {field}[{i}] has shape {list(t.shape)}; expected a 1-D "
                             "tensor of that sequence's valid-token values")
        rows.append(t)
    dt = _common(rows, dtype)
    return _scatter_rows(torch.cat([r.to(dt) for r in rows]) if rows else torch.zeros(0, dtype=dt),
                         [r.shape[0] for r in rows], mask)


def float_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype per-token work runs in: floating, at least float32 (integers: float64)."""
    if not dtype.is_floating_point:
        return torch.float64
    return torch.promote_types(dtype, torch.float32)


def _common(tensors: Sequence[torch.Tensor], dtype=None) -> torch.dtype:
    if dtype is not None:
        return dtype
    out = torch.float32
    for t in tensors:
        out = torch.promote_types(out, float_dtype(t.dtype))
    return out


def _ranks(mask: torch.Tensor) -> torch.Tensor:
    """Index of each token among its row's valid tokens (cumsum(mask) - 1)."""
    return mask.view(torch.uint8).cumsum(1, dtype=torch.int64).sub_(1)  # uint8: cheap on CPU


def _scatter_padded(padded: torch.Tensor, lengths: Optional[torch.Tensor], mask: torch.Tensor):
    b, s = mask.shape
    width = padded.shape[1]
    if width == 0:
        return torch.zeros(b, s, dtype=padded.dtype, device=mask.device), torch.zeros_like(mask)
    # The k-th valid token of a row takes the row's k-th value.
    rank = _ranks(mask)
    vals = padded.gather(1, rank.clamp(0, width - 1))
    limit = lengths[:, None] if lengths is not None else width
    has = mask & (rank < limit)
    return torch.where(has, vals, torch.zeros_like(vals)), has


def _scatter_rows(flat: torch.Tensor, lengths: List[int], mask: torch.Tensor):
    """Rows of ``lengths`` values, concatenated in ``flat``, onto their rows' mask positions.

    One gather from the concatenation (no padded copy per row); starts and lengths are
    host ints, sent in one small copy.
    """
    b, s = mask.shape
    if flat.shape[0] == 0:
        return torch.zeros(b, s, dtype=flat.dtype, device=mask.device), torch.zeros_like(mask)
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    meta = from_host(torch.tensor([starts, lengths]), mask.device)
    rank = _ranks(mask)
    has = mask & (rank < meta[1][:, None])
    # in place where possible: every [b, s] int64/float64 temporary is a large allocation
    idx = rank.clamp_(min=0).add_(meta[0][:, None]).clamp_(max=total - 1)
    vals = flat.to(torch.float64).gather(0, idx.view(-1)).view(b, s)
    return vals.masked_fill_(~has, 0.0), has


def _is_scalar(v) -> bool:
    return isinstance(v, Number) or (isinstance(v, torch.Tensor) and v.dim() == 0)


def split_side_input(metric: str, field: str, value: Any, sizes: Sequence[int]) -> List[Any]:
    """Split a side input (``old_logps``, ``advantages``, ...) into one entry per microbatch.

    ``value`` may be:

    * one tensor aligned to the concatenated batch (dim 0 = all sequences); with a
      single sequence a 1-D tensor is that sequence's row, like 1-D log-probs;
    * a list with one entry per microbatch: a ``[b, s]`` tensor, a ``[b]`` tensor
      (per-sequence fields) or a per-sequence list for that microbatch;
    * a list with one entry per sequence: its valid-token values (1-D tensor or
      list of numbers, Twinkle's ragged form) or one number.

    The reading never depends on microbatch sizes in a way that changes results:
    an entry for a one-sequence microbatch that is not a 2-D tensor or a list of
    per-sequence entries is that sequence's value, whichever reading applies. So a
    1-D entry is always a sequence's valid-token values (for per-sequence fields
    like advantages a one-element entry is the sequence's value), and when every
    microbatch holds one sequence (micro-batch size 1) the two readings agree.
    """
    n_micro, total = len(sizes), sum(sizes)
    if value is None:
        return [None] * n_micro
    if isinstance(value, torch.Tensor):
        if total == 1 and value.dim() <= 1:  # one sequence: its 1-D row (like 1-D logps) or value
            return [value.reshape(1, -1) if value.dim() == 1 and value.shape[0] != 1 else value.reshape(1)]
        if value.dim() == 0 or value.shape[0] != total:
            raise ValueError(f"{metric}: {field} has shape {list(value.shape)} but the batch holds "
                             f"{total} sequences ({list(sizes)} per microbatch); pass a tensor with "
                             f"dim 0 = {total}, or a list per microbatch / per sequence")
        return [value] if n_micro == 1 else list(torch.split(value, list(sizes), dim=0))
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{metric}: {field} must be a tensor or a list, got {type(value).__name__}")
    per_micro_like = all(v is None or isinstance(v, (list, tuple)) or
                         (isinstance(v, torch.Tensor) and v.dim() >= 2) for v in value)
    if len(value) == n_micro and (per_micro_like or len(value) != total):
        return [_sequence_entry(v) if n == 1 else v for v, n in zip(value, sizes)]
    if len(value) == total:
        out, start = [], 0
        for n in sizes:
            out.append(list(value[start:start + n]))
            start += n
        return out
    raise ValueError(f"{metric}: {field} has {len(value)} entries; expected one per microbatch "
                     f"({n_micro}) or one per sequence ({total})")


def _sequence_entry(v):
    """A one-sequence microbatch's entry as that microbatch's value.

    2-D tensors and lists of per-sequence entries are microbatch values already;
    anything else (a number, a 1-D tensor, a list of numbers) is the sequence's own
    value, so it is wrapped as a one-sequence list: the same result as reading the
    whole list per sequence.
    """
    if v is None or (isinstance(v, torch.Tensor) and v.dim() >= 2):
        return v
    if isinstance(v, (list, tuple)) and not all(_is_scalar(x) for x in v):
        return v
    return [v]


def aligned_microbatches(metric: str, inputs: Any, outputs: Any, field: str, ignore_index: int,
                         sides: Mapping[str, Tuple[Any, bool]]) -> List[Dict[str, Any]]:
    """One per-token output and its side inputs, validated and aligned per microbatch.

    For metrics that read ``outputs[field]`` (``[b, s]`` per microbatch) with side
    inputs such as old values or rollout log-probs. ``sides`` maps each side input's
    keyword name to ``(value, per_sequence)``; each value is split over the
    microbatches (``split_side_input``) and aligned to the token mask (``per_token``).

    Returns one dict per microbatch: ``'feat'`` (the input feature), ``'x'`` (the
    output, floating, at least float32, truncated to the mask), ``'m'`` (``[b, s]``
    bool token mask), ``'full_len'``, and for each side name ``(values, has)`` or None
    when that side input is absent for the microbatch. ``outputs=None`` or an empty
    microbatch list gives ``[]``. Communicates nothing; raises on bad input.
    """
    if outputs is None:
        return []
    if inputs is None and has_field(outputs, field):
        raise ValueError(f"{metric}: outputs[{field!r}] given but inputs is None; per-token values need "
                         "the token mask: pass the InputFeature (or list of them) with labels or "
                         "completion_mask")
    pairs = microbatches(metric, inputs, outputs, (field,))
    items: List[Dict[str, Any]] = []
    for i, (feat, o) in enumerate(pairs):
        if field not in o:
            raise ValueError(f"{metric}: outputs of microbatch {i} have no {field!r}; pass per-token "
                             f"{field} [batch, seq] (got fields {sorted(o)})")
        x = float_tensor(metric, f"outputs[{field!r}]", o[field])
        x = x.unsqueeze(0) if x.dim() == 1 else x
        mask = token_mask(metric, feat, ignore_index, x.device)
        full_len = mask.shape[1]
        x, mask = common_length(metric, f"outputs[{field!r}]", x, mask)
        items.append({"feat": feat, "x": x.to(float_dtype(x.dtype)), "m": mask, "full_len": full_len})
    sizes = [item["m"].shape[0] for item in items]
    for name, (value, per_sequence) in sides.items():
        parts = split_side_input(metric, name, value, sizes)
        for item, part in zip(items, parts):
            m = item["m"]
            item[name] = None if part is None or not m.numel() else \
                per_token(metric, name, part, m, item["full_len"], per_sequence=per_sequence)
    return items


def joined_microbatches(items: List[Dict[str, Any]], sides: Sequence[str]) -> List[Dict[str, Any]]:
    """``aligned_microbatches``' items as one ``[1, tokens]`` item, every microbatch's tokens
    flattened and joined in order (``x``, ``m`` and each side input's ``(values, has)``;
    a side input some microbatches lack gets no ``has`` there), so that element-wise
    statistics take one pass of launches however many microbatches there are. Per-sequence
    values are spread over their tokens. ``has`` stays the mask itself when it was in every
    microbatch. One item or none: returned as they are. ``feat`` is dropped."""
    if len(items) <= 1:
        return items
    masks = [item["m"] for item in items]
    m = join(masks)[None]
    out: Dict[str, Any] = {"x": join([item["x"] for item in items])[None], "m": m, "full_len": m.shape[1]}
    for name in sides:
        if all(item[name] is None for item in items):
            out[name] = None
            continue
        values, has, whole = [], [], True
        for item, mask in zip(items, masks):
            if item[name] is None:
                values.append(torch.zeros(mask.numel(), device=mask.device))
                has.append(torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device))
                whole = False
                continue
            x, h = item[name]
            values.append(x.expand(mask.shape))
            has.append(h)
            whole = whole and h is mask
        out[name] = (join(values)[None], m if whole else join(has)[None])
    return [out]


def nonfinite_tokens(x: torch.Tensor, m: torch.Tensor,
                     sides: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``[b, s]`` bool: tokens that count (``m``) holding a NaN/inf in ``x`` or, where a side
    input has a value (its ``has``), in that side input. NaN/inf outside those positions
    (padding) is ignored.

    When every side input covers exactly the counted tokens (``has is m``; ``[b, s]`` or a
    ``[b, 1]`` value per sequence), one probe: ``x * 0`` plus each input's ``* 0`` is 0
    where all are finite and NaN where one is not, so the check costs two kernels per
    input instead of ``isfinite``'s four or five.
    """
    b = m.shape[0]
    dense = all(has is m and v.dim() == 2 and v.shape[0] == b and v.shape[1] in (1, m.shape[1])
                for v, has in sides)
    if dense:
        probe = x * 0.0
        for v, _ in sides:
            probe = probe.add_(v, alpha=0) if v.dtype == probe.dtype else probe.add(v, alpha=0)
        return torch.isnan(probe) & m
    bad = nonfinite(x) & m
    for v, has in sides:
        extra = nonfinite(v) & has
        if extra.shape != bad.shape:  # a side input shorter than the tokens: none beyond it
            extra = torch.cat([extra, extra.new_zeros(b, bad.shape[1] - extra.shape[1])], 1)
        bad |= extra
    return bad


def cp_sum(t: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum ``t`` over the CP group on the device (one all_reduce; none for one rank).

    Every rank of the group must call it with the same shape.
    """
    if group is None or group_size(group) == 1:
        return t
    import torch.distributed as dist

    dev = comm_device(group)
    x = t.to(dev, non_blocking=True).contiguous() if t.device != dev else t.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x.to(t.device, non_blocking=True) if x.device != t.device else x


def cp_lead(metric: Any) -> bool:
    """True unless this rank is a non-first rank of its CP group.

    Sequence-level quantities (rewards, DPO pairs, GSPO sequence ratios) are the
    same on every CP rank once completed; only CP rank 0 contributes them, so the
    DP x CP reduction counts each sequence once.
    """
    return metric.sequence_group() is None or metric.resolve_mesh().cp_rank == 0


def common_length(metric: str, field: str, values: torch.Tensor, mask: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Truncate ``values`` ([b, s']) and ``mask`` ([b, s]) to a common length (Twinkle
    trims off-by-one differences from packing/SP the same way); ``values`` must be 2-D
    with the mask's batch size. ``field`` names the input in errors, e.g.
    ``"outputs['logps']"``."""
    if values.dim() != 2 or values.shape[0] != mask.shape[0]:
        raise ValueError(f"{metric}: {field} has shape {list(values.shape)} but the "
                         f"labels/mask are {list(mask.shape)}; pass [batch, seq] aligned to the labels")
    n = min(values.shape[1], mask.shape[1])
    if values.shape[1] == n == mask.shape[1]:
        return values, mask
    return values[:, :n], mask[:, :n]
