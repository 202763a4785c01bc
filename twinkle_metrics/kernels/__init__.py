"""The compute paths that read logits and the fused Triton kernels, each op as a pair: its
torch reference and its Triton version, side by side.

=========================  ===========================================  ===============================
op                         torch reference                              Triton version
=========================  ===========================================  ===============================
entropy                    ``entropy`` (``token_entropy``)              ``entropy_triton``
argmax, hits, keys         ``argmax`` (``local_argmax``, ``joined_hits``, ``argmax_triton``
                           ``argmax_keys``)
rl (GRPO family)           ``metrics.rl.policy.sums`` (GRPOMetric)      ``rl_triton.token_stats``
dpo row sums, pairs        ``metrics.rl.dpo.DPOMetric``                 ``dpo_triton``
rollout tokens, sequences  ``metrics.rl.rollout.RolloutMismatchMetric`` ``rollout_triton``
ppo                        ``metrics.rl.ppo_value.PPOValueMetric``      ``ppo_triton.token_stats``
moe                        ``metrics.system.moe.MoERoutingMetric``      ``moe_triton.layer_rows``
=========================  ===========================================  ===============================

The logits ops' torch paths live here; the statistics ops' torch paths are the metrics'
own steps (a metric file reads as its states, ``update`` and ``compute``), which choose the
kernel where ``dispatch`` says it applies. ``PAIRS`` lists every pair by module path (nothing
is imported from here: triton stays optional, and kernels never import metrics);
``tests/kernels/test_kernel_parity.py`` runs both sides of each on random inputs.

Beside them: ``dispatch`` (when the kernels run, and the fallback to torch when one cannot
be compiled or launched), ``triton_common`` (the ``@triton.jit`` helpers, the shared
finishing program and the views the kernels read).

Which side runs is one public switch, ``backend("auto" | "torch" | "triton")``: a setter,
or a context manager for a block (the parity tests run each pair through it)::

    from twinkle_metrics import kernels

    with kernels.backend("torch"):
        want = metric_call()
"""
from __future__ import annotations

import importlib
from typing import Any, NamedTuple

from twinkle_metrics.kernels.dispatch import BACKENDS, backend

__all__ = ["BACKENDS", "PAIRS", "KernelPair", "backend"]


class KernelPair(NamedTuple):
    """One op: where its torch reference and its Triton version live (``module:qualname``)."""

    op: str
    torch: str
    triton: str

    def load(self, side: str) -> Any:
        """The object ``side`` (``'torch'`` or ``'triton'``) names (imports its module)."""
        module, _, qualname = getattr(self, side).partition(":")
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj


_K = "twinkle_metrics.kernels."
_M = "twinkle_metrics.metrics."
#: every kernel pair; a new op is one row here (and one case in tests/kernels/test_kernel_parity.py)
PAIRS = (
    KernelPair("entropy", _K + "entropy:token_entropy", _K + "entropy_triton:triton_token_partials"),
    KernelPair("argmax", _K + "argmax:local_argmax", _K + "argmax_triton:triton_argmax"),
    KernelPair("argmax_hits", _K + "argmax:joined_hits", _K + "argmax_triton:triton_argmax_hits_joined"),
    KernelPair("argmax_keys", _K + "argmax:argmax_keys", _K + "argmax_triton:triton_argmax_keys"),
    KernelPair("rl", _M + "rl.policy.metric:GRPOMetric", _K + "rl_triton:token_stats"),
    KernelPair("dpo_row_sums", _M + "rl.dpo:DPOMetric", _K + "dpo_triton:masked_row_sums"),
    KernelPair("dpo_pairs", _M + "rl.dpo:DPOMetric", _K + "dpo_triton:pair_stats"),
    KernelPair("rollout", _M + "rl.rollout:RolloutMismatchMetric", _K + "rollout_triton:token_stats"),
    KernelPair("rollout_sequences", _M + "rl.rollout:RolloutMismatchMetric._sequence_sums",
               _K + "rollout_triton:sequence_stats"),
    KernelPair("ppo", _M + "rl.ppo_value:PPOValueMetric", _K + "ppo_triton:token_stats"),
    KernelPair("moe", _M + "system.moe:MoERoutingMetric", _K + "moe_triton:layer_rows"),
)
