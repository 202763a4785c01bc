"""Kernel tests run in a child pytest under ``TRITON_INTERPRET=1`` (the interpreter must be
chosen before triton is imported); the parent's one test runs the child."""
import os
import subprocess
import sys

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: a test that runs only in the interpreted child
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")


def run_child(path: str) -> None:
    """Run test file ``path`` under the interpreter and fail with its output if it fails."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.abspath(os.path.join(__file__, "../../.."))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-W", "error::RuntimeWarning", os.path.abspath(path)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]
