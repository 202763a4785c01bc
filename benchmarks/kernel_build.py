"""``python -m benchmarks.kernel_build``: what ptxas reports for every Triton kernel
variant the metrics launch (registers, spills), compiled for sm_90 and sm_80 without a GPU.
The code is ``twinkle_metrics.kernels.build``, which the tests use too."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twinkle_metrics.kernels.build import main  # noqa: E402

if __name__ == "__main__":
    main()
