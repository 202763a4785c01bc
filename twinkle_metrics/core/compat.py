"""Private APIs of torch and megatron-core that metrics rely on, each with a fallback.

Kept in one place so that a torch or megatron-core release that renames them breaks
one small module, not the metrics.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch


def norms_float64(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """L2 norm of each tensor, accumulated and returned in float64 (0-d tensors, on
    each tensor's device; no host wait).

    ``torch._foreach_norm`` (one multi-tensor kernel per device and dtype on CUDA);
    per-tensor ``linalg.vector_norm`` where it is missing or refuses the input.
    """
    if not tensors:
        return []
    fn = getattr(torch, "_foreach_norm", None)
    if fn is not None:
        try:
            return list(fn(list(tensors), 2, dtype=torch.float64))
        except (TypeError, RuntimeError, NotImplementedError):
            pass  # an older signature (no dtype) or an input the fused path rejects
    return [torch.linalg.vector_norm(t, 2, dtype=torch.float64) for t in tensors]


# ----------------------------------------------------------------- megatron-core DDP
def _ddp_buffers(chunk: torch.nn.Module) -> Optional[list]:
    """megatron-core DDP's grad buffers of ``chunk`` (dense and expert), or None when
    ``chunk`` is not a megatron-core ``DistributedDataParallel``. Read from the instance
    dict: on any other module ``chunk.buffers`` is ``nn.Module.buffers``, a method."""
    found = None
    for attr in ("buffers", "expert_parallel_buffers"):
        value = chunk.__dict__.get(attr)
        if isinstance(value, (list, tuple)):
            found = (found or []) + list(value)
    return found


def uses_distributed_optimizer(chunk: torch.nn.Module) -> bool:
    """Whether ``chunk`` is wrapped by megatron-core DDP configured for the distributed
    optimizer (``ddp_config.use_distributed_optimizer``)."""
    cfg = getattr(chunk, "ddp_config", None)
    return bool(getattr(cfg, "use_distributed_optimizer", False))


def distributed_optimizer_instances(chunk: torch.nn.Module) -> int:
    cfg = getattr(chunk, "ddp_config", None)
    return int(getattr(cfg, "num_distributed_optimizer_instances", 1) or 1)


def owned_ranges(chunk: torch.nn.Module) -> Optional[Dict[torch.nn.Parameter, Tuple[int, int]]]:
    """``{param: (start, end)}``: the flat range of each parameter this rank's
    distributed-optimizer shard holds (``(0, 0)``: none of it), or None when ``chunk``
    has no megatron-core DDP grad buffers.

    megatron-core's rule (``DistributedOptimizer._build_model_gbuf_range``): each
    bucket of a grad buffer is cut into ``data_parallel_world_size`` equal contiguous
    ranges, rank ``r`` of the buffer's data-parallel group owns range ``r``, and a
    parameter's owned part is the overlap of its buffer range with that range. Only
    that part of ``param.main_grad`` holds the reduced gradient after the
    reduce-scatter.
    """
    buffers = _ddp_buffers(chunk)
    if buffers is None:
        return None
    out: Dict[torch.nn.Parameter, Tuple[int, int]] = {}
    for buf in buffers:
        world = int(buf.data_parallel_world_size)
        rank = int(buf.data_parallel_group.rank())
        for param, (start, end, bucket_id) in buf.param_index_map.items():
            bucket = buf.buckets[bucket_id]
            shard = bucket.grad_data.numel() // world
            lo = bucket.offset + rank * shard
            a, b = max(start, lo), min(end, lo + shard)
            out[param] = (a - start, b - start) if a < b else (0, 0)
    return out


def skip_deepspeed_shm_op() -> None:
    """Keep ``deepspeed.init_distributed`` on CPU from JIT-compiling its shared-memory
    allreduce op (tens of seconds on two cores, again whenever the environment or the
    ``ninja`` in use changes). Only ``inference_all_reduce`` uses that op; gloo does every
    collective of training and of the metrics. Call before ``init_distributed``. Reaches
    into DeepSpeed's op registry (``deepspeed.ops.__compatible_ops__``), hence here."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # the probed dict is kept
