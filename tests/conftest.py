"""Shared fixtures, and the three test tiers as markers (see pytest.ini).

Every collected test gets exactly one tier marker, from where it lives:

* ``e2e``: real processes running the launch scripts, the README recipe in megatron-core's
  own loop, the built wheel (``tests/e2e/test_launch_e2e.py``, ``tests/e2e/test_packaging.py``, and
  every test marked ``slow``);
* ``multirank``: real gloo ranks (``tests/**/*_dist.py``, and any test using ``dist_pool``);
* ``unit``: the rest, one process.

A test that carries a tier marker itself keeps it. ``pytest -m unit`` (or ``multirank``,
``e2e``) runs one tier; ``make test-unit`` etc. do the same.

Beside the tier, ``megatron`` marks what needs megatron-core: every test of
``MEGATRON_FILES``, and elsewhere the tests (or parameters) that carry
``@pytest.mark.megatron`` themselves. ``make test`` runs them a second time on the newest
megatron-core (``-m megatron``, Python 3.12).
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TIERS = ("unit", "multirank", "e2e")
#: whole files of the end-to-end tier (beside every test marked ``slow``)
E2E_FILES = {"test_launch_e2e.py", "test_packaging.py"}
#: whole files whose tests all need megatron-core (marked ``megatron`` here)
MEGATRON_FILES = {"test_megatron_loop.py", "test_megatron_gtp_dist.py", "test_norms_dist.py"}


def tier(item) -> str:
    own = [t for t in TIERS if item.get_closest_marker(t) is not None]
    if own:
        return own[0]
    name = os.path.basename(str(item.fspath))
    if name in E2E_FILES or item.get_closest_marker("slow") is not None:
        return "e2e"
    if name.endswith("_dist.py") or "dist_pool" in getattr(item, "fixturenames", ()):
        return "multirank"
    return "unit"


def pytest_collection_modifyitems(config, items):
    for item in items:
        t = tier(item)
        if item.get_closest_marker(t) is None:
            item.add_marker(getattr(pytest.mark, t))
        if os.path.basename(str(item.fspath)) in MEGATRON_FILES and item.get_closest_marker("megatron") is None:
            item.add_marker(pytest.mark.megatron)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Under ``-n 2 --dist loadgroup`` every multi-rank test must land on one worker (one rank
    pool); a pytest/xdist pair that drops the group silently doubles the suite's time."""
    config = session.config
    if not hasattr(config, "workerinput") or not getattr(config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(f"pytest-xdist did not group {len(lost)} tests (e.g. {lost[0]}): this "
                                "pytest and pytest-xdist do not work together; install the pinned test extra")


@pytest.fixture(scope="session")
def dist_pool():
    """Eight real gloo ranks shared by every multi-rank test of this pytest worker.

    Multi-rank test modules set ``pytestmark = pytest.mark.xdist_group("dist")`` so
    that under ``pytest -n 2 --dist loadgroup`` they all land on one worker and one
    pool, while single-process tests run on the other.
    """
    from tests.dist import DistPool

    pool = DistPool()
    yield pool
    pool.close()

