"""TrainMetric's memory peaks on 8 real gloo ranks, TP2 x PP2 x DP2: the largest over every
rank of the job and the rank holding it, on every rank's result and through export() /
calculate_from. torch's allocator counters stand in through torch's own functions."""
import json

import pytest
import torch
import torch.distributed as dist

from parallel import DeviceMesh
from twinkle_metrics import TrainMetric
from twinkle_metrics.testing import forbid_device_waits

pytestmark = pytest.mark.xdist_group("dist")

GIB = 2 ** 30


def _peaks(rank, pp_rank):
    """(allocated, reserved) bytes: the first stage holds the most activations under 1F1B
    (10 + rank GiB, the last stage 1 GiB); the reserved peak lies on another rank."""
    allocated = (10 + rank) * GIB if pp_rank == 0 else GIB
    return allocated, (20 + (3 * rank) % 8) * GIB + rank


def case_peaks_over_every_rank(source):
    real = torch.accelerator.is_available, torch.accelerator.memory_stats
    if source == "megatron":
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                     create_gloo_process_groups=False, distributed_timeout_minutes=1)
    try:
        mesh = DeviceMesh.from_megatron() if source == "megatron" else \
            DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
        allocated, reserved = _peaks(dist.get_rank(), mesh.pp_rank)
        torch.accelerator.is_available = lambda: True
        torch.accelerator.memory_stats = lambda *a: {"allocated_bytes.all.peak": allocated,
                                                     "reserved_bytes.all.peak": reserved}
        m = TrainMetric(mesh)
        with forbid_device_waits():
            m.accumulate(None, None, step=2)
        text = json.dumps(m.export(), allow_nan=False)
        m.accumulate(None, None, step=4)
        return m.calculate(), text
    finally:
        torch.accelerator.is_available, torch.accelerator.memory_stats = real
        if source == "megatron":
            ps.destroy_model_parallel()


@pytest.mark.parametrize("source", ["sizes", pytest.param("megatron", marks=pytest.mark.megatron)])
def test_peak_memory_is_the_largest_of_every_rank_and_names_it(dist_pool, source):
    out = dist_pool.run(case_peaks_over_every_rank, source)
    peaks = [_peaks(r, 0 if r < 4 else 1) for r in range(dist_pool.world)]  # Megatron's order: PP outermost
    top = max(range(8), key=lambda r: peaks[r][0])
    top_reserved = max(range(8), key=lambda r: peaks[r][1])
    assert (top, top_reserved) == (3, 5)  # neither at an end of the world, nor on the last stage
    want = {"peak memory GiB": 13.0, "train/peak_memory_rank": 3,
            "train/peak_memory_reserved_gib": peaks[5][1] / GIB, "train/peak_memory_reserved_rank": 5}
    for got, _ in out:
        assert {k: got[k] for k in want} == want  # on every rank (the last stage's alone: 1.0)
    driver = TrainMetric().calculate_from([json.loads(text) for _, text in out])
    assert {k: driver[k] for k in want} == want
