"""The shipped metrics, by family.

* ``lm``: ``LossMetric``, ``Accuracy``, ``MTPMetric``, ``EmbeddingMetric``;
* ``rl``: the GRPO family (``GRPOMetric``, ``GSPOMetric``, ``CISPOMetric``,
  ``PPOMetric``), ``DPOMetric``, ``CompletionRewardMetric``, ``PPOValueMetric``,
  ``RolloutMismatchMetric``, ``PassAtKMetric``, ``StalenessMetric``;
* ``system``: ``TrainMetric``, ``ModelNormMetric``, ``MoERoutingMetric``, ``StepGuard`` (the
  per-step NaN and loss-spike verdict);
* ``vocab``: the label-reach check shared by the metrics that read logits.

Each metric is ``State`` declarations plus ``update`` and ``compute`` (see
``twinkle_metrics.core.metric``). Depends on ``kernels``, ``stats``, ``core``, ``comm``,
``inputs`` and ``parallel``; never on ``integrations`` or ``testing``. ``SHIPPED`` names
every shipped metric class: what a config's ``{"type": "LossMetric"}`` builds
(``integrations.factory``).
"""
from typing import Any, Dict, Mapping, Sequence, Tuple, Type, Union

from twinkle_metrics.core.collection import MetricCollection
from twinkle_metrics.core.export import decode
from twinkle_metrics.core.metric import Metric
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
from twinkle_metrics.metrics.system.guard import StepGuard
from twinkle_metrics.metrics.system.moe import MoERoutingMetric
from twinkle_metrics.metrics.system.norms import ModelNormMetric
from twinkle_metrics.metrics.system.train import TrainMetric

#: every shipped metric class by name, sorted
SHIPPED: Dict[str, Type[Metric]] = {cls.__name__: cls for cls in sorted((
    Accuracy, CISPOMetric, CompletionRewardMetric, DPOMetric, EmbeddingMetric, GRPOMetric, GSPOMetric, LossMetric,
    ModelNormMetric, MoERoutingMetric, MTPMetric, PassAtKMetric, PPOMetric, PPOValueMetric, RolloutMismatchMetric,
    StalenessMetric, StepGuard, TrainMetric), key=lambda cls: cls.__name__)}


def from_export(export: Union[Mapping[str, Any], Sequence[Mapping[str, Any]]]) -> MetricCollection:
    """The driver's metrics for ``export`` (or a list of exports: every metric any of them
    carries), built from the exported class names and constructor arguments, with no mesh.

    Only the library's own metric classes (``SHIPPED``, the metric classes of
    ``twinkle_metrics.__all__``) are looked up, by name; nothing named by the data is
    imported. A custom metric's export needs a driver metric the user builds. Raises
    ``ValueError`` naming the export and the metric when a class is not the library's,
    an argument was not exported as JSON, or the rebuilt metric's fingerprint differs.

    Example::

        driver = from_export(exports[0])            # the same metrics, names and arguments
        results = driver.calculate_from(exports)
    """
    what = "from_export"
    exports = list(export) if isinstance(export, (list, tuple)) else [export]
    if not exports:
        raise ValueError(f"{what}: got an empty list; pass an export() value (or several)")
    items: Dict[Tuple[str, str], Metric] = {}
    for i, value in enumerate(exports):
        for e in decode(value, i, what):
            key = (e.name, e.cls)
            if key in items:
                if items[key].sync_fingerprint() != e.fingerprint:
                    raise ValueError(f"{what}: export {i} carries {e.label} with other arguments ({e.fingerprint}) "
                                     f"than an earlier export ({items[key].sync_fingerprint()})")
                continue
            cls = SHIPPED.get(e.cls)
            if cls is None:
                raise ValueError(f"{what}: export {i} carries {e.label}, which is not a metric class of "
                                 f"twinkle_metrics ({sorted(SHIPPED)}); build that driver metric yourself, with "
                                 "the workers' arguments, and call its calculate_from")
            if e.unexported:
                raise ValueError(f"{what}: export {i}: {e.label} was built with arguments that are not plain JSON "
                                 f"({e.unexported}); build the driver metric yourself with them")
            try:
                metric = cls(**e.arguments)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{what}: export {i}: {e.label} cannot be built from its exported arguments "
                                 f"{e.arguments}: {exc}") from None
            if metric.sync_fingerprint() != e.fingerprint:
                raise ValueError(f"{what}: export {i}: {e.label} rebuilt from its arguments is "
                                 f"{metric.sync_fingerprint()}, but the workers' is {e.fingerprint} (an argument "
                                 "was changed after construction, or another library version exported it); build "
                                 "the driver metric yourself")
            items[key] = metric
    names = [name for name, _ in items]
    if all(name == "" for name in names):
        return MetricCollection(list(items.values()))
    if len(set(names)) < len(names):
        raise ValueError(f"{what}: the exports carry metrics under the names {names}, some twice (from several "
                         "collections); build the driver's collection yourself")
    return MetricCollection({name: m for (name, _), m in items.items()})
