import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


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
