"""Every ``python`` block of the README runs: here, or (blocks that need a model or a
training loop) in the test named for its section. A new block in a section with no
runner fails ``test_every_block_has_a_runner``."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Sections whose blocks need a megatron-core model and run in their own tests.
ELSEWHERE = {
    "Megatron": ("tests/megatron_loop_case.py", "tests/test_norms.py"),
}


README = os.path.join(ROOT, "README.md")


def readme_blocks():
    """``[(section heading, code)]`` of every ``python`` block, in order."""
    section, out, code = None, [], None
    for line in open(README, encoding="utf-8").read().splitlines():
        if code is not None:
            if line.startswith("```"):
                out.append((section, "\n".join(code)))
                code = None
            else:
                code.append(line)
        elif line.startswith("## "):
            section = line[3:].strip()
        elif line.strip() == "```python":
            code = []
    return out


def _deepspeed_engine():
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=1)  # what the mesh reads


def _run_writing_a_metric(code):
    import torch

    ns = {}
    exec(compile(code, "README.md (Writing a metric)", "exec"), ns)
    m = ns["MaskedMean"]()
    m.accumulate([{"labels": torch.tensor([[1, -100]])}, {"labels": torch.tensor([[2, 3]])}],
                 [{"values": torch.tensor([[9.0, 50.0]])}, {"values": torch.tensor([[1.0, 2.0]])}])
    assert m.calculate() == {"mean": 4.0, "max": 9.0}


RUNNERS = {
    "Writing a metric": _run_writing_a_metric,
    "MoE routing health": lambda code: exec(compile(code, "README.md (MoE)", "exec"), {}),
    "Asynchronous calculate": lambda code: exec(compile(code, "README.md (async)", "exec"), {}),
    "Sliced metrics": lambda code: exec(compile(code, "README.md (slices)", "exec"), {}),
    "Quantiles and stragglers": lambda code: exec(compile(code, "README.md (quantiles)", "exec"), {}),
    "Plugging the metrics into a DeepSpeed script": lambda code: exec(
        compile("from parallel import DeviceMesh\nfrom twinkle_metrics import *\n" + code, "README.md (DeepSpeed)",
                "exec"), {"engine": _deepspeed_engine()}),
}


def test_every_block_has_a_runner():
    blocks = readme_blocks()
    assert len(blocks) >= 5
    orphans = [section for section, _ in blocks if section not in RUNNERS and section not in ELSEWHERE]
    assert not orphans, f"README python blocks in sections no test runs: {orphans}"
    for section, files in ELSEWHERE.items():
        for f in files:  # the tests that run those blocks read them from the README
            text = open(os.path.join(ROOT, f), encoding="utf-8").read()
            assert "README" in text and re.search(re.escape(section), text), (section, f)


@pytest.mark.parametrize("index", range(len(readme_blocks())))
def test_readme_block_runs(index, capsys):
    section, code = readme_blocks()[index]
    if section in ELSEWHERE:
        pytest.skip(f"run by {', '.join(ELSEWHERE[section])}")
    RUNNERS[section](code)
