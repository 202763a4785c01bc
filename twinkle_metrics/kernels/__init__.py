"""The compute paths that read logits (per-token entropy, vocab-parallel argmax) and the
fused Triton kernels: the GRPO family's and DPO's statistics (``triton_rl``, with the shared
finishing program), ``RolloutMismatchMetric``'s (``triton_rollout``), ``PPOValueMetric``'s
(``triton_ppo``) and ``MoERoutingMetric``'s routing statistics (``triton_moe``).

Kept apart from the metrics so that a metric file reads as its states, ``update``
and ``compute``, and so that device-specific implementations of these paths have
one place to live beside the torch ones.
"""
