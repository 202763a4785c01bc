"""The earlier name of ``twinkle_metrics.kernels.dispatch``: the same module object under
both names, so a switch set through one (``_triton.device_ok = ...``) is seen through the
other."""
import sys

from twinkle_metrics.kernels import dispatch

sys.modules[__name__] = dispatch
