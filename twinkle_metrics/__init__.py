"""twinkle-metrics: Twinkle's training metrics, exact and cheap under Megatron and DeepSpeed."""
from .accuracy import Accuracy, vocab_parallel_argmax
from .base import Metric
from .collection import MetricCollection
from .data_format import InputFeature, ModelOutput
from .embedding import EmbeddingMetric
from .loss import LossMetric
from .microbatch import microbatches
from .state import State
from .sync import MetricSyncError
from .train import TrainMetric

__all__ = ["Metric", "MetricCollection", "State", "InputFeature", "ModelOutput", "microbatches",
           "MetricSyncError", "TrainMetric", "LossMetric", "Accuracy", "EmbeddingMetric",
           "vocab_parallel_argmax"]
__version__ = "0.1.0"
