"""The library is a guest in the training process: it replaces no torch function, adds
no import hook and no exit handler, builds no group outside torch's registry, and reads
torch's private fields in one function each (checked here against the installed torch)."""
import ast
import atexit
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from parallel import groups as G

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = [p for d in ("twinkle_metrics", "parallel") for p in (ROOT / d).rglob("*.py")]
#: a backend torch's registry builds its groups with (``Backend.register_backend``'s creator):
#: its gloo groups are made inside torch's own ``new_group``, for a test's default backend
BACKENDS = {ROOT / "twinkle_metrics" / "testing" / "standin.py"}
TORCH_NAMES = {"torch", "dist", "c10d", "distributed_c10d"}


def _root(node):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_library_source_assigns_to_torch_or_builds_groups_outside_its_registry():
    found = []
    for path in LIBRARY:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and _root(t) in TORCH_NAMES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} assigns {ast.unparse(t)}")
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name == "setattr" and node.args and _root(node.args[0]) in TORCH_NAMES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
                if (name.endswith("ProcessGroupGloo") and path not in BACKENDS) or name.endswith("meta_path.append") \
                        or name.endswith("meta_path.insert") or name == "atexit.register":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {name}")
            if isinstance(node, ast.Attribute) and node.attr in ("_get_default_store", "_world"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_import_adds_no_import_hook_and_no_exit_handler():
    # the frameworks first: what they register at import is theirs
    code = ("import atexit, sys, torch, torch.distributed, megatron.core.parallel_state, deepspeed; "
            "hooks = list(sys.meta_path); n = atexit._ncallbacks(); "
            "import twinkle_metrics, parallel, twinkle_metrics.integrations.megatron; "
            "assert sys.meta_path == hooks, sys.meta_path[len(hooks):]; "
            "assert atexit._ncallbacks() == n, (n, atexit._ncallbacks()); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=timedelta(seconds=7))
    yield
    dist.destroy_process_group()


def test_torch_private_reads_still_find_what_they_read(one_rank):
    """Each read of a private torch field lives in one function of parallel.groups; when a
    torch release moves the field, these fail instead of the library quietly guessing."""
    assert G.default_timeout() == timedelta(seconds=7)
    group = dist.new_group([0], timeout=timedelta(seconds=9))
    assert G.group_timeout(group) == timedelta(seconds=9)
    store = G.group_store(dist.group.WORLD)
    store.set("twinkle_metrics/probe", "1")
    store.append("twinkle_metrics/probe", "2")
    assert store.get("twinkle_metrics/probe") == b"12"
    assert G.group_name(dist.group.WORLD) != ""


def test_a_calculate_leaves_torch_as_it_was(one_rank):
    """After a calculate() and an asynchronous one on real groups: torch's functions are
    its own and no exit handler was added."""
    import torch

    from parallel import DeviceMesh
    from twinkle_metrics import LossMetric

    handlers = atexit._ncallbacks()
    m = LossMetric(DeviceMesh({"dp": dist.group.WORLD}, timeout=5), loss_reduction="sum")
    m.accumulate(None, [{"lm loss": torch.tensor([3.0, 4.0], dtype=torch.float64)}])
    assert m.calculate(async_op=True).wait() == {"loss": 0.75, "num_tokens": 4}
    m.accumulate(None, [{"lm loss": torch.tensor([3.0, 4.0], dtype=torch.float64)}])
    assert m.calculate() == {"loss": 0.75, "num_tokens": 4}
    assert dist.destroy_process_group is c10d.destroy_process_group
    assert dist.destroy_process_group.__module__ == "torch.distributed.distributed_c10d"
    assert not hasattr(dist.destroy_process_group, "__wrapped__")
    assert atexit._ncallbacks() == handlers
