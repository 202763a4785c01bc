"""Every recipe of ``docs/single-controller.md``, run as written on 8 real gloo ranks.

Each framework's worker block runs on every rank, where that framework calls it (the mesh
it trains on: TP2 x PP2 x DP2 under Megatron, pure DP under DeepSpeed); what the ranks
return then goes to the driver as the framework collects it, each step written below from
the framework's source; the driver block runs in this process (no process group), and its
numbers must be those of one process holding the whole batch. The Ray block, a complete
program, runs in ``tests/integrations/test_ray.py``, on real Ray actors.
"""
import types

import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from tests import verlref
from tests.controllerref import fed, whole
from tests.docs.test_readme import blocks
from twinkle_metrics.testing import assert_results_close

pytestmark = pytest.mark.xdist_group("dist")
DOC = "docs/single-controller.md"


def doc_blocks():
    return {name: code for name, _, code in blocks(DOC)}


def _run(code, where, **names):
    ns = dict(names)
    exec(compile(code, f"{DOC} ({where})", "exec"), ns)
    return ns


def test_every_block_of_the_doc_is_run_here_or_by_the_ray_test():
    names = [name for name, _, _ in blocks(DOC) if name != "exec"]
    recipes = [f"{f}-{side}" for f in ("verl", "nemo", "openrlhf", "twinkle") for side in ("worker", "driver")]
    assert sorted(names) == sorted(["ray"] + recipes)


def test_the_format_and_rules_blocks_run_as_written():
    ran = [_run(code, f"block {i}") for i, (name, _, code) in enumerate(blocks(DOC)) if name == "exec"]
    assert len(ran) == 3


# ---------------------------------------------------------------------------------- verl
def case_verl(code):
    """verl's train_batch on every rank; on the source ranks, _postprocess_output's gather,
    train_mini_batch's flattening and append_to_dict (``tests/verlref.py``: verl's code)."""
    gather, append, VerlMetric = verlref.worker_helpers()
    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
    source = mesh.tp_rank == 0 and mesh.is_last_stage  # is_mp_src_rank_with_outputs (CP 1)
    worker = types.SimpleNamespace(engine=types.SimpleNamespace(is_mp_src_rank_with_outputs=lambda: source))
    output = {"metrics": {"pg_loss": [float(mesh.dp_rank)]}}  # what engine.train_batch returned
    tm_metrics = fed(mesh)
    _run(code, "verl worker", self=worker, output=output, tm_metrics=tm_metrics)
    assert tm_metrics["lm"].calculate() == {}  # every rank's interval ended, not only the sources'
    if not source:
        assert "twinkle" not in output["metrics"]
        return None
    step = {}
    append(step, verlref.flatten_mini_batch(gather(output["metrics"], group=mesh.dp_group), VerlMetric))
    return step


def test_verl_recipe(dist_pool):
    code = doc_blocks()
    outputs = [o for o in dist_pool.run(case_verl, code["verl-worker"]) if o is not None]
    received = {f"actor/{k}": v for k, v in outputs[0].items()}  # collect_nd_compute's first; rename_dict
    actor_output = types.SimpleNamespace(meta_info={"metrics": received})  # the DataProto it comes in
    got = _run(code["verl-driver"], "verl driver", actor_output=actor_output)["actor_output_metrics"]
    assert got["actor/pg_loss"] == 0.5  # verl's own reduction of its keys
    assert_results_close({k[len("actor/twinkle/"):]: v for k, v in got.items() if k != "actor/pg_loss"}, whole())


# -------------------------------------------------------------------------------- NeMo-RL
def case_nemo(code):
    """The Megatron policy worker's train on every rank: its aggregate_training_statistics'
    mb_metrics, with the block's exports beside them."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 create_gloo_process_groups=False)
    try:
        mesh = DeviceMesh.from_megatron()
        mb_metrics = {"loss": [0.25, 0.75]}
        _run(code, "NeMo-RL worker", tm_metrics=fed(mesh), mb_metrics=mb_metrics, torch=torch)
        first_of_tied = mesh.tp_rank == 0 and mesh.pp_rank == 0 and mesh.cp_rank == 0
        return {"global_loss": 1.0, "all_mb_metrics": mb_metrics} if first_of_tied else None
    finally:
        ps.destroy_model_parallel()


@pytest.mark.megatron
def test_nemo_rl_recipe(dist_pool):
    code = doc_blocks()
    results = [r for r in dist_pool.run(case_nemo, code["nemo-worker"]) if r is not None]
    assert len(results) == 2  # one per data-parallel rank, neither on the last stage
    all_mb_metrics = {}  # Policy.train: extend each key's list over the kept workers
    for r in results:
        for k, v in r["all_mb_metrics"].items():
            all_mb_metrics.setdefault(k, []).extend(v)
    train_results = {"loss": results[0]["global_loss"], "all_mb_metrics": all_mb_metrics}
    metrics = {"loss": train_results["loss"]}
    _run(code["nemo-driver"], "NeMo-RL driver", train_results=train_results, metrics=metrics)
    assert train_results["all_mb_metrics"] == {"loss": [0.25, 0.75] * 2}  # left for grpo.py's own loop
    assert_results_close({k: v for k, v in metrics.items() if k != "loss"}, whole())


# ------------------------------------------------------------------------------- OpenRLHF
def case_openrlhf(code):
    """A DeepSpeed actor's fit (ZeRO: every rank its own data shard)."""
    mesh = DeviceMesh.current()
    status = {"policy_loss": float(dist.get_rank())}
    _run(code, "OpenRLHF worker", tm_metrics=fed(mesh), status=status)
    return status


def test_openrlhf_recipe(dist_pool):
    code = doc_blocks()
    statuses = dist_pool.run(case_openrlhf, code["openrlhf-worker"])
    ray = types.SimpleNamespace(get=lambda refs: refs)  # ray.get(refs): the actors' statuses, in order
    status = {}
    _run(code["openrlhf-driver"], "OpenRLHF driver", ray=ray, refs=statuses, status=status)
    assert status.pop("policy_loss") == 0.0
    assert_results_close(status, whole())


# --------------------------------------------------------------------- Twinkle's Ray mode
def remote_function(dispatch="slice", collect="none", **_):
    """Twinkle's decorator on the worker side: the method runs as written on each worker."""
    assert (dispatch, collect) == ("all", "none")
    return lambda fn: fn


def case_twinkle(code):
    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
    ns = _run(code, "Twinkle worker", MegatronModel=object, remote_function=remote_function)
    model = ns["ExportingModel"]()
    model.tm_metrics = fed(mesh)
    return model.export_metrics()


def test_twinkle_ray_mode_recipe(dist_pool):
    code = doc_blocks()
    exports = dist_pool.run(case_twinkle, code["twinkle-worker"])
    # twinkle.infra._collect_func('none'): the list of every worker's result...
    model = types.SimpleNamespace(export_metrics=lambda: exports)
    assert_results_close(_run(code["twinkle-driver"], "Twinkle driver", model=model)["results"], whole())
    # ...and the result alone when the group has one worker
    alone = fed(DeviceMesh.single()).export()
    model = types.SimpleNamespace(export_metrics=lambda: alone)
    assert_results_close(_run(code["twinkle-driver"], "Twinkle driver", model=model)["results"], whole())
