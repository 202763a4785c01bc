"""verl's own code, read from the installed verl 0.9 (``pip install --no-deps verl``).

``import verl`` runs ``verl/__init__.py``, which pulls ray, tensordict, transformers and
more; the pieces the metrics travel through import only numpy and torch. So
``verl/utils/metric/utils.py`` (``reduce_metrics``, ``Metric``) is loaded by its path, and
the two helpers the workers' dict goes through (``allgather_dict_into_dict``,
``append_to_dict``) are compiled from their source in verl's files, each alone.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import sys
from itertools import chain

import pytest
import torch

VERSION = "0.9.1"


def root() -> str:
    """The installed verl package's folder; skips the test when verl is not installed."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"verl is not installed (make test installs verl=={VERSION} with --no-deps)")
    return list(spec.submodule_search_locations)[0]


def source(rel: str) -> str:
    with open(os.path.join(root(), rel), encoding="utf-8") as f:
        return f.read()


def metric_utils():
    """``verl/utils/metric/utils.py`` as a module of its own (registered under its name, so
    that its ``Metric`` objects pickle between ranks, as in verl's gathers)."""
    name = "_verl_metric_utils"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(root(), "utils", "metric", "utils.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def function(rel: str, name: str, namespace: dict):
    """The function ``name`` of verl's file ``rel``, compiled alone in ``namespace``."""
    tree = ast.parse(source(rel))
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    code = compile(ast.Module(body=[node], type_ignores=[]), os.path.join(root(), rel), "exec")
    exec(code, namespace)  # verl's own source, from its installed file
    return namespace[name]


def worker_helpers():
    """verl's ``allgather_dict_into_dict`` and ``append_to_dict``, and its ``Metric``."""
    utils = metric_utils()
    gather = function("utils/torch_functional.py", "allgather_dict_into_dict", {"torch": torch})
    append = function("utils/py_functional.py", "append_to_dict", {"Metric": utils.Metric})
    return gather, append, utils.Metric


#: the line of ``ActorRolloutRefWorker.train_mini_batch`` (engine_workers.py) that flattens
#: the gathered lists of each mini-batch; ``flatten_mini_batch`` does the same
FLATTEN = "else list(chain.from_iterable(val))"


def flatten_mini_batch(output: dict, Metric) -> dict:
    """What ``train_mini_batch`` does to one mini-batch's gathered metrics (verl 0.9.1,
    ``verl/workers/engine_workers.py``), checked against that file's text."""
    assert FLATTEN in source("workers/engine_workers.py"), "verl's train_mini_batch changed: update this copy"
    for key, val in output.items():
        if isinstance(val, list):
            output[key] = Metric.aggregate_dp(val) if isinstance(val[0], Metric) else list(chain.from_iterable(val))
    return output
