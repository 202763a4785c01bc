"""The example of docs/testing.md runs as a user runs it: its block, saved as a test file of
their own, passes under pytest in a fresh process (``check_metric`` on real gloo ranks), and
the same file with a ``"max"`` count fails naming the key."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xdist_group("dist")

ROOT = os.path.abspath(os.path.join(__file__, "../../.."))


def _block() -> str:
    text = open(os.path.join(ROOT, "docs", "testing.md"), encoding="utf-8").read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/testing.md: expected its one python example"
    return blocks[0]


def _pytest(tmp_path, code: str) -> subprocess.CompletedProcess:
    path = tmp_path / "test_masked_mean.py"
    path.write_text(code)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_the_check_metric_example_passes_and_catches_a_wrong_reduction(tmp_path):
    code = _block()
    ok = _pytest(tmp_path, code)
    assert ok.returncode == 0 and "1 passed" in ok.stdout, ok.stdout[-3000:] + ok.stderr[-3000:]
    wrong = code.replace('count = State("sum", torch.int64)', 'count = State("max", torch.int64)')
    assert wrong != code
    bad = _pytest(tmp_path, wrong)
    assert bad.returncode != 0 and "layout 'dp2', rank 0, interval 0" in bad.stdout and "tokens: " in bad.stdout, (
        bad.stdout[-3000:])
