"""Every ``python`` block of the README and of ``docs/*.md`` runs in CI, as written.

A block is announced by a marker line right above its fence, invisible on GitHub::

    <!-- readme-test: NAME -->
    ```python

``NAME`` says how the block runs: a key of ``RUNNERS`` runs it here (in this process, or in
real processes for the Megatron-on-CPU and DeepSpeed blocks); a key of ``ELSEWHERE`` names
the test that reads the block from the README and runs it in its own setting (the Megatron
recipe in megatron-core's schedule on 1 and 4 gloo ranks). A block without a marker, or
with an unknown name, fails ``test_every_block_has_a_runner``.

``docs/contract.md``, ``docs/testing.md`` and ``docs/single-controller.md`` are left out: their
examples run in their own tests (``tests/docs/test_contract_doc.py``,
``tests/docs/test_testing_doc_dist.py``, ``tests/core/test_single_controller_dist.py``).
"""
import glob
import json
import math
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from tests import plain_loop
from twinkle_metrics.testing.rendezvous import Rendezvous

ROOT = os.path.abspath(os.path.join(__file__, "../../.."))
MARKER = re.compile(r"^<!-- readme-test: ([a-z0-9-]+) -->$")
NOT_HERE = {"docs/contract.md", "docs/testing.md", "docs/single-controller.md"}


def documents():
    """The files whose blocks this module checks, relative to the repository root."""
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md"] + [d for d in docs if d not in NOT_HERE]


def blocks(path):
    """``[(runner name or None, section heading, code)]`` of every ``python`` block of ``path``."""
    out, section, marker, code, prev = [], None, None, None, ""
    for line in open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines():
        if code is not None:
            if line.startswith("```"):
                out.append((marker, section, "\n".join(code)))
                code = None
            else:
                code.append(line)
            continue
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.strip() == "```python":
            found = MARKER.match(prev.strip())
            marker, code = (found.group(1) if found else None), []
        prev = line
    return out


def all_blocks():
    return [(path, i, *b) for path in documents() for i, b in enumerate(blocks(path))]


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra)


def _run(cmd, timeout=240, **env):
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


# ------------------------------------------------------------------------------ runners
def run_exec(code, where):
    exec(compile(code, where, "exec"), {})


def run_masked_mean(code, where):
    ns = {}
    exec(compile(code, where, "exec"), ns)
    m = ns["MaskedMean"]()
    m.accumulate([{"labels": torch.tensor([[1, -100]])}, {"labels": torch.tensor([[2, 3]])}],
                 [{"values": torch.tensor([[9.0, 50.0]])}, {"values": torch.tensor([[1.0, 2.0]])}])
    assert m.calculate() == {"mean": 4.0, "max": 9.0, "tokens": 3}


def run_layout(code, where):
    """The harness block, on the README's own MaskedMean (the block above it)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        masked = next(c for c in re.findall(r"```python\n(.*?)```", f.read(), re.S) if "class MaskedMean" in c)
    module = types.ModuleType("readme_layout")  # a module the ranks can pickle MaskedMean and feed from
    sys.modules[module.__name__] = module
    try:
        exec(compile(masked, "README.md", "exec"), module.__dict__)
        exec(compile(code, where, "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]


def run_torch_loop(code, where):
    """One process: the loop with lr 0, checked against a recomputation of each interval."""
    printed, loader, reference = plain_loop.run(code, where)
    assert [p[0] for p in printed] == [10, 20]
    for (_, got), batches in zip(printed, (loader[:10], loader[10:])):
        total, count, correct = reference(batches)
        assert math.isclose(got["loss"], total / count, rel_tol=1e-6) and got["num_tokens"] == count
        assert (got["correct_tokens"], got["total_tokens"]) == (correct, count)


_DEEPSPEED_CASE = """
import json, os, sys
import torch
from twinkle_metrics.core.compat import skip_deepspeed_shm_op

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")  # MASTER_ADDR/PORT: the test's store
skip_deepspeed_shm_op()
torch.manual_seed(0)
V = 11
layers = [torch.nn.Embedding(V, 8), torch.nn.Linear(8, V)]
g = torch.Generator().manual_seed(1)
seen = []

def data():
    while True:
        labels = torch.randint(0, V, (2, 6), generator=g)
        labels[0, int(torch.randint(1, 6, (1,), generator=g)):] = -100  # uneven token counts
        seen.append(labels)
        yield labels.clamp(min=0), labels

printed = []
ns = dict(layers=layers, num_stages=1, data_iter=data(), train_steps=4, log_interval=2,
          ds_config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                     "optimizer": {"type": "SGD", "params": {"lr": 0.0}}},
          print=lambda *a: printed.append(a))
exec(compile(open(sys.argv[1]).read(), "README.md (DeepSpeed)", "exec"), ns)
model = torch.nn.Sequential(*layers)
want = []
with torch.no_grad():
    for interval in (seen[:6], seen[6:12]):
        total = count = 0
        for labels in interval:
            logits = model(labels.clamp(min=0))
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                             ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
        want.append([total / count, count])
json.dump({"printed": [[s, r["loss"], r["num_tokens"]] for s, r in printed], "want": want},
          open(sys.argv[2], "w"))
torch.distributed.destroy_process_group()  # as torch asks: without it the exit may abort
"""


def run_deepspeed(code, where, tmp_path):
    """One process on gloo: a real PipelineEngine (lr 0), the logged loss against the
    token-weighted loss recomputed from the microbatches the engine drew."""
    block, case, out = tmp_path / "block.py", tmp_path / "case.py", tmp_path / "out.json"
    block.write_text(code)
    case.write_text(_DEEPSPEED_CASE)
    with Rendezvous() as rdzv:
        _run([sys.executable, str(case), str(block), str(out)], **rdzv.env())
    got = json.loads(out.read_text())
    assert [p[0] for p in got["printed"]] == [2, 4]
    for (_, loss, tokens), (want_loss, want_tokens) in zip(got["printed"], got["want"]):
        assert math.isclose(loss, want_loss, rel_tol=1e-6) and tokens == want_tokens


_DEEPSPEED_GUARD_CASE = """
import json, math, os, sys
import torch
from twinkle_metrics.core.compat import skip_deepspeed_shm_op

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")  # MASTER_ADDR/PORT: the test's store
skip_deepspeed_shm_op()
torch.manual_seed(0)
V, BAD = 11, 2  # the third step's microbatches make NaN activations


class Poison(torch.nn.Module):
    on = False

    def forward(self, x):
        return x * math.nan if Poison.on else x


layers = [torch.nn.Embedding(V, 8), Poison(), torch.nn.Linear(8, V)]
params = [p for layer in layers for p in layer.parameters()]
g = torch.Generator().manual_seed(1)
snapshots = []


def data():
    i = 0
    while True:
        if i % 3 == 0:  # the first microbatch of a step: the parameters its update starts from
            snapshots.append([p.detach().clone() for p in params])
        Poison.on = i // 3 == BAD
        labels = torch.randint(0, V, (2, 6), generator=g)
        i += 1
        yield labels, labels


printed = []
ns = dict(layers=layers, num_stages=1, data_iter=data(), train_steps=4,
          ds_config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
          print=lambda *a: printed.append(" ".join(map(str, a))))
exec(compile(open(sys.argv[1]).read(), "docs/deepspeed.md (Skipping a bad step)", "exec"), ns)
snapshots.append([p.detach().clone() for p in params])
stepped = [any(not torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(snapshots, snapshots[1:])]
v = ns["verdicts"]
json.dump({"actions": [x.action for x in v], "steps": [x.step for x in v], "bad": repr(v[BAD].bad),
           "stepped": stepped, "finite": all(bool(torch.isfinite(p).all()) for p in params),
           "printed": printed, "results": ns["guard"].calculate()}, open(sys.argv[2], "w"))
torch.distributed.destroy_process_group()
"""


def run_deepspeed_guard(code, where, tmp_path):
    """docs/deepspeed.md's guarded engine loop in one process on gloo: a NaN in the third step's
    activations is a skip naming rank 0; that update changes nothing, the others do."""
    import socket

    block, case, out = tmp_path / "block.py", tmp_path / "case.py", tmp_path / "out.json"
    block.write_text(code)
    case.write_text(_DEEPSPEED_GUARD_CASE)
    with Rendezvous() as rdzv:
        _run([sys.executable, str(case), str(block), str(out)], **rdzv.env())
    got = json.loads(out.read_text())
    assert got["actions"] == ["ok", "ok", "skip", "ok"] and got["steps"] == [1, 2, 3, 4]
    assert got["bad"] == (f"BadRank(rank=0, step=3, host='{socket.gethostname()}', device='cpu', local_rank=0, "
                          "fields=('loss',))")
    assert got["stepped"] == [True, True, False, True] and got["finite"]
    assert len(got["printed"]) == 1 and got["printed"][0].startswith("step 3: skip: non-finite values on 1 rank")
    assert (got["results"]["guard/skipped"], got["results"]["guard/first_bad_step"]) == (1, 3)


_MEGATRON_CPU_CASE = """
import json, sys
exec(compile(open(sys.argv[1]).read(), "README.md (Megatron without CUDA)", "exec"), {})
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from parallel import DeviceMesh
from twinkle_metrics.integrations import megatron_cpu

mesh = DeviceMesh.from_megatron()
with get_cuda_rng_tracker().fork():  # what attention does: the seeded CPU stream
    pass
json.dump({"enabled": megatron_cpu.is_enabled(), "tp": ps.get_tensor_model_parallel_world_size(),
           "mesh": [mesh.tp_size, mesh.dp_size], "seeded": get_cuda_rng_tracker().is_initialized()},
          open(f"{sys.argv[2]}/rank{dist.get_rank()}.json", "w"))
# Nothing above waits for the other rank, and gloo counts a connection as made on the side
# that opens it once its hello is written: without this barrier a rank could destroy its
# groups and exit while its peer, slower on a busy host, still accepts those connections
# inside initialize_model_parallel ("Connection closed by peer" in connectFullMesh).
dist.barrier()
ps.destroy_model_parallel()
dist.destroy_process_group()
"""


def run_megatron_cpu(code, where, tmp_path):
    """The set-up block on 2 CPU processes (torchrun, gloo): shim on, TP2 x DP1, tracker seeded.

    ``--standalone``: torchrun's agent hosts the store on a port of its own (bound at port 0
    and held) and its workers join it as clients, so no other process can take it."""
    block, case = tmp_path / "block.py", tmp_path / "case.py"
    block.write_text(code)
    case.write_text(_MEGATRON_CPU_CASE)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          str(case), str(block), str(tmp_path)])
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got == {"enabled": True, "tp": 2, "mesh": [2, 1], "seeded": True}, got


RUNNERS = {
    "exec": run_exec,
    "masked-mean": run_masked_mean,
    "layout": run_layout,
    "torch-loop": run_torch_loop,
    "deepspeed": run_deepspeed,
    "deepspeed-guard": run_deepspeed_guard,
    "megatron-cpu": run_megatron_cpu,
}
IN_PROCESSES = {"deepspeed", "deepspeed-guard", "megatron-cpu"}  # real processes: the e2e tier, beside the rank pool

#: blocks another test reads from the README and runs: (test file, text it must contain)
ELSEWHERE = {
    "megatron-loop": ("tests/megatron_loop_case.py", "## Megatron"),
    "norms": ("tests/metrics/system/test_norms.py", "ModelNormMetric(mesh"),
    "mtp-loop": ("tests/integrations/megatron_mtp_case.py", "## Multi-token prediction"),
    "guard-loop": ("tests/integrations/megatron_guard_case.py", "## Skipping a bad step"),
}
#: blocks of ``ELSEWHERE`` that live outside the README (the test reads them from this file)
ELSEWHERE_IN = {"mtp-loop": "docs/megatron.md", "guard-loop": "docs/megatron.md"}


def _masked_mean(path):
    """The source of ``class MaskedMean`` in ``path``: the class statement to its last line."""
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    found = re.search(r"^class MaskedMean\(Metric\):\n(?:(?:    .*|)\n)*", text, re.M)
    assert found, f"{path}: no MaskedMean"
    return found.group(0).rstrip()


def test_one_example_metric_across_readme_and_docs():
    readme = _masked_mean("README.md")
    for path in ("docs/contract.md", "docs/testing.md", "launch/example_custom_metric.py"):
        assert _masked_mean(path) == readme, f"{path}'s MaskedMean is not the README's"


def test_every_block_has_a_runner():
    found = all_blocks()
    assert len(found) >= 8
    bad = [(path, i, name) for path, i, name, _, _ in found if name not in RUNNERS and name not in ELSEWHERE]
    assert not bad, f"python blocks without a known '<!-- readme-test: NAME -->' marker: {bad}"
    for name, (test_file, needle) in ELSEWHERE.items():
        text = open(os.path.join(ROOT, test_file), encoding="utf-8").read()
        home = ELSEWHERE_IN.get(name, "README.md")
        assert ("README" in text or home in text) and needle in text, (name, test_file)
        assert all(path == home for path, _, n, _, _ in found if n == name), name
    # megatron_loop_case.py runs the first two blocks of the README's "## Megatron" section.
    megatron = [(n, code) for path, _, n, section, code in found if path == "README.md" and section == "Megatron"]
    assert [n for n, _ in megatron[:2]] == ["megatron-loop", "megatron-loop"]
    assert "ModelNormMetric(mesh" in next(code for n, code in megatron if n == "norms")


def _params():
    out = []
    for path, i, name, section, code in all_blocks():
        marks = [pytest.mark.slow, pytest.mark.xdist_group("dist")] if name in IN_PROCESSES else []
        marks += [pytest.mark.megatron] if name == "megatron-cpu" else []
        out.append(pytest.param(path, i, name, section, code, id=f"{path}:{i}:{name}", marks=marks))
    return out


@pytest.mark.parametrize("path, index, name, section, code", _params())
def test_block_runs(path, index, name, section, code, tmp_path):
    if name in ELSEWHERE:
        pytest.skip(f"run by {ELSEWHERE[name][0]}")
    where = f"{path} ({section}, block {index})"
    runner = RUNNERS[name]
    if name in IN_PROCESSES:
        runner(code, where, tmp_path)
    else:
        runner(code, where)


def test_markers_are_invisible_and_exact():
    """A marker is an HTML comment on its own line; a near miss would leave a block unrun."""
    for path in documents():
        for line in open(os.path.join(ROOT, path), encoding="utf-8"):
            if "readme-test" in line:
                assert MARKER.match(line.strip()), (path, line)
