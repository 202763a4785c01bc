"""Host-side exchange of values the host already knows (batch sizes, dims).

A metric that must agree with the other ranks on a buffer size before a device
collective (``EmbeddingMetric``'s padded gather) exchanges its host-known Python
integers over a CPU (gloo) group. Reading that CPU tensor waits for the network,
never for the accelerator, so ``testing.forbid_device_waits`` lets reads inside
``host_reads()`` through.
"""
from __future__ import annotations

import warnings
from datetime import timedelta
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from parallel import comm_device
from parallel.groups import ProcessGroup, group_ranks, is_cpu_group
from twinkle_metrics.comm import waits
from twinkle_metrics.inputs.checks import host_reads, host_reads_active  # noqa: F401 - also this module's


def host_max(metric: str, values: Sequence[int], group: ProcessGroup, cpu_group: ProcessGroup = None, label: str = "",
             timeout: Optional[timedelta] = None) -> List[int]:
    """Element-wise MAX of small host integers over ``group``; one collective.

    Uses ``cpu_group`` (a gloo group over the same ranks) or ``group`` itself when it
    is a CPU group: no device involved. Otherwise it falls back to an all-reduce on
    the device and a read of its result (a device wait), warning once. The wait is
    bounded by ``timeout``, kept from the host, and names the ranks that never came
    (``comm.waits``; ``label`` names the group).
    """
    via = cpu_group if cpu_group is not None else (group if is_cpu_group(group) else None)
    if via is None:
        # once per metric: Python's warning filter shows a message once per place
        warnings.warn(f"{metric}: the group is not a CPU group and no gloo group over its ranks "
                      "could be made, so host-known sizes are exchanged on the device and read back "
                      "(one device wait per accumulate); make gloo available, or pass a gloo group "
                      "(EmbeddingMetric: size_group=, e.g. megatron's "
                      "get_data_parallel_group_gloo(with_context_parallel=True))", stacklevel=2)
        via = group
    device = comm_device(via)
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=via, async_op=True)
    waits.wait(work, via, f"{metric}.accumulate()", label or f"group {group_ranks(via)}",
               timeout or timedelta(minutes=30), on_host=device.type == "cpu")
    with host_reads():
        return [int(v) for v in t.tolist()]
