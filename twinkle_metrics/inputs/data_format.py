"""Input and output records, as in Twinkle's ``twinkle.data_format``.

Both are ``TypedDict``s with every field optional: plain dicts work.
"""
from __future__ import annotations

from typing import Any, List, Optional, TypedDict, Union

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
