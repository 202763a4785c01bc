"""twinkle-metrics: Twinkle's training metrics, exact and cheap under Megatron and DeepSpeed.

The package is layered; each layer imports only the ones below it (``tests/package/test_layers.py``
checks this, and that no library module imports another in a circle)::

    integrations/   Megatron hooks and loss_func, CPU shim, loggers, plot, factory
    testing/        device-wait guard, collective counter, layout-invariance harness
    metrics/        lm/ (loss, accuracy, embedding), rl/ (GRPO family, DPO, rewards,
                    value, rollout, pass@k), system/ (train, norms, MoE routing,
                    the step guard),
                    vocab (the label-reach check of metrics that read logits)
    kernels/        torch reference and Triton version of each op that reads logits
    stats/          moments, quantile histograms (state declarations and their merges)
    core/           Metric, State, MetricCollection, slicing, configuration
    comm/           the fused sync, agreement inside accumulate, async calculate
    inputs/         records, pipeline microbatches, coercion and checks
    parallel        (top-level package) mesh, groups, layouts, adapters

``integrations`` and ``testing`` sit side by side: neither imports the other. This module
gathers the public names; no module of the package imports it.
"""
from parallel import DeviceMesh
from twinkle_metrics.comm.fused import MetricSyncError
from twinkle_metrics.comm.pending import CalculateHandle
from twinkle_metrics.core import fold
from twinkle_metrics.core.collection import MetricCollection
from twinkle_metrics.core.config import Schema
from twinkle_metrics.core.export import is_export
from twinkle_metrics.core.merge import agreed_results
from twinkle_metrics.core.metric import Metric, UnknownArgumentWarning
from twinkle_metrics.core.state import Origin, State
from twinkle_metrics.inputs.data_format import InputFeature, ModelOutput
from twinkle_metrics.inputs.fields import Reads
from twinkle_metrics.inputs.microbatch import microbatches
from twinkle_metrics.integrations.mtp_hooks import register_mtp_hooks
from twinkle_metrics.integrations.router_hooks import register_router_hooks
from twinkle_metrics.kernels.argmax import vocab_parallel_argmax
from twinkle_metrics.metrics import from_export
from twinkle_metrics.metrics.lm.accuracy import Accuracy
from twinkle_metrics.metrics.lm.embedding import EmbeddingMetric
from twinkle_metrics.metrics.lm.loss import LossMetric
from twinkle_metrics.metrics.lm.mtp import MTPMetric
from twinkle_metrics.metrics.rl.dpo import DPOMetric
from twinkle_metrics.metrics.rl.pass_at_k import PassAtKMetric
from twinkle_metrics.metrics.rl.policy import CISPOMetric, GRPOMetric, GSPOMetric, PPOMetric
from twinkle_metrics.metrics.rl.ppo_value import PPOValueMetric
from twinkle_metrics.metrics.rl.reward import CompletionRewardMetric
from twinkle_metrics.metrics.rl.rollout import RolloutMismatchMetric
from twinkle_metrics.metrics.rl.staleness import StalenessMetric
from twinkle_metrics.metrics.system.guard import GuardPolicy, StepGuard, Verdict
from twinkle_metrics.metrics.system.moe import MoERoutingMetric
from twinkle_metrics.metrics.system.norms import ModelNormMetric
from twinkle_metrics.metrics.system.train import TrainMetric

__all__ = ["DeviceMesh", "Metric", "MetricCollection", "State", "Origin", "Reads", "Schema", "InputFeature",
           "ModelOutput", "microbatches",
           "MetricSyncError", "TrainMetric", "LossMetric", "Accuracy", "MTPMetric", "EmbeddingMetric",
           "CompletionRewardMetric", "DPOMetric", "GRPOMetric", "GSPOMetric", "CISPOMetric",
           "PPOMetric", "PPOValueMetric", "RolloutMismatchMetric", "ModelNormMetric", "MoERoutingMetric",
           "PassAtKMetric", "StalenessMetric",
           "register_router_hooks", "UnknownArgumentWarning", "vocab_parallel_argmax", "CalculateHandle", "fold",
           "register_mtp_hooks", "is_export", "from_export", "agreed_results", "StepGuard", "GuardPolicy", "Verdict"]
__version__ = "0.2.0"
