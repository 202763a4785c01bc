"""The compute paths that read logits (per-token entropy, vocab-parallel argmax) and the
fused per-token RL statistics (``triton_rl``).

Kept apart from the metrics so that a metric file reads as its states, ``update``
and ``compute``, and so that device-specific implementations of these paths have
one place to live beside the torch ones.
"""
