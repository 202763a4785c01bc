"""The shipped metrics, by family.

* ``lm``: ``LossMetric``, ``Accuracy``, ``EmbeddingMetric``;
* ``rl``: the GRPO family (``GRPOMetric``, ``GSPOMetric``, ``CISPOMetric``,
  ``PPOMetric``), ``DPOMetric``, ``CompletionRewardMetric``, ``PPOValueMetric``,
  ``RolloutMismatchMetric``, ``PassAtKMetric``, ``StalenessMetric``;
* ``system``: ``TrainMetric``, ``ModelNormMetric``, ``MoERoutingMetric``;
* ``vocab``: the label-reach check shared by the metrics that read logits.

Each metric is ``State`` declarations plus ``update`` and ``compute`` (see
``twinkle_metrics.core.metric``). Depends on ``kernels``, ``stats``, ``core``, ``comm``,
``inputs`` and ``parallel``; never on ``integrations`` or ``testing``. ``SHIPPED`` names
every shipped metric class: what a config's ``{"type": "LossMetric"}`` builds
(``integrations.factory``).
"""
from typing import Dict, Type

from twinkle_metrics.core.metric import Metric
from twinkle_metrics.metrics.lm.accuracy import Accuracy
from twinkle_metrics.metrics.lm.embedding import EmbeddingMetric
from twinkle_metrics.metrics.lm.loss import LossMetric
from twinkle_metrics.metrics.rl.dpo import DPOMetric
from twinkle_metrics.metrics.rl.grpo import CISPOMetric, GRPOMetric, GSPOMetric, PPOMetric
from twinkle_metrics.metrics.rl.pass_at_k import PassAtKMetric
from twinkle_metrics.metrics.rl.ppo_value import PPOValueMetric
from twinkle_metrics.metrics.rl.reward import CompletionRewardMetric
from twinkle_metrics.metrics.rl.rollout import RolloutMismatchMetric
from twinkle_metrics.metrics.rl.staleness import StalenessMetric
from twinkle_metrics.metrics.system.moe import MoERoutingMetric
from twinkle_metrics.metrics.system.norms import ModelNormMetric
from twinkle_metrics.metrics.system.train import TrainMetric

#: every shipped metric class by name, sorted
SHIPPED: Dict[str, Type[Metric]] = {cls.__name__: cls for cls in sorted((
    Accuracy, CISPOMetric, CompletionRewardMetric, DPOMetric, EmbeddingMetric, GRPOMetric, GSPOMetric, LossMetric,
    ModelNormMetric, MoERoutingMetric, PassAtKMetric, PPOMetric, PPOValueMetric, RolloutMismatchMetric,
    StalenessMetric, TrainMetric), key=lambda cls: cls.__name__)}
