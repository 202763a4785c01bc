from setuptools import find_packages, setup

setup(
    name="twinkle-metrics",
    version="0.1.0",
    description="Twinkle's training metrics, exact and cheap under Megatron and DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["twinkle_metrics", "twinkle_metrics.*", "parallel", "parallel.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.3"],
    extras_require={
        "megatron": ["megatron-core>=0.16,<0.17"],
        "deepspeed": ["deepspeed>=0.19,<0.20"],
        "loggers": ["tensorboard", "matplotlib", "tqdm", "wandb"],
        "test": ["pytest", "pytest-xdist", "numpy"],
    },
)
