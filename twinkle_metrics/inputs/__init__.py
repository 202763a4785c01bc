"""What metrics read: Twinkle's records, pipeline microbatches, coercion and checks.

``data_format`` (``InputFeature``, ``ModelOutput``), ``microbatch`` (lists of
microbatches from pipeline schedules), ``checks`` (one coercion module that every
metric's errors come from) and ``rl`` (log-prob, mask and context-parallel helpers of
the RL metrics). Depends on ``parallel`` only.
"""
