"""A real Ray (CPU, ``ray.init(num_cpus=2)``) worker group: 4 actors form a gloo process
group, build a TP2 x DP2 mesh, accumulate shards and return ``export()`` through
``ray.get``; the driver (this process, no process group) merges with ``calculate_from``
what one process holding everything gives. Ray is a test dependency only."""
import importlib.util
import json
import os
import shutil
import tempfile
import time

import pytest

from parallel import DeviceMesh
from tests import rayworker
from twinkle_metrics import from_export
from twinkle_metrics.testing import Rendezvous, assert_results_close

# beside the pool's tests (one heavy multi-process test at a time on a 2-core machine)
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("dist")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: how long Ray's processes may take to go after ray.shutdown() on a busy machine
GONE_S = 120


def _descendants(pid: int) -> set:
    """The processes under ``pid`` (from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, set()).add(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


@pytest.fixture
def ray_local(monkeypatch):
    """A local Ray of 2 CPUs: no dashboard, quiet, its files in a fresh temp folder; shut
    down at the end, its processes gone."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (the test extra installs it)")
    import ray

    # the actors import tests.rayworker: the repository on their path (they inherit the env)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = _descendants(os.getpid())
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             object_store_memory=100 * 1024 ** 2, _temp_dir=temp)
    try:
        yield ray
    finally:
        ray.shutdown()
        deadline = time.monotonic() + GONE_S
        while _descendants(os.getpid()) - before and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _descendants(os.getpid()) - before
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray left processes behind: {sorted(left)}"


def _doc_block(name):
    from tests.test_readme import blocks

    return next(code for marker, _, code in blocks("docs/single-controller.md") if marker == name)


def _whole(seeds):
    metrics = rayworker.make_metrics(DeviceMesh.single())
    for seed in seeds:
        rayworker.feed(metrics, seed, range(rayworker.N_SEQ))
    return metrics.calculate()


def test_ray_actor_group_exports_merge_on_the_driver(ray_local):
    ray = ray_local
    world = rayworker.TP * rayworker.DP
    Worker = ray.remote(num_cpus=2 / world)(rayworker.Worker)
    with Rendezvous() as rdzv:  # the driver hosts the store on a port of its own: no race
        workers = [Worker.remote(r, world, rdzv.host, rdzv.port) for r in range(world)]
        try:
            steps = [ray.get([w.step.remote(seed) for w in workers]) for seed in (3, 4)]
            # docs/single-controller.md's Ray block, as written, for a third step
            ns = {"ray": ray, "workers": workers, "seed": 5, "make_metrics": rayworker.make_metrics}
            exec(compile(_doc_block("ray-driver"), "docs/single-controller.md (Ray)", "exec"), ns)
        finally:
            ray.get([w.close.remote() for w in workers])
    assert_results_close(ns["results"], _whole([5]))
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
