"""GPU check (one short script, for a CUDA machine; prints one JSON document).

    python benchmarks/gpu_check.py            # from the repository root, 1 GPU, ~1 minute

1. ``accumulate`` of every metric on CUDA tensors under
   ``torch.cuda.set_sync_debug_mode("error")``: any host-device synchronisation raises
   (the ground truth behind the CPU-side ``forbid_device_waits`` guard).
2. ``calculate()`` of all metrics as one MetricCollection on a 1-rank NCCL group,
   with the synchronisations it makes counted (expected: the one device-to-host
   copy of the results), plus one raw NCCL all_gather of the packed buffer.
3. Host time blocked per accumulate while the GPU is busy (a queued matmul chain),
   ours vs Twinkle when ``twinkle.metric`` is importable: each of Twinkle's
   ``.item()`` calls waits for the whole queue.
4. Peak extra GPU memory (torch.cuda.max_memory_allocated) of Accuracy and
   entropy-from-logits on [2, 512, 152064] logits, ours (torch path, and the Triton path
   where triton is installed) vs the naive full-vocab code.
5. ``calculate(async_op=True)`` of the same collection with 0, 25 and 100 ms of matmuls
   queued on the compute stream before the call: host ms of the call against the
   synchronous ``calculate()`` (which must wait for the queue to copy its results); with
   50 ms more queued after the call, whether the handle completed while that later work
   still ran (the sync on its side stream and private NCCL groups, overlapping compute);
   and whether the results equal the synchronous ones exactly.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import suite  # noqa: E402
from benchmarks.bench_accumulate import make_ours, make_twinkle, twinkle_kwargs, workloads  # noqa: E402
from benchmarks.bench_async import comparable  # noqa: E402


def to_dev(x, dev):
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, dict):
        return {k: to_dev(v, dev) for k, v in x.items()}
    if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
        return [v.to(dev) for v in x]
    return x  # lists of Python numbers stay host data, as a rollout delivers them


def sync_check(names, dev):
    out = {}
    b = to_dev(suite.make_batch(1), dev)
    big = {k: to_dev(v, dev) for k, v in workloads().items()}
    for name in names:
        m = suite.ours_classes([name])[name]()
        calls = [("standard batch", lambda name=name, m=m: suite._accumulate_ours(name, m, b))]
        for key in (name, name + ":ragged"):
            if key in big:
                w = big[key]
                label = "benchmark workload" + (" (ragged host lists)" if key.endswith("ragged") else "")
                calls.append((label, lambda w=w, m=m: m.accumulate(w["inputs"], w["outputs"], **w["kwargs"])))
        row = {}
        for label, call in calls:
            call()  # warm-up: lazy allocations outside the check
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                call()
                row[label] = "ok: no synchronisation"
            except Exception as e:  # noqa: BLE001 - reported
                row[label] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            finally:
                torch.cuda.set_sync_debug_mode(0)
        out[name] = row
    return out


def calculate_check(dev):
    from parallel import DeviceMesh
    ours = suite.OursSuite(suite.ALL, mesh=DeviceMesh.current())
    b = to_dev(suite.make_batch(2), dev)
    ours.accumulate(b)
    ours.calculate()  # the first calculate() agrees on the plan (a one-time handshake)
    ours.accumulate(b)
    torch.cuda.synchronize()
    res = {"backend": str(dist.get_backend()), "world_size": dist.get_world_size()}
    torch.cuda.set_sync_debug_mode("warn")
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        values = ours.calculate()
        res["seconds"] = time.perf_counter() - t0
    torch.cuda.set_sync_debug_mode(0)
    res["synchronisations"] = sum("synchroniz" in str(w.message) for w in caught)
    res["keys"] = len(values)
    res["plain_numbers"] = all(isinstance(v, (int, float, list)) for v in values.values())
    buf = torch.ones(256, dtype=torch.float64, device=dev)
    out = torch.empty(dist.get_world_size() * buf.numel(), dtype=buf.dtype, device=dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, buf)
    torch.cuda.synchronize()
    res["raw_nccl_all_gather"] = bool((out == 1).all())
    return res


def blocked_time(dev, busy_ms=50.0):
    """Host seconds spent inside accumulate while ~busy_ms of GPU work is queued ahead."""
    a, mm_ms = _matmul_queue(dev)
    per_mm = mm_ms / 1e3
    n_mm = max(1, int(busy_ms / 1e3 / per_mm))
    try:
        import twinkle.metric as tm  # noqa: F401
        have_twinkle = True
    except Exception:  # noqa: BLE001
        have_twinkle = False
    big = {k: to_dev(v, dev) for k, v in workloads().items()}
    out = {"queued_gpu_ms": 1e3 * per_mm * n_mm, "twinkle_available": have_twinkle}
    for name, w in big.items():
        impls = {"ours": (make_ours(name), w["kwargs"])}
        if have_twinkle:
            impls["twinkle"] = (make_twinkle(name), twinkle_kwargs(name, w["kwargs"]))
        row = {}
        for label, (m, kw) in impls.items():
            m.accumulate(w["inputs"], w["outputs"], **kw)
            samples = []
            for _ in range(5):
                torch.cuda.synchronize()
                _busy(a, n_mm)
                t0 = time.perf_counter()
                m.accumulate(w["inputs"], w["outputs"], **kw)
                samples.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            row[label + "_host_ms"] = 1e3 * sorted(samples)[2]
        out[name] = row
    return out


def _busy(a: torch.Tensor, n: int) -> None:
    for _ in range(n):
        a @ a


def _stream_busy(dev) -> bool:
    return dev.type == "cuda" and not torch.cuda.current_stream(dev).query()


def _synchronize(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _matmul_queue(dev):
    """(a, ms of device time per ``a @ a``): a matmul big enough that queueing N of them puts
    N times that much work on the stream while the host returns at once (a small one would
    measure the host's launch time, and the GPU would keep up with the queue)."""
    n = 4096 if dev.type == "cuda" else 64
    a = torch.randn(n, n, device=dev)
    _busy(a, 2)
    _synchronize(dev)
    t0 = time.perf_counter()
    _busy(a, 10)
    _synchronize(dev)
    return a, max((time.perf_counter() - t0) / 10 * 1e3, 1e-4)


def async_check(dev, busy_ms=(0.0, 25.0, 100.0), after_ms: float = 50.0, repeats: int = 3):
    """Host time of calculate(async_op=True) vs calculate() behind queued compute work,
    overlap of the background sync with compute queued after the call, and equality of
    the results.

    For each row, ``busy_ms`` of matmuls are queued before the call: the synchronous
    ``calculate()`` waits for them (it copies its results to the host), the asynchronous
    one returns at once. Then ``after_ms`` more are queued behind the asynchronous call, as
    the next step's work would be: its sync runs on a side stream after the work queued
    before the call, so it completes while that later work still runs (overlap), unless
    it waited for the compute stream's whole queue."""
    from parallel import DeviceMesh
    suites = {mode: suite.OursSuite(suite.ALL, mesh=DeviceMesh.current()) for mode in ("sync", "async")}
    b = to_dev(suite.make_batch(2), dev)
    for ours in suites.values():  # warm: plan handshake, private groups, kernels
        ours.accumulate(b)
        ours.calculate()
        ours.accumulate(b)
        ours.collection.calculate(async_op=True).wait()
    a, per_mm = _matmul_queue(dev)
    n_after = max(1, int(after_ms / per_mm))
    out = {"matmul_ms": round(per_mm, 3), "queued_after_ms": round(per_mm * n_after, 2), "rows": [],
           "results_equal": True}
    for ms in busy_ms:
        n_mm = int(ms / per_mm)
        row = {"queued_before_ms": round(per_mm * n_mm, 2), "sync_host_ms": [], "async_host_ms": [],
               "async_done_while_later_compute_runs": []}
        for _ in range(repeats):
            results = {}
            for mode, ours in suites.items():
                ours.accumulate(b)
                _synchronize(dev)
                _busy(a, n_mm)
                t0 = time.perf_counter()
                if mode == "sync":
                    results[mode] = ours.calculate()
                    row["sync_host_ms"].append(1e3 * (time.perf_counter() - t0))
                    continue
                handle = ours.collection.calculate(async_op=True)
                row["async_host_ms"].append(1e3 * (time.perf_counter() - t0))
                _busy(a, n_after)  # the next step's work, queued behind the call
                while not handle.done():
                    time.sleep(1e-4)
                row["async_done_while_later_compute_runs"].append(_stream_busy(dev))
                results[mode] = handle.wait()
                _synchronize(dev)
            # everything but TrainMetric's clock readings (two collections, two clocks)
            out["results_equal"] = out["results_equal"] and comparable(results["sync"]) == comparable(results["async"])
        for key in ("sync_host_ms", "async_host_ms"):
            row[key] = sorted(row[key])[len(row[key]) // 2]
        out["rows"].append(row)
    return out


def _on_path(enabled, fn, z):
    from twinkle_metrics.kernels import backend
    with backend("auto" if enabled else "torch"):  # "auto": CUDA tensors take the kernels
        return fn(z)


def memory_check(dev, shape=(2, 512, 152064)):
    from parallel import DeviceMesh

    res = {"shape": list(shape)}
    labels = torch.randint(0, shape[-1], shape[:2], device=dev)
    logps = -torch.rand(shape[:2], device=dev)
    cls = suite.ours_classes(["Accuracy", "GRPOMetric"])
    cases = {
        "accuracy_ours": lambda z: cls["Accuracy"](DeviceMesh.single(), vocab_parallel=True).accumulate(
            {"labels": labels[:, :z.shape[1]]}, {"logits": z}),
        "accuracy_naive": lambda z: z.argmax(-1),
        "entropy_ours": lambda z: cls["GRPOMetric"](DeviceMesh.single(), entropy_from_logits=True).accumulate(
            {"labels": labels[:, :z.shape[1]]}, {"logps": logps[:, :z.shape[1]], "logits": z}),
        "entropy_naive": lambda z: -(torch.softmax(z.float(), -1) * torch.log_softmax(z.float(), -1)).sum(-1),
    }
    from twinkle_metrics.kernels import dispatch as _triton
    if _triton.available():  # the same calls on the kernel path
        for name in ("accuracy_ours", "entropy_ours"):
            cases[name + "_triton"] = (lambda fn: lambda z: _on_path(True, fn, z))(cases[name])
    for name in ("accuracy_ours", "entropy_ours"):  # the torch path, whatever the default
        cases[name] = (lambda fn: lambda z: _on_path(False, fn, z))(cases[name])
    for dtype in (torch.bfloat16, torch.float32):
        z = torch.randn(shape, device=dev, dtype=dtype)
        for name, fn in cases.items():
            fn(z[:, :4])
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn(z)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
            res[f"{name}_{str(dtype).split('.')[-1]}"] = {
                "extra_mib": extra / 2**20, "extra_over_logits": extra / (z.numel() * z.element_size())}
        del z
        torch.cuda.empty_cache()
    return res


def main():
    if not torch.cuda.is_available():
        print(json.dumps({"error": "CUDA is not available; run this on a GPU machine"}))
        return 1
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    report = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "ours_implementation": suite.implementation(suite.ALL)}
    for key, fn in (("accumulate_sync_debug_error", lambda: sync_check(suite.ALL, dev)),
                    ("calculate_nccl_1rank", lambda: calculate_check(dev)),
                    ("host_blocked_per_accumulate", lambda: blocked_time(dev)),
                    ("peak_extra_memory", lambda: memory_check(dev)),
                    ("async_calculate", lambda: async_check(dev))):
        t0 = time.perf_counter()
        try:
            report[key] = fn()
        except Exception:  # noqa: BLE001 - one failing part must not hide the others
            report[key] = {"error": traceback.format_exc()[-2000:]}
        report[key + "_seconds"] = round(time.perf_counter() - t0, 2)
    dist.destroy_process_group()
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
