"""twinkle-metrics: Twinkle's training metrics, exact and cheap under Megatron and DeepSpeed.

The package is layered; each layer imports only the ones below it::

    integrations/   Megatron hooks and loss_func, CPU shim, loggers, plot, factory
    metrics/        lm/ (loss, accuracy, embedding), rl/ (GRPO family, DPO, rewards,
                    value, rollout), system/ (train, norms, MoE routing)
    kernels/        torch reference and Triton version of each op that reads logits
    core/           Metric, State, MetricCollection, slicing, configuration
    stats/          moments, quantile histograms
    inputs/         records, pipeline microbatches, coercion and checks
    comm/           the fused sync, agreement inside accumulate, async calculate
    parallel        (top-level package) mesh, groups, layouts, adapters

``comm`` is the layer earlier releases called ``sync``: ``twinkle_metrics.sync`` is its
``fused`` module, as the old module was. ``testing`` (the device-wait guard, the collective
counter and the layout-invariance harness) ships beside them. Module paths of earlier
releases (``twinkle_metrics.grpo``, ``twinkle_metrics.megatron``, ...) still import: they
name the modules above (see ``MOVED``).
"""
import importlib
import importlib.abc
import importlib.util
import sys

from parallel import DeviceMesh

#: module paths of earlier releases -> where the module lives now
MOVED = {
    "base": "core.metric", "state": "core.state", "collection": "core.collection", "fold": "core.fold",
    "slicing": "core.slicing", "_compat": "core.compat",
    "sync": "comm.fused", "exchange": "comm.agreement", "pending": "comm.pending", "_host": "comm.host",
    "_order": "comm.order",
    "microbatch": "inputs.microbatch", "data_format": "inputs.data_format", "_checks": "inputs.checks",
    "rl_inputs": "inputs.rl", "moments": "stats.moments", "histogram": "stats.histogram",
    "loss": "metrics.lm.loss", "accuracy": "metrics.lm.accuracy", "embedding": "metrics.lm.embedding",
    "grpo": "metrics.rl.grpo", "dpo": "metrics.rl.dpo", "reward": "metrics.rl.reward",
    "ppo_value": "metrics.rl.ppo_value", "rollout": "metrics.rl.rollout",
    "train": "metrics.system.train", "norms": "metrics.system.norms", "moe": "metrics.system.moe",
    "megatron": "integrations.megatron", "megatron_cpu": "integrations.megatron_cpu",
    "loggers": "integrations.loggers", "factory": "integrations.factory",
    "kernels.triton_entropy": "kernels.entropy_triton", "kernels.triton_argmax": "kernels.argmax_triton",
    "kernels.triton_ppo": "kernels.ppo_triton", "kernels.triton_rollout": "kernels.rollout_triton",
    "kernels.triton_moe": "kernels.moe_triton",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``twinkle_metrics.<old>`` as the module it moved to: the same module
    object under both names, so attributes set through one are seen through the other."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.partition(".")
        if prefix != __name__ or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{MOVED[spec.name.partition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import machinery sets __spec__ to the alias's
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())

from twinkle_metrics.comm.fused import MetricSyncError  # noqa: E402
from twinkle_metrics.comm.pending import CalculateHandle  # noqa: E402
from twinkle_metrics.core import fold  # noqa: E402
from twinkle_metrics.core.collection import MetricCollection  # noqa: E402
from twinkle_metrics.core.metric import Metric, UnknownArgumentWarning  # noqa: E402
from twinkle_metrics.core.state import Origin, State  # noqa: E402
from twinkle_metrics.inputs.data_format import InputFeature, ModelOutput  # noqa: E402
from twinkle_metrics.inputs.microbatch import microbatches  # noqa: E402
from twinkle_metrics.kernels.argmax import vocab_parallel_argmax  # noqa: E402
from twinkle_metrics.metrics.lm.accuracy import Accuracy  # noqa: E402
from twinkle_metrics.metrics.lm.embedding import EmbeddingMetric  # noqa: E402
from twinkle_metrics.metrics.lm.loss import LossMetric  # noqa: E402
from twinkle_metrics.metrics.rl.dpo import DPOMetric  # noqa: E402
from twinkle_metrics.metrics.rl.grpo import CISPOMetric, GRPOMetric, GSPOMetric, PPOMetric  # noqa: E402
from twinkle_metrics.metrics.rl.pass_at_k import PassAtKMetric  # noqa: E402
from twinkle_metrics.metrics.rl.ppo_value import PPOValueMetric  # noqa: E402
from twinkle_metrics.metrics.rl.reward import CompletionRewardMetric  # noqa: E402
from twinkle_metrics.metrics.rl.rollout import RolloutMismatchMetric  # noqa: E402
from twinkle_metrics.metrics.rl.staleness import StalenessMetric  # noqa: E402
from twinkle_metrics.metrics.system.moe import MoERoutingMetric, register_router_hooks  # noqa: E402
from twinkle_metrics.metrics.system.norms import ModelNormMetric  # noqa: E402
from twinkle_metrics.metrics.system.train import TrainMetric  # noqa: E402

__all__ = ["DeviceMesh", "Metric", "MetricCollection", "State", "Origin", "InputFeature", "ModelOutput", "microbatches",
           "MetricSyncError", "TrainMetric", "LossMetric", "Accuracy", "EmbeddingMetric",
           "CompletionRewardMetric", "DPOMetric", "GRPOMetric", "GSPOMetric", "CISPOMetric",
           "PPOMetric", "PPOValueMetric", "RolloutMismatchMetric", "ModelNormMetric", "MoERoutingMetric",
           "PassAtKMetric", "StalenessMetric",
           "register_router_hooks", "UnknownArgumentWarning", "vocab_parallel_argmax", "CalculateHandle", "fold"]
__version__ = "0.2.0"
