"""Packaging: metadata lives in pyproject.toml; this file maps what it cannot express.

The demo and library configs live at the repository's top level (``configs/``) and
ship inside the wheel as ``twinkle_metrics.configs``, so ``load_config("megatron_demo")``
works from a checkout and from an installed package alike.
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["twinkle_metrics", "twinkle_metrics.*", "parallel", "parallel.*"])
    + ["twinkle_metrics.configs"],
    package_dir={"twinkle_metrics.configs": "configs"},
    package_data={"twinkle_metrics": ["py.typed"], "parallel": ["py.typed"],
                  "twinkle_metrics.configs": ["*.json"]},
)
