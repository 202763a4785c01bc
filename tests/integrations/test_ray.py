"""A real Ray (CPU, ``ray.init(num_cpus=2)``): the Ray program of docs/single-controller.md,
run as written (2 data-parallel actors; it checks its own numbers against one process), and a
worker group of 4 actors that form a gloo process group, build a TP2 x DP2 mesh, accumulate
shards and return ``export()`` through ``ray.get``; the driver (a process of its own, with no
process group) merges with ``calculate_from`` what one process holding everything gives. Ray
is a test dependency only."""
import importlib.util
import json
import multiprocessing as mp
import os

import pytest

from parallel import DeviceMesh
from tests.integrations import rayworker
from twinkle_metrics import from_export
from twinkle_metrics.testing import assert_results_close

# beside the pool's tests (one heavy multi-process test at a time on a 2-core machine)
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("dist")]
ROOT = os.path.abspath(os.path.join(__file__, "../../.."))


def _drive(seeds):
    """``rayworker.drive`` in a spawned process of its own (Ray's threads never enter this
    process, which forks the ranks of other tests)."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (the test extra installs it)")
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(rayworker.drive, (seeds, _doc_block("ray")))


def _doc_block(name):
    from tests.docs.test_readme import blocks

    return next(code for marker, _, code in blocks("docs/single-controller.md") if marker == name)


def _whole(seeds):
    metrics = rayworker.make_metrics(DeviceMesh.single())
    for seed in seeds:
        rayworker.feed(metrics, seed, range(rayworker.N_SEQ))
    return metrics.calculate()


def test_ray_actor_group_exports_merge_on_the_driver(monkeypatch):
    # the actors import tests.integrations.rayworker: the repository on their path (they inherit the env)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    out = _drive((3, 4))
    assert not out["left"], f"Ray left processes behind: {out['left']}"
    doc = out["doc"]  # the documentation's program ran to its end (its own check passed)
    assert sorted(doc["results"]) == ["acc/accuracy", "acc/correct_tokens", "acc/total_tokens", "lm/loss",
                                      "lm/num_tokens"]
    assert doc["results"]["acc/total_tokens"] == int((doc["labels"] != -100).sum()) == 16
    steps = out["steps"]
    exports = [json.loads(json.dumps(e, allow_nan=False)) for step in steps for e in step]  # plain JSON
    driver = rayworker.make_metrics()
    first = driver.calculate_from(steps[0])
    assert_results_close(first, _whole([3]))
    assert first["acc/accuracy"] > 0 and first["lm/num_tokens"] > 0
    assert_results_close(from_export(exports).calculate_from(exports, merge_intervals=True), _whole([3, 4]))
    # the data sources alone (TP rank 0 of each DP rank) give the same
    sources = [e for e in steps[1] if e["place"]["source"]]
    assert len(sources) == rayworker.DP
    assert_results_close(driver.calculate_from(sources), _whole([4]))
    with pytest.raises(ValueError, match="data shard"):
        driver.calculate_from(sources[:1])
