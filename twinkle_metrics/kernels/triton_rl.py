"""The earlier module of three kernel families, now ``rl_triton`` (the GRPO family's token
statistics), ``dpo_triton`` (DPO's row sums and pair statistics) and ``triton_common`` (the
shared helpers and finishing program).

Kept for code written against it (``benchmarks/host_time.py`` swaps its kernels out): its
attributes are those modules' own, read and set through them, so ``triton_rl._rl_kernel = x``
replaces the kernel ``rl_triton.token_stats`` launches. New code imports the modules above.
"""
import sys
import types

from twinkle_metrics.kernels import dpo_triton, rl_triton, triton_common

OWNERS = (rl_triton, dpo_triton, triton_common)


class _Forwarding(types.ModuleType):
    """A module whose names are those of ``OWNERS`` (the first that has each)."""

    def __getattr__(self, name):
        for owner in OWNERS:
            if name in vars(owner):
                return vars(owner)[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __setattr__(self, name, value):
        if not name.startswith("__"):
            for owner in OWNERS:
                if name in vars(owner):
                    setattr(owner, name, value)
                    return
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()).union(*(vars(owner) for owner in OWNERS)))


sys.modules[__name__].__class__ = _Forwarding
