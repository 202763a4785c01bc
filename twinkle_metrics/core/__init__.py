"""The metric contract: ``Metric``, ``State``, ``MetricCollection``, slicing, configuration.

Depends on ``comm`` (the fused sync), ``inputs`` (coercion) and the top-level
``parallel`` package; nothing under ``core`` imports ``stats``, ``kernels``, ``metrics``,
``integrations`` or ``testing``.
"""
