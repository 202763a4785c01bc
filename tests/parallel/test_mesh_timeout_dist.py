"""Groups the mesh creates inherit the init timeout; dead meshes raise (own 4-rank pool).

This module starts its own pool with a 4 s ``init_process_group`` timeout, lets a
collective time out on it, then shuts torch.distributed down on it, and closes it.
"""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from parallel import groups as G
from twinkle_metrics import LossMetric

pytestmark = pytest.mark.xdist_group("dist")

INIT_TIMEOUT_S = 4


@pytest.fixture(scope="module")
def short_pool():
    from tests.dist import DistPool

    pool = DistPool(4, timeout_s=INIT_TIMEOUT_S)
    yield pool
    pool.close()


def case_timeout_inherited():
    mesh = DeviceMesh.from_sizes(tp_size=2, dp_size=2)
    default = G.default_timeout()
    held = {n: G.group_timeout(mesh.get_group(n)) for n in ("tp", "dp", "mp", "dp_cp")}
    explicit = DeviceMesh.from_sizes(tp_size=2, dp_size=2, timeout=timedelta(seconds=9))
    metric = LossMetric(mesh, loss_reduction="sum")
    metric.accumulate(None, [{"lm loss": torch.tensor([2.0, 4.0], dtype=torch.float64)}])
    if dist.get_rank() == 3:
        return default, held, G.group_timeout(explicit.tp_group), None, None, 0.0
    start = time.monotonic()
    try:
        metric.calculate()
        error = None
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        error = exc
    elapsed = time.monotonic() - start
    return (default, held, G.group_timeout(explicit.tp_group), type(error).__name__,
            str(error)[:300], elapsed)


def _live_error_after(destroy):
    """check_live's message after ``destroy(mesh)``; None if it did not raise."""
    mesh = DeviceMesh.from_sizes(tp_size=2)
    mesh.check_live("calculate()")
    destroy(mesh)
    try:
        mesh.check_live("calculate()")
    except RuntimeError as exc:
        return str(exc)
    return None


def case_destroyed_world():
    return _live_error_after(lambda mesh: dist.destroy_process_group())


def test_created_groups_inherit_the_init_timeout_and_a_missing_rank_fails_fast(short_pool):
    out = short_pool.run(case_timeout_inherited, timeout=120)
    for rank, (default, held, explicit, kind, _text, elapsed) in enumerate(out):
        assert default == timedelta(seconds=INIT_TIMEOUT_S)
        assert held == {n: default for n in held}, held
        assert explicit == timedelta(seconds=9)
        if rank == 3:
            continue
        assert kind is not None, f"rank {rank} did not fail although rank 3 skipped calculate()"
        assert elapsed < 30, f"rank {rank} waited {elapsed:.1f}s (torch's default is 30 min)"
    # The pool's collectives are now broken: check the shut-down case, then close it.
    for text in short_pool.run(case_destroyed_world, timeout=60):
        assert text is not None and "no longer initialised" in text and "calculate()" in text


def case_destroyed_subgroup():
    return _live_error_after(lambda mesh: dist.destroy_process_group(mesh.tp_group))


def test_destroyed_subgroup_raises(dist_pool):
    for text in dist_pool.run(case_destroyed_subgroup):
        assert text is not None and "'tp' group" in text and "destroyed" in text
