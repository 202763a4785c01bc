"""``python -m benchmarks.kernel_build``: what ptxas reports for every Triton kernel
variant the metrics launch (registers, spills), compiled for sm_90 and sm_80 without a GPU.
The variants and the compiling are ``twinkle_metrics.kernels.build``, which the tests use
too; this command saves its ``report()`` under ``benchmarks/results``."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import save  # noqa: E402
from twinkle_metrics.kernels.build import report  # noqa: E402


def main():
    out = report()
    saved = save("kernel_build", {"kernels": out}, "python -m benchmarks.kernel_build")
    width = max(map(len, out))
    for k, v in out.items():
        print(f"{k:<{width}}  {v}")
    print("saved", saved)


if __name__ == "__main__":
    main()
