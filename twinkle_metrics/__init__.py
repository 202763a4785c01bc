"""twinkle-metrics: Twinkle's training metrics, exact and cheap under Megatron and DeepSpeed."""
from parallel import DeviceMesh

from . import fold
from .accuracy import Accuracy
from .base import Metric, UnknownArgumentWarning
from .collection import MetricCollection
from .data_format import InputFeature, ModelOutput
from .dpo import DPOMetric
from .embedding import EmbeddingMetric
from .grpo import CISPOMetric, GRPOMetric, GSPOMetric, PPOMetric
from .kernels.argmax import vocab_parallel_argmax
from .loss import LossMetric
from .microbatch import microbatches
from .moe import MoERoutingMetric, register_router_hooks
from .norms import ModelNormMetric
from .pending import CalculateHandle
from .ppo_value import PPOValueMetric
from .reward import CompletionRewardMetric
from .rollout import RolloutMismatchMetric
from .state import State
from .sync import MetricSyncError
from .train import TrainMetric

__all__ = ["DeviceMesh", "Metric", "MetricCollection", "State", "InputFeature", "ModelOutput", "microbatches",
           "MetricSyncError", "TrainMetric", "LossMetric", "Accuracy", "EmbeddingMetric",
           "CompletionRewardMetric", "DPOMetric", "GRPOMetric", "GSPOMetric", "CISPOMetric",
           "PPOMetric", "PPOValueMetric", "RolloutMismatchMetric", "ModelNormMetric", "MoERoutingMetric",
           "register_router_hooks", "UnknownArgumentWarning", "vocab_parallel_argmax", "CalculateHandle", "fold"]
__version__ = "0.2.0"
