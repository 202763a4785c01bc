"""One helper that turns what a training step delivers into aligned microbatches.

A pipeline schedule hands a metric a ``List[InputFeature]`` (one per microbatch;
an empty list on stages other than the last) and outputs either as one dict whose
fields are lists (one entry per microbatch) or tensors concatenated along the
batch dim, or as a list of dicts. ``microbatches`` returns ``[(inputs, outputs)]``
pairs with each field sliced to its microbatch, or raises a clear error.
"""
from __future__ import annotations

from collections.abc import Mapping  # isinstance through typing.Mapping costs ~1 us a call
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

Pair = Tuple[Dict[str, Any], Dict[str, Any]]
BATCH_KEYS = ("labels", "input_ids", "completion_mask", "attention_mask", "position_ids")


def batch_size(metric: str, feature: Mapping[str, Any]) -> int:
    """Number of sequences in one ``InputFeature`` (1-D fields are one sequence)."""
    for key in BATCH_KEYS:
        value = feature.get(key)
        if value is None:
            continue
        value = host_array(metric, key, value)
        return 1 if value.dim() <= 1 else int(value.shape[0])
    raise ValueError(f"{metric}: an input feature has none of {list(BATCH_KEYS)}; pass labels "
                     f"(or input_ids) so the batch size is known; got keys {sorted(feature)}")


def host_array(metric: str, field: str, value: Any) -> torch.Tensor:
    """A feature field as a tensor: a tensor as it is; a host list (of lists) of numbers
    converted, or a TypeError naming the field: ragged rows (sequences of different
    lengths) and strings are not arrays."""
    if isinstance(value, torch.Tensor):
        return value
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{metric}: {field} must be a tensor or a rectangular list of numbers, one row per "
                        f"sequence padded to one length, got {type(value).__name__} ({e})") from None
    if t.is_complex():
        raise TypeError(f"{metric}: {field} must hold real numbers, got {t.dtype}")
    return t


def _nothing_without_inputs(metric: str, outputs: Any, fields: Sequence[str]) -> None:
    """No input features (``[]``: a stage without the loss) come with no data: outputs that
    hold some would be dropped silently."""
    if not isinstance(outputs, Mapping):
        return
    for key in fields:
        v = outputs.get(key)
        full = (isinstance(v, torch.Tensor) and v.numel() > 0) or (isinstance(v, (list, tuple)) and any(
            x is not None and not (isinstance(x, torch.Tensor) and x.numel() == 0) for x in v))
        if full:
            raise ValueError(f"{metric}: outputs[{key!r}] holds data but inputs is empty; pass the input "
                             "features (labels / masks) of those outputs, one per microbatch")


def has_field(outputs: Any, *fields: str) -> bool:
    """Whether ``outputs`` (one dict or a list of them) holds a value for any of ``fields``;
    metrics use it to reject per-token outputs that came without their inputs."""
    items = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return any(isinstance(o, Mapping) and any(o.get(f) is not None for f in fields) for o in items)


def as_feature_list(metric: str, inputs: Any) -> List[Dict[str, Any]]:
    """``None`` / one ``InputFeature`` / a list of them, as a list."""
    if inputs is None:
        return []
    if isinstance(inputs, Mapping):
        return [dict(inputs)]
    if isinstance(inputs, (list, tuple)):
        for i, item in enumerate(inputs):
            if not isinstance(item, Mapping):
                raise TypeError(f"{metric}: inputs[{i}] is a {type(item).__name__}, expected an "
                                "InputFeature dict")
        return [dict(x) for x in inputs]
    raise TypeError(f"{metric}: inputs must be an InputFeature dict or a list of them, got "
                    f"{type(inputs).__name__}")


def join(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-microbatch tensors flattened and joined in order (no copy for one part)."""
    flat = [p.reshape(-1) for p in parts]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def microbatches(metric: str, inputs: Any, outputs: Any, fields: Sequence[str]) -> List[Pair]:
    """Aligned ``(input feature, {field: value})`` pairs, one per microbatch.

    ``fields`` are the output fields the metric reads; missing or ``None`` fields are
    left out of the pairs (metrics skip what is absent, as Twinkle does). A field may
    be a per-microbatch list, a tensor concatenated along dim 0 over all microbatches,
    or (with one microbatch) anything.
    """
    feats = as_feature_list(metric, inputs)
    if isinstance(outputs, (list, tuple)):
        if feats and len(outputs) != len(feats):
            raise ValueError(f"{metric}: got {len(feats)} input microbatches but {len(outputs)} "
                             "output dicts; pass one output per microbatch")
        for i, o in enumerate(outputs):
            if o is not None and not isinstance(o, Mapping):
                raise TypeError(f"{metric}: outputs[{i}] is a {type(o).__name__}, expected a dict")
        if not feats:
            for o in outputs:
                _nothing_without_inputs(metric, o, fields)
            return []
        return [(f, {k: o[k] for k in fields if o is not None and o.get(k) is not None})
                for f, o in zip(feats, outputs)]
    if outputs is not None and not isinstance(outputs, Mapping):
        raise TypeError(f"{metric}: outputs must be a ModelOutput dict or a list of them, got "
                        f"{type(outputs).__name__}")
    if not feats:
        _nothing_without_inputs(metric, outputs, fields)
        return []
    outputs = outputs or {}
    sizes = [batch_size(metric, f) for f in feats]
    pairs: List[Pair] = [(f, {}) for f in feats]
    for key in fields:
        value = outputs.get(key)
        if value is None:
            continue
        for (_, out), part in zip(pairs, split_by_sizes(metric, key, value, sizes)):
            if part is not None:
                out[key] = part
    return pairs


def split_by_sizes(metric: str, key: str, value: Any, sizes: List[int]) -> List[Optional[Any]]:
    n = len(sizes)
    if isinstance(value, (list, tuple)):
        if n == 1 and len(value) != 1 and all(not isinstance(v, torch.Tensor) for v in value):
            return [value]  # a plain list of numbers for one batch
        if len(value) != n:
            raise ValueError(f"{metric}: outputs[{key!r}] has {len(value)} entries but there are {n} "
                             "input microbatches; pass one entry per microbatch or one tensor "
                             "concatenated along the batch dim")
        return list(value)
    if n == 1:
        return [value]
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        raise ValueError(f"{metric}: outputs[{key!r}] is a single value but there are {n} input "
                         "microbatches; pass a list with one entry per microbatch")
    if value.shape[0] != sum(sizes):
        raise ValueError(f"{metric}: outputs[{key!r}] has shape {list(value.shape)} but the {n} input "
                         f"microbatches hold {sum(sizes)} sequences ({sizes}); concatenate the "
                         "outputs along dim 0 in microbatch order, or pass a list")
    return list(torch.split(value, sizes, dim=0))
