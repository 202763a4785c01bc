"""The shipped metrics, by family.

* ``lm``: ``LossMetric``, ``Accuracy``, ``EmbeddingMetric``;
* ``rl``: the GRPO family (``GRPOMetric``, ``GSPOMetric``, ``CISPOMetric``,
  ``PPOMetric``), ``DPOMetric``, ``CompletionRewardMetric``, ``PPOValueMetric``,
  ``RolloutMismatchMetric``;
* ``system``: ``TrainMetric``, ``ModelNormMetric``, ``MoERoutingMetric``.

Each metric is ``State`` declarations plus ``update`` and ``compute`` (see
``twinkle_metrics.core.metric``). Depends on ``core``, ``inputs``, ``stats`` and
``kernels``; never on ``integrations``.
"""
