"""Shared plumbing of the entry points: ranks from the environment, run directory, debug dumps."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as `python launch/x.py` from anywhere
    sys.path.insert(0, REPO)


@dataclass
class Env:
    rank: int
    local_rank: int
    world_size: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def read_env(local_rank_arg: Optional[int] = None) -> Env:
    """RANK / LOCAL_RANK / WORLD_SIZE (torchrun, deepspeed); one process when absent.

    DeepSpeed's launcher also passes ``--local_rank``; it wins over LOCAL_RANK.
    """
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank_arg is not None and local_rank_arg >= 0:
        local = local_rank_arg
    return Env(rank, local, world)


def init_torch_distributed(env: Env, backend: Optional[str] = None) -> None:
    """``init_process_group`` on the launcher's rendezvous; one process without a launcher
    needs none: its group lives on an in-memory store (no port to pick, none to collide)."""
    if dist.is_initialized():
        return
    import torch

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    if env.distributed:
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size)
    else:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def make_run_dir(base: str, run_dir: Optional[str] = None) -> str:
    """``run_dir`` if given, else ``base/<timestamp>``; the same path on every rank.

    The timestamp comes from rank 0 (broadcast) so ranks never disagree on a second boundary.
    """
    if run_dir:
        path = run_dir
    else:
        stamp = [time.strftime("%Y%m%d-%H%M%S")]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(stamp, src=0)
        path = os.path.join(base, stamp[0])
    os.makedirs(path, exist_ok=True)
    return path


class DebugDump:
    """Per-rank JSON Lines (``run_dir/debug/rank{R}.jsonl``) for end-to-end tests.

    Holds what the schedule reported and what ``calculate()`` returned on this rank,
    so a test can recompute the token-weighted loss and check every rank agrees.
    """

    def __init__(self, run_dir: str, rank: int, enabled: bool):
        self._file = None
        if enabled:
            path = os.path.join(run_dir, "debug")
            os.makedirs(path, exist_ok=True)
            self._file = open(os.path.join(path, f"rank{rank}.jsonl"), "w", encoding="utf-8")

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, **fields}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def print_rank0(*args: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def logging_section(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return config.get("logging") or {}


def make_microbatches(step: int, dp_rank: int, cfg: Mapping[str, Any]):
    """The demo task: ``(tokens, labels)`` per microbatch of one step on one DP rank.

    Each sequence counts up from a random start by a random stride (mod vocab); a random
    tail is padding (label -100), so microbatches differ in token count. Seeded by step
    and DP rank only, so TP ranks and pipeline stages of one DP rank see the same data.
    """
    t, m = cfg["train"], cfg["model"]
    b, s, v = t["micro_batch_size"], m["seq_length"], m["vocab_size"]
    g = torch.Generator().manual_seed(t["seed"] * 1_000_003 + step * 1009 + dp_rank)
    out = []
    for _ in range(t["num_microbatches"]):
        start = torch.randint(0, v, (b, 1), generator=g)
        stride = torch.randint(1, t.get("max_stride", 4) + 1, (b, 1), generator=g)
        seq = (start + stride * torch.arange(s + 1)) % v
        tokens, labels = seq[:, :-1].clone(), seq[:, 1:].clone()
        length = torch.randint(s // 4, s + 1, (b, 1), generator=g)
        pad = torch.arange(s) >= length
        tokens[pad] = 0
        labels[pad] = -100
        out.append((tokens, labels))
    return out


def parse_args(argv, description: str, default_config: str, allow_unknown: bool = False):
    """The entry points' shared command line (DeepSpeed's ``--local_rank`` included).

    ``allow_unknown``: ignore flags we do not know (the deepspeed launcher may add its own).
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", default=default_config, help="JSON config (bare names: configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=8 (repeatable)")
    p.add_argument("--steps", type=int, default=None, help="shortcut for --set train.steps=N")
    p.add_argument("--run-dir", default=None, help="write here instead of runs/<timestamp>")
    p.add_argument("--debug-dump", action="store_true",
                   help="each rank writes run_dir/debug/rank{R}.jsonl (loss reports, results)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None)  # deepspeed launcher
    return p.parse_known_args(argv)[0] if allow_unknown else p.parse_args(argv)


def finish_run(tag: str, steps: int, start: float, run_dir: str, sinks, enabled: bool,
               title: Optional[str] = None) -> None:
    """The logging rank's last words: the PNG of the curves (``plot`` sink) and the run dir."""
    if not enabled:
        return
    jsonl = os.path.join(run_dir, "metrics.jsonl")
    if "plot" in sinks and os.path.exists(jsonl) and os.path.getsize(jsonl) > 0:  # a 0-step run logs nothing
        from twinkle_metrics.integrations.plot import plot

        print(f"[{tag}] plot: {plot(jsonl, title=title)}", flush=True)
    print(f"[{tag}] {steps} steps in {time.time() - start:.1f} s; run dir: {run_dir}", flush=True)


#: config keys the launch scripts read with a default (``--set`` may add them)
OPTIONAL_KEYS = ("logging.progress", "logging.interval", "logging.sinks", "logging.console_keys",
                 "logging.run_root", "train.clip_grad", "train.max_stride")


def load_run_config(path: str, overrides, optional=()) -> dict:
    """The run's config with ``--set`` overrides checked (``load_config(strict=True)``):
    a bad one ends the run with its message, before any process group exists."""
    from twinkle_metrics.integrations.factory import load_config

    try:
        cfg = load_config(path, overrides, strict=True, optional=optional)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    check_run_settings(cfg)
    return cfg


def check_run_settings(cfg) -> None:
    """Settings that would fail late (a division by the interval) or run nothing useful."""
    steps, interval = cfg["train"].get("steps"), cfg.get("logging", {}).get("interval", 1)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise SystemExit(f"train.steps must be an int >= 0, got {steps!r}")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise SystemExit(f"logging.interval must be an int >= 1, got {interval!r}")

