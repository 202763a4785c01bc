"""Fast single-process tests of the config factory, the loggers and the plot command."""
from __future__ import annotations

import builtins
import glob
import io
import json
import os

import pytest
import torch

import twinkle_metrics
from parallel import DeviceMesh
from twinkle_metrics import Metric, MetricCollection, State
from twinkle_metrics.integrations import factory, loggers
from twinkle_metrics.integrations.factory import (
    apply_overrides,
    build_metrics,
    feed_of,
    load_config,
    register_metric,
    split_feeds,
)

REPO = os.path.abspath(os.path.join(__file__, "../../.."))


class CountTokens(Metric):
    """Counts labelled tokens; ``scale`` multiplies the result (a kwarg to validate)."""

    count = State("sum", torch.int64)

    def __init__(self, device_mesh=None, process_group=None, *, scale: int = 1):
        super().__init__(device_mesh, process_group)
        self.scale = scale

    def update(self, inputs, outputs, **kwargs):
        return {"count": (torch.as_tensor(inputs["labels"]) != -100).sum()} if inputs else {}

    def compute(self, s):
        return {"tokens": s["count"] * self.scale}


class LastLR(Metric):
    lr = State("max", default=float("-inf"))

    def update(self, inputs, outputs, lr=None, **kwargs):
        return {} if lr is None else {"lr": lr}

    def compute(self, s):
        return {"lr": s["lr"]} if s["lr"] != float("-inf") else {}


# for the whole process (a registration stays), under names no shipped metric has
register_metric("CountTokens", CountTokens)
register_metric("LastLR", LastLR)


# ------------------------------------------------------------------ factory
def test_build_hands_every_metric_the_mesh_and_keeps_keys():
    mesh = DeviceMesh.single()
    coll = build_metrics([{"type": "CountTokens", "kwargs": {"scale": 2}}, "LastLR"], mesh)
    assert isinstance(coll, MetricCollection) and len(coll) == 2
    assert all(m.device_mesh is mesh for m in coll)
    coll[0].accumulate({"labels": torch.tensor([[1, -100, 3]])}, None)
    coll[1].accumulate(None, None, lr=0.5)
    assert coll.calculate() == {"tokens": 4, "lr": 0.5}


def test_names_prefix_keys_and_must_be_all_or_none():
    coll = build_metrics([{"type": "CountTokens", "name": "a"}, {"type": "CountTokens", "name": "b"}],
                         DeviceMesh.single())
    coll["a"].accumulate({"labels": torch.tensor([1, 2])}, None)
    assert coll.calculate() == {"a/tokens": 2, "b/tokens": 0}
    with pytest.raises(ValueError, match="every metric a 'name' or none"):
        build_metrics([{"type": "CountTokens", "name": "a"}, {"type": "LastLR"}])
    with pytest.raises(ValueError, match="unique"):
        build_metrics([{"type": "CountTokens", "name": "a"}, {"type": "LastLR", "name": "a"}])


def test_unknown_type_lists_valid_names():
    with pytest.raises(ValueError) as err:
        build_metrics([{"type": "Acuracy"}])
    msg = str(err.value)
    assert "'Acuracy'" in msg and "CountTokens" in msg and "LastLR" in msg
    if hasattr(twinkle_metrics, "GRPOMetric"):
        assert "GRPOMetric" in msg  # classes exported by twinkle_metrics are found by name


def test_unknown_kwargs_list_valid_ones():
    with pytest.raises(ValueError, match=r"CountTokens got unknown kwargs \['scael'\]; valid: \['scale'\]"):
        build_metrics([{"type": "CountTokens", "kwargs": {"scael": 3}}])
    with pytest.raises(ValueError, match="must not set"):
        build_metrics([{"type": "CountTokens", "kwargs": {"device_mesh": None}}])
    with pytest.raises(ValueError, match="unknown fields"):
        build_metrics([{"type": "CountTokens", "kwarg": {}}])
    with pytest.raises(ValueError, match="no 'type'"):
        build_metrics([{"kwargs": {}}])
    with pytest.raises(ValueError, match="non-empty list"):
        build_metrics([])


def test_real_metric_kwargs_are_validated():
    if not hasattr(twinkle_metrics, "GRPOMetric"):
        pytest.skip("GRPOMetric not merged yet")
    m = factory.build_metric({"type": "GRPOMetric", "kwargs": {"epsilon": 0.1}})
    assert m.__class__.__name__ == "GRPOMetric"
    with pytest.raises(ValueError, match="valid: .*epsilon"):
        factory.build_metric({"type": "GRPOMetric", "kwargs": {"epsilom": 0.1}})


def test_dotted_path_and_bad_paths():
    m = factory.build_metric({"type": "tests.integrations.test_factory_loggers:CountTokens"})
    assert isinstance(m, CountTokens)
    with pytest.raises(ValueError, match="cannot import"):
        factory.build_metric({"type": "tests.nope:X"})
    with pytest.raises(TypeError, match="not a twinkle_metrics.Metric"):
        factory.build_metric({"type": "os.path:join"})
    with pytest.raises(TypeError, match="not a Metric subclass"):
        register_metric("x", dict)


def test_feeds_split_step_and_microbatch_metrics():
    class LossMetric(LastLR):  # the name decides the default feed
        pass

    register_metric("StepLoss", LossMetric)
    entries = [{"type": "StepLoss"}, {"type": "CountTokens"}, {"type": "LastLR", "feed": "step"}]
    coll = build_metrics(entries)
    step, micro = split_feeds(entries, coll)
    assert [type(m) for m in step] == [LossMetric, LastLR]
    assert [type(m) for m in micro] == [CountTokens]
    assert feed_of("CountTokens") == "microbatch"
    with pytest.raises(ValueError, match="valid: \\['step', 'microbatch'\\]"):
        build_metrics([{"type": "LastLR", "feed": "epoch"}])


def test_config_overrides(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train": {"steps": 40}, "logging": {"sinks": ["console"]}}))
    cfg = load_config(str(path), ["train.steps=8", "logging.sinks=[\"jsonl\"]", "model.name=gpt",
                                  "a.b.c=1.5"])
    assert cfg == {"train": {"steps": 8}, "logging": {"sinks": ["jsonl"]}, "model": {"name": "gpt"},
                   "a": {"b": {"c": 1.5}}}
    with pytest.raises(ValueError, match="section.key=value"):
        apply_overrides({}, ["steps"])
    with pytest.raises(ValueError, match="not a section"):
        apply_overrides({"train": 3}, ["train.steps=1"])
    path.write_text("{bad")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(str(path))


def test_strict_overrides_refuse_typos_and_wrong_types():
    """What the launch scripts use: a mistyped --set cannot quietly run another experiment."""
    cfg = {"train": {"steps": 40, "lr": 0.005}, "logging": {"sinks": ["console"]}}
    got = apply_overrides(cfg, ["train.steps=8", "train.lr=1", "logging.sinks=jsonl", "logging.progress=false"],
                          strict=True, optional=["logging.progress"])
    assert got == {"train": {"steps": 8, "lr": 1}, "logging": {"sinks": ["jsonl"], "progress": False}}
    for item, match in (("train.step=3", "no 'train.step'; did you mean 'train.steps'"),
                        ("train.steps=2.0", r"train.steps is int \(40\) in the config, got float"),
                        ("train.steps=true", "train.steps is int"),
                        ("train.lr=fast", "train.lr is float"),
                        ("a..b=1", "must look like 'section.key=value'")):
        with pytest.raises(ValueError, match=match):
            apply_overrides(cfg, [item], strict=True)
    assert apply_overrides(cfg, ["train.step=3"])["train"]["step"] == 3  # not strict: anything goes


@pytest.mark.parametrize("name", ["megatron_demo.json", "deepspeed_demo.json"])
def test_shipped_configs_build(name, monkeypatch):
    cfg = load_config(factory.config_path(name))
    missing = [e["type"] for e in cfg["metrics"] if e["type"] not in factory.available_metrics()]
    if missing:
        pytest.skip(f"metrics {missing} not merged yet")
    coll = build_metrics(cfg["metrics"], DeviceMesh.single())
    assert len(coll) == len(cfg["metrics"])
    step, micro = split_feeds(cfg["metrics"], coll)
    assert len(step) + len(micro) == len(coll)
    if "deepspeed_config" in cfg:
        assert load_config(factory.config_path(cfg["deepspeed_config"]))


# ------------------------------------------------------------------ loggers
def test_null_logger_on_other_ranks_writes_nothing(tmp_path):
    logger = loggers.build_loggers(["console", "jsonl", "tensorboard"], str(tmp_path / "run"),
                                   enabled=False)
    assert isinstance(logger, loggers.LoggerGroup) and logger.loggers == []
    logger.log({"loss": 1.0}, 1)
    logger.close()
    assert not (tmp_path / "run").exists()


def test_jsonl_and_fan_out(tmp_path, capsys):
    run = tmp_path / "run"
    logger = loggers.build_loggers(["console", "jsonl"], str(run))
    assert isinstance(logger, loggers.LoggerGroup) and len(logger.loggers) == 2
    logger.log({"loss": 2.5, "accuracy": 0.25, "total_tokens": 12, "nan": float("nan")}, 4)
    logger.log({"loss": 2.0}, 8)
    logger.close()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8]
    assert rows[0]["loss"] == 2.5 and rows[0]["total_tokens"] == 12 and rows[0]["nan"] is None
    out = capsys.readouterr().out
    assert "step 4 | loss 2.5000 | accuracy 0.2500 | total_tokens 12" in out


def test_sinks_write_numbers_and_records_go_to_their_own_file(tmp_path, capsys):
    """GRPO's ``_high_kl_records`` (a list of dicts) reaches no sink that takes numbers:
    ``records.jsonl`` holds it, beside ``metrics.jsonl``, made only when a record comes."""
    from tests.rlref import make_rl_batch
    from twinkle_metrics import GRPOMetric

    b = make_rl_batch(1)
    m = GRPOMetric(top_k_kl=2)
    m.accumulate({"labels": b["labels"]}, {"logps": b["logps"]}, old_logps=b["old"], advantages=b["adv"])
    results = m.calculate()
    assert len(results["_high_kl_records"]) == 2
    run = tmp_path / "run"
    logger = loggers.build_loggers(["console", "jsonl"], str(run))
    logger.log({"loss": 2.0}, 1)
    assert not (run / "records.jsonl").exists()
    logger.log({**results, "inf": float("inf")}, 2)
    logger.close()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(v, (int, float)) or v is None for r in rows for v in r.values())
    assert rows[1]["train/approx_kl"] == results["train/approx_kl"] and rows[1]["inf"] is None
    assert "_high_kl_records" not in rows[1]
    (records,) = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert records["step"] == 2 and records["_high_kl_records"] == results["_high_kl_records"]
    out = capsys.readouterr().out
    assert "train/approx_kl" in out and "_high_kl_records" not in out and "gsi" not in out


def test_unknown_sink_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="valid: \\['console', 'jsonl', 'tensorboard', 'wandb'\\]"):
        loggers.build_loggers(["csv"], str(tmp_path))


def test_wandb_offline_run_is_written(tmp_path):
    pytest.importorskip("wandb")
    logger = loggers.build_loggers(["wandb"], str(tmp_path))
    logger.log({"loss": 1.5, "accuracy": 0.5, "note": "not a number"}, 1)
    logger.log({"loss": 1.25, "accuracy": 0.625}, 2)
    logger.close()
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))
    assert len(runs) == 1 and os.path.getsize(runs[0]) > 0


def test_wandb_missing_is_skipped(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    logger = loggers.build_loggers(["wandb", "jsonl"], str(tmp_path))
    assert [type(sink) for sink in logger.loggers] == [loggers.JsonlLogger]
    assert "wandb is not installed" in capsys.readouterr().err
    logger.close()


def test_tensorboard_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    logger = loggers.TensorBoardLogger(str(tmp_path / "tb"))
    logger.log({"loss": 1.5, "name": "skip me", "flag": True}, 3)
    logger.close()
    files = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["loss"]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(3, 1.5)]


def test_monitor_logger_writes_events():
    class FakeMonitor:
        enabled = True

        def __init__(self):
            self.events = []

        def write_events(self, events):
            self.events.extend(events)

    mon = FakeMonitor()
    loggers.MonitorLogger(mon).log({"loss": 1.25, "note": "x"}, 7)
    assert mon.events == [("Train/Metrics/loss", 1.25, 7)]
    mon.enabled = False
    loggers.MonitorLogger(mon).log({"loss": 1.0}, 8)
    assert len(mon.events) == 1


def test_progress_plain_fallback():
    stream = io.StringIO()
    bar = loggers.Progress(4, use_tqdm=False, stream=stream, every=2)
    for _ in range(4):
        bar.update(1, loss=1.5)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("train: 4/4 steps") and "loss=1.5" in lines[-1]
    silent = io.StringIO()
    off = loggers.Progress(4, enabled=False, stream=silent)
    off.update(4)
    assert silent.getvalue() == ""


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from twinkle_metrics.integrations import plot

    path = tmp_path / "metrics.jsonl"
    with loggers.JsonlLogger(str(path)) as logger:
        for step in (2, 4, 6):
            logger.log({"loss": 3.0 / step, "accuracy": step / 10, "label": "x"}, step)
    data = plot.curves(plot.read_jsonl(str(path)))
    assert list(data) == ["loss", "accuracy"] and data["loss"][0] == [2, 4, 6]
    png = plot.plot(str(path))
    assert png == str(tmp_path / "metrics.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="not in"):
        plot.plot(str(path), keys=["nope"])
    plot.main([str(path), "-o", str(tmp_path / "x.png"), "--keys", "loss"])
    assert os.path.exists(tmp_path / "x.png")


def test_plot_command_runs_from_its_module():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "twinkle_metrics.integrations.plot", "--help"], cwd=REPO,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0 and "jsonl" in out.stdout, out.stderr


def test_config_types_are_the_exported_metrics():
    """What a config builds by name (``metrics.SHIPPED``, read without importing the
    package's top module) is every metric class ``twinkle_metrics`` exports, and only those."""
    from twinkle_metrics.metrics import SHIPPED

    exported = {name: obj for name, obj in vars(twinkle_metrics).items()
                if isinstance(obj, type) and issubclass(obj, Metric) and obj is not Metric}
    assert SHIPPED == exported
    ours = {n: c for n, c in factory.available_metrics().items() if c.__module__ != __name__}  # not this file's
    assert ours == exported


def test_kwargs_forwarded_through_subclasses_are_listed():
    class Scaled(CountTokens):
        def __init__(self, device_mesh=None, process_group=None, *, offset=0, **kwargs):
            super().__init__(device_mesh, process_group, **kwargs)
            self.offset = offset

    assert factory.metric_kwargs(Scaled) == ["offset", "scale"]  # CountTokens forwards nothing
    assert factory.metric_kwargs(LastLR) == ["slice_by", "max_slices"]  # Metric.__init__'s
    register_metric("Scaled", Scaled)
    assert factory.build_metric({"type": "Scaled", "kwargs": {"scale": 3, "offset": 1}}).scale == 3
    with pytest.raises(ValueError, match=r"valid: \['offset', 'scale'\]"):
        factory.build_metric({"type": "Scaled", "kwargs": {"bogus": 1}})


def test_console_keys_shorten_the_line(tmp_path, capsys):
    logger = loggers.build_loggers(["console", "jsonl"], str(tmp_path), console_keys=["loss", "absent"])
    logger.log({"loss": 1.0, "accuracy": 0.5}, 2)
    logger.close()
    assert capsys.readouterr().out.strip() == "step 2 | loss 1.0000"
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["accuracy"] == 0.5
