"""Run megatron-core training steps (0.16 to 0.19) on CPU (gloo): a shim active only when CUDA is absent.

Use it to test a Megatron training script, metrics included, on a machine without GPUs::

    from twinkle_metrics.integrations import megatron_cpu

    torch.distributed.init_process_group("gloo")           # (or nothing, for one process)
    megatron_cpu.enable()                                  # 1. before the seed call below
    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1234)                  # 2. now fills the CPU RNG tracker

Order matters: ``model_parallel_cuda_manual_seed`` creates Megatron's CUDA RNG tracker
and seeds it through ``torch.cuda`` (which fails without CUDA), unless ``enable()``
installed the CPU tracker first; ``enable()`` raises if a seeded tracker is already
there. Do not pass ``force_reset_rng=True`` afterwards (it would drop the CPU tracker).

megatron-core assumes CUDA in a few places a training step goes through:

* ``pipeline_parallel/schedules.py`` allocates ``total_num_tokens`` with ``device="cuda"``;
* ``pipeline_parallel/p2p_communication.py`` allocates receive buffers on
  ``torch.cuda.current_device()`` and may call ``torch.cuda.synchronize()``;
* ``tensor_parallel/mappings.py`` / ``layers.py`` allocate gather buffers on
  ``torch.cuda.current_device()`` (sequence-parallel paths; patched for safety);
* ``utils.py``'s ``GlobalMemoryBuffer`` (attention's matmul buffer) allocates on
  ``torch.cuda.current_device()``;
* ``transformer/utils.py`` builds the default causal mask (``attention_mask=None`` with
  a causal attention mask type, e.g. the local layer spec) and the sliding-window mask
  with ``device="cuda"``;
* attention forks the CUDA RNG tracker (``tensor_parallel/random.py``) even with dropout 0;
* MoE: ``transformer/moe/router.py`` moves the router weight to
  ``torch.cuda.current_device()``, and ``transformer/moe/moe_utils.py`` names Transformer
  Engine's GEMM without a guard (a NameError without Transformer Engine). MoE layers on
  CPU also need ``moe_token_dispatcher_type="allgather"`` (all-to-all uses CUDA streams);
* multi-token prediction: ``transformer/multi_token_prediction.py`` keeps its loss tracker
  on ``torch.cuda.current_device()``;
* ``HybridModel`` (0.19): ``models/hybrid/hybrid_block.py`` builds its final norm with
  Transformer Engine's ``TENorm`` whatever the layer spec; without Transformer Engine the
  shim gives it megatron-core's local norm (``WrappedTorchNorm``: LayerNorm or RMSNorm as
  ``config.normalization`` says, the same arithmetic).

``enable()`` replaces the name ``torch`` *inside those modules only* with a thin proxy
that sends CUDA device arguments to the CPU and makes ``torch.cuda.synchronize`` a no-op,
and installs an RNG tracker whose ``fork()`` uses the CPU generator. Nothing outside
those modules changes, and on a machine with CUDA ``enable()`` does nothing, so the
same entry point runs unchanged on GPUs.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
from typing import Dict, Iterator, Mapping

import torch

_PATCHED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.multi_token_prediction",
)
_enabled = False
log = logging.getLogger(__name__)


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuCuda:
    """``torch.cuda`` as seen by the patched modules: the current device is the CPU."""

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def synchronize(*args, **kwargs):
        return None

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch:
    """``torch`` as seen by the patched modules: factory functions get CPU devices."""

    cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


def _factory(name):
    real = getattr(torch, name)

    def call(*args, device=None, **kwargs):
        return real(*args, device=_cpu_device(device), **kwargs)

    call.__name__ = name
    return call


for _name in ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "empty_like"):
    setattr(_CpuTorch, _name, staticmethod(_factory(_name)))


class CpuRngTracker:
    """Stands in for ``CudaRNGStatesTracker``: named CPU generator states, forked like CUDA ones.

    Dropout inside ``fork()`` then draws from a per-name CPU generator, which keeps
    Megatron's semantics (TP ranks share the model-parallel stream) without CUDA.
    """

    def __init__(self) -> None:
        self.states_: Dict[str, torch.Tensor] = {}
        self._current_state_name = "default-rng"

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_ = {}

    def get_states(self) -> Dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        gen = torch.Generator().manual_seed(int(seed))
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        saved = torch.get_rng_state()
        if name in self.states_:
            torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            if name in self.states_:
                self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def enable(force: bool = False) -> bool:
    """Patch megatron-core for CPU when CUDA is absent. Returns True when the shim is active.

    Idempotent. ``force=True`` patches even when CUDA is available (tests only).
    """
    global _enabled
    if _enabled:
        return True
    if torch.cuda.is_available() and not force:
        return False
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if (mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED and not isinstance(tracker, CpuRngTracker)
            and tracker.is_initialized()):
        # Its seeded streams would be lost silently: dropout would no longer follow the seed.
        raise RuntimeError("megatron_cpu.enable(): Megatron's RNG tracker is already seeded (by "
                           "model_parallel_cuda_manual_seed); call enable() before "
                           "model_parallel_cuda_manual_seed")
    proxy = _CpuTorch()
    for name in _PATCHED_MODULES:
        module = importlib.import_module(name)
        module.torch = proxy  # type: ignore[attr-defined]  # the shim: a megatron-core module's torch
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]  # a name megatron-core reads, absent on CPU
    _local_hybrid_norm()
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _enabled = True
    log.info("megatron-core CPU shim enabled (no CUDA): %s", ", ".join(_PATCHED_MODULES))
    return True


def _local_hybrid_norm() -> None:
    """HybridStack's final norm without Transformer Engine (megatron-core 0.19+ only)."""
    try:
        hybrid_block = importlib.import_module("megatron.core.models.hybrid.hybrid_block")
    except ImportError:  # no HybridModel in this megatron-core
        return
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not HAVE_TE:
        hybrid_block.TENorm = WrappedTorchNorm  # type: ignore[attr-defined]  # megatron-core's name, without TE


def is_enabled() -> bool:
    return _enabled
