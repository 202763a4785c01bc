"""Input and output records, as in Twinkle's ``twinkle.data_format``, and what a call carries.

Both records are ``TypedDict``s with every field optional: plain dicts work. ``Inputs`` and
``Outputs`` are what ``Metric.accumulate`` and ``Metric.update`` take.
"""
from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence, TypedDict, Union

import torch

InputType = Union[torch.Tensor, List[int], List[List[int]], Any]
OutputType = Union[torch.Tensor, List[torch.Tensor], float, Any]


class InputFeature(TypedDict, total=False):
    """One batch (or one pipeline microbatch) of model inputs.

    ``labels`` use ``ignore_index`` (-100) for tokens without a target;
    ``completion_mask`` (RL) marks the tokens that count, and wins over labels.
    """

    input_ids: InputType
    attention_mask: InputType
    position_ids: InputType
    labels: InputType
    completion_mask: InputType
    length: int


class ModelOutput(TypedDict, total=False):
    """What the model (or loss function) returned for that batch."""

    logits: Optional[OutputType]
    loss: Optional[OutputType]
    logps: Optional[OutputType]
    entropies: Optional[OutputType]
    values: Optional[OutputType]
    num_tokens: Optional[OutputType]
    embeddings: Optional[OutputType]


#: ``inputs`` of a call: one record, a list of them (one per pipeline microbatch; ``[]`` on a
#: stage without the loss), or None
Inputs = Union[InputFeature, Mapping[str, Any], Sequence[Mapping[str, Any]], None]
#: ``outputs`` of a call: one record, a list of them (None for a microbatch without outputs),
#: or None
Outputs = Union[ModelOutput, Mapping[str, Any], Sequence[Optional[Mapping[str, Any]]], None]
#: a keyword side input (log-probs, advantages, rewards, ids, versions): a tensor, or a list (of
#: numbers, of ids, or one entry per microbatch), or None
SideInput = Union[torch.Tensor, Sequence[Any], None]
