"""docs/megatron.md's guarded loop in megatron-core's schedule on CPU (TP2 x PP2, 4 processes,
``tests/integrations/megatron_guard_case.py``): a NaN in the last stage's loss at step 3 is the
same ``skip`` on every rank, naming the lowest rank with its host and device; no rank's
parameters change at that step, and every other step updates them."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(__file__, "../../.."))


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.xdist_group("dist")
def test_the_guarded_megatron_loop_skips_the_bad_step_on_every_rank(tmp_path):
    case = os.path.join(REPO, "tests", "integrations", "megatron_guard_case.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", case,
           str(tmp_path), "--tp", "2", "--pp", "2", "--nan", "3:2,3"]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in ranks:
        assert r["verdicts"] == ranks[0]["verdicts"] and r["results"] == ranks[0]["results"], r["rank"]
        assert r["stepped"] == [True, True, False, True] and r["finite"], r["rank"]
    skipped = [v for v in ranks[0]["verdicts"] if not v.startswith("Verdict(action='ok'")]
    host = ranks[2]["host"]
    assert len(skipped) == 1 and "action='skip', step=3," in skipped[0]
    assert (f"bad=BadRank(rank=2, step=3, host='{host}', device='cpu', local_rank=2, fields=('loss',))"
            in skipped[0]) and "bad_ranks=2" in skipped[0]
    first, second = ranks[0]["results"]  # log_interval 2: steps 1-2, 3-4
    assert second["guard/skipped"] == 1 and (second["guard/first_bad_rank"], second["guard/first_bad_step"]) == (2, 3)
    assert first["guard/skipped"] == 0 and "guard/first_bad_rank" not in first
    assert any(line.startswith("step 3: skip: non-finite values on 2 ranks") for line in ranks[0]["printed"])
