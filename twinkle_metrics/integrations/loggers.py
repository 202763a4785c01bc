"""Where metric results go: console, JSON Lines, TensorBoard, Weights & Biases, a monitor.

``Logger`` is a null object; each sink subclasses it and ``LoggerGroup`` fans a call
out to several. ``build_loggers`` returns a group without sinks on every rank except
the logging rank, so a training loop calls ``logger.log(results, step)`` on every rank
without an ``if``: there it writes nothing, but still waits for the handles of
asynchronous ``calculate()`` calls at ``close()`` and raises their errors, as on the
logging rank (every rank then ends its syncs, and sees a failed one, alike).

Every sink writes numbers only (TensorBoard, W&B and monitors take nothing else): a result
that is not a number (GRPO's ``_high_kl_records``, a list of dicts) goes to
``records.jsonl`` beside ``metrics.jsonl`` when the ``jsonl`` sink is on, and nowhere else.

The logging rank (one rule, ``DeviceMesh.is_logging_rank``): global rank 0.
``calculate()`` leaves the same numbers on every rank, pipeline stages included,
so rank 0 (first pipeline stage, where DeepSpeed's monitor writers live) has the
loss computed on the last stage too; no extra send is needed.

Example::

    logger = build_loggers(["console", "jsonl", "tensorboard"], run_dir, enabled=mesh.is_logging_rank)
    logger.log(metrics.calculate(), step)
    logger.close()
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, TextIO, TypeVar, Union

from twinkle_metrics.comm.pending import CalculateHandle

SINKS = ("console", "jsonl", "tensorboard", "wandb")
_L = TypeVar("_L", bound="Logger")


class Logger:
    """The null logger: accepts everything, writes nothing."""

    def log(self, results: Mapping[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self: _L) -> _L:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number a logger takes (not a bool, a string or a list)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numeric(results: Mapping[str, Any]) -> Dict[str, float]:
    """The entries of ``results`` that are real numbers (``is_number``)."""
    return {key: value for key, value in results.items() if is_number(value)}


def _plain_json(value: Any) -> Any:
    """``value`` for strict JSON: non-finite floats as ``null``, in lists and dicts too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain_json(v) for k, v in value.items()}
    return value


def format_line(results: Mapping[str, Any], step: int, prefix: str = "") -> str:
    """One compact console line: ``step 10 | loss 2.3041 | accuracy 0.1250 | ...``."""
    parts = [f"{prefix}step {step}"]
    for key, value in results.items():
        if isinstance(value, float):
            text = f"{value:.4g}" if (value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5)) else f"{value:.4f}"
        else:
            text = str(value)
        parts.append(f"{key} {text}")
    return " | ".join(parts)


class ConsoleLogger(Logger):
    """A compact line per interval (through the progress bar when one is active)."""

    def __init__(self, stream: Optional[TextIO] = None, prefix: str = "", progress: Optional["Progress"] = None,
                 keys: Optional[Sequence[str]] = None) -> None:
        self.stream = stream or sys.stdout
        self.prefix = prefix
        self.progress = progress
        self.keys = list(keys) if keys else None  # None: every key

    def log(self, results: Mapping[str, Any], step: int) -> None:
        results = numeric(results)
        if self.keys is not None:
            results = {k: results[k] for k in self.keys if k in results}
        line = format_line(results, step, self.prefix)
        if self.progress is not None:
            self.progress.write(line)
        else:
            print(line, file=self.stream, flush=True)


class JsonlLogger(Logger):
    """One JSON object per interval: ``{"step": 10, "time": ..., "loss": 2.3, ...}``, the
    numbers of the results; the others (records: GRPO's ``_high_kl_records``) go, in a row
    of the same form, to ``records_path`` (created at the first such row), or nowhere.

    Non-finite numbers are written as ``null`` (strict JSON has no NaN).
    """

    def __init__(self, path: str, records_path: Optional[str] = None) -> None:
        self.path, self.records_path = path, records_path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self._records: Optional[TextIO] = None

    def log(self, results: Mapping[str, Any], step: int) -> None:
        head = {"step": step, "time": time.time()}
        self._file.write(json.dumps(_plain_json({**head, **numeric(results)})) + "\n")
        self._file.flush()
        others = {k: v for k, v in results.items() if not is_number(v)}
        if others and self.records_path is not None:
            if self._records is None:
                self._records = open(self.records_path, "a", encoding="utf-8")
            self._records.write(json.dumps(_plain_json({**head, **others})) + "\n")
            self._records.flush()

    def close(self) -> None:
        for f in (self._file, self._records):
            if f is not None and not f.closed:
                f.close()


class TensorBoardLogger(Logger):
    """Scalars to TensorBoard event files (needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch raises ImportError when tensorboard is missing
            raise ImportError("TensorBoardLogger needs the 'tensorboard' package: "
                              "pip install 'twinkle-metrics[loggers]'") from exc
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)

    def log(self, results: Mapping[str, Any], step: int) -> None:
        for key, value in numeric(results).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger(Logger):
    """Weights & Biases (offline unless ``mode`` says otherwise). Needs ``wandb``."""

    def __init__(self, run_dir: str, project: str = "twinkle-metrics", mode: str = "offline",
                 config: Optional[Mapping[str, Any]] = None, name: Optional[str] = None) -> None:
        import wandb  # ImportError is handled by build_loggers

        settings: Dict[str, Any] = dict(project=project, dir=run_dir, mode=mode, name=name,  # mode: checked by wandb
                                        config=dict(config or {}), reinit=True)
        self._run = wandb.init(**settings)

    def log(self, results: Mapping[str, Any], step: int) -> None:
        self._run.log(numeric(results), step=step)

    def close(self) -> None:
        self._run.finish()


class MonitorLogger(Logger):
    """DeepSpeed's monitor (``engine.monitor``): its tensorboard/wandb/csv blocks get our values.

    Duck-typed: anything with ``write_events([(name, value, step)])`` and ``enabled``.
    """

    def __init__(self, monitor: Any, prefix: str = "Train/Metrics/") -> None:
        self.monitor = monitor
        self.prefix = prefix

    def log(self, results: Mapping[str, Any], step: int) -> None:
        if not getattr(self.monitor, "enabled", True):
            return
        events = [(self.prefix + key, value, step) for key, value in numeric(results).items()]
        if events:
            self.monitor.write_events(events)


class LoggerGroup(Logger):
    """Fans every call out to several loggers.

    ``log`` also takes the handle of an asynchronous ``calculate()`` and never
    blocks on it: entries are written in call order as soon as they are ready
    (checked at every ``log``/``flush``); ``close()`` waits for the pending ones.
    A handle whose sync failed raises its error once, from the ``log``/``flush`` that
    reaches it, and leaves the queue: the entries behind it are still written (a loop
    that catches a ``MetricSyncError`` keeps logging). ``close()`` writes every entry
    it can, closes the loggers, then raises the first such error.
    """

    def __init__(self, loggers: Iterable[Logger] = ()) -> None:
        self.loggers: List[Logger] = list(loggers)
        self._queue: List[tuple] = []  # (results or handle, step), in call order

    def add(self, logger: Logger) -> "LoggerGroup":
        self.loggers.append(logger)
        return self

    def log(self, results: Union[Mapping[str, Any], CalculateHandle], step: int) -> None:
        self._queue.append((results, step))
        self.flush(wait=False)

    def flush(self, wait: bool = False) -> None:
        """Write the queued entries that are ready (``wait=True``: all of them). A failed
        handle leaves the queue before its error is raised."""
        while self._queue:
            item, step = self._queue[0]
            if hasattr(item, "wait"):
                if not (wait or item.done()):
                    return
                self._queue.pop(0)
                item = item.wait()  # raises a failed sync's error: the entry is gone already
            else:
                self._queue.pop(0)
            for logger in self.loggers:
                logger.log(item, step)

    def close(self) -> None:
        first: Optional[BaseException] = None
        try:
            while self._queue:
                try:
                    self.flush(wait=True)
                except Exception as e:  # noqa: BLE001 - write the rest, then raise the first
                    first = first or e
        finally:
            for logger in self.loggers:
                logger.close()
        if first is not None:
            raise first


def build_loggers(sinks: Sequence[str], run_dir: str, *, enabled: bool = True,
                  progress: Optional["Progress"] = None, config: Optional[Mapping[str, Any]] = None,
                  wandb_project: str = "twinkle-metrics", wandb_mode: str = "offline",
                  console_keys: Optional[Sequence[str]] = None) -> Logger:
    """Loggers for ``sinks`` writing under ``run_dir``; a group without sinks when not
    ``enabled`` (it writes nothing, and handles asynchronous results as any group does).

    Files: ``run_dir/metrics.jsonl`` (and ``run_dir/records.jsonl`` for results that are not
    numbers), ``run_dir/tb/`` (events), ``run_dir/wandb/``.
    ``"wandb"`` is skipped with a note when the package is not installed; a missing
    ``tensorboard`` package is an error (it is in the ``loggers`` extra).
    ``console_keys`` keeps the console line short; files always get every key.
    """
    unknown = [s for s in sinks if s not in SINKS]
    if unknown:
        raise ValueError(f"build_loggers: unknown sinks {unknown}; valid: {list(SINKS)}")
    group = LoggerGroup()
    if not enabled:
        return group
    os.makedirs(run_dir, exist_ok=True)
    for sink in sinks:
        if sink == "console":
            group.add(ConsoleLogger(progress=progress, keys=console_keys))
        elif sink == "jsonl":
            group.add(JsonlLogger(os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "records.jsonl")))
        elif sink == "tensorboard":
            group.add(TensorBoardLogger(os.path.join(run_dir, "tb")))
        elif sink == "wandb":
            try:
                group.add(WandbLogger(run_dir, project=wandb_project, mode=wandb_mode, config=config))
            except ImportError:
                print("[twinkle_metrics] wandb is not installed; skipping the wandb sink",
                      file=sys.stderr, flush=True)
    return group


class Progress:
    """A progress bar over training steps: tqdm when installed, else a plain line every few steps.

    Disabled (silent) when ``enabled`` is False, so every rank can hold one.
    """

    def __init__(self, total: int, *, enabled: bool = True, desc: str = "train",
                 use_tqdm: Optional[bool] = None, stream: Optional[TextIO] = None, every: Optional[int] = None) -> None:
        self.total, self.enabled, self.desc = total, enabled, desc
        self.stream = stream or sys.stderr
        self.n = 0
        self.every = every or max(1, total // 10)
        self._start = time.time()
        self._bar = None
        if enabled and use_tqdm is not False:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, file=self.stream, dynamic_ncols=True,
                                 leave=True)

    def update(self, n: int = 1, **postfix) -> None:
        if not self.enabled:
            return
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v)
                                       for k, v in postfix.items()}, refresh=False)
        elif self.n % self.every == 0 or self.n == self.total:
            rate = self.n / max(time.time() - self._start, 1e-9)
            extra = "".join(f" {k}={v:.4g}" if isinstance(v, float) else f" {k}={v}"
                            for k, v in postfix.items())
            print(f"{self.desc}: {self.n}/{self.total} steps ({rate:.2f} it/s){extra}",
                  file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """Print a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
