"""Where the metrics meet a training script: Megatron hooks and ``loss_func``, the
megatron-core CPU shim, loggers, plots and the config-driven factory.

The top of the import graph: ``launch -> integrations -> metrics -> core -> comm ->
parallel``. Nothing below imports from here.
"""
