"""What ``StepGuard.check()`` adds to the training step it guards, on CPU.

    .venv/bin/python -m benchmarks.bench_guard [--world 2] [--iters 200] [--hidden 512] [--backend gloo]

On ``--world`` ranks (no more than the cores; one process each, one intra-op thread), each
iteration is a data-parallel training step of an MLP (``--layers`` x ``--hidden``, a batch
of ``--batch``): forward, backward, one all-reduce of the flat gradients over the ranks (as
DDP does), AdamW. Then, after a barrier (the ranks' skew in the step stays the step's), the
guard's check of that step: the loss as a ``[sum, count]`` pair, the grad norm, the last
hidden layer's activations as per-token values. Beside it, after a barrier each, an
all-reduce of the check's size: plain (``dist.all_reduce``, the floor of any cross-rank
verdict) and through ``comm.transport.Transport`` (the library's bounded wait, the floor of
this one); the three take turns to come first after the step. All on the same ranks, in the
same run. An iteration's times are the slowest rank's; the ratio check / step is taken per
iteration and summarised by its median (p10, p90). The collectives of a healthy check are
counted (``testing.CollectiveCounter``). ``--backend standin`` runs on the device-backend
stand-in (the library's device path on CPU). Writes
``benchmarks/results/guard_<backend>_h<hidden>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks import common

TIMED = ("step", "check", "plain", "transport")


def _rank(iters: int, hidden: int, layers: int, batch: int):
    import torch
    import torch.distributed as dist

    from parallel import DeviceMesh
    from twinkle_metrics import StepGuard
    from twinkle_metrics.comm.transport import Transport
    from twinkle_metrics.testing import CollectiveCounter

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (torch.nn.Linear(hidden, hidden), torch.nn.GELU())]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, 1))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, hidden, generator=g), torch.randn(batch, 1, generator=g)
    mesh = DeviceMesh.from_sizes(dp_size=world)
    guard = StepGuard(mesh, warmup=10)
    acts = {}
    model[-2].register_forward_hook(lambda mod, inp, out: acts.__setitem__("last", out.detach()))

    def step():
        opt.zero_grad()
        loss_sum = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
        (loss_sum / (batch * world)).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        torch.nn.utils.vector_to_parameters(flat, [p.grad for p in params])
        norm = flat.norm()
        opt.step()
        return torch.stack([loss_sum.detach().double(), torch.tensor(float(batch), dtype=torch.float64)]), norm

    def check(pair, norm):
        return guard.check(loss=pair, grad_norm=norm, values=acts["last"])

    def through_transport(buf):
        t = Transport("bench", mesh, dist.group.WORLD, None)
        return t.host(t.all_reduce(buf, dist.group.WORLD))

    for _ in range(5):
        check(*step())
    out = step()
    with CollectiveCounter() as counter:
        verdict = check(*out)
    assert verdict.ok, verdict
    buf = torch.zeros(19, dtype=torch.float64)  # the check's size (13 lanes, 6 kept values)
    times = {k: [] for k in TIMED}
    pending = {}
    calls = [("check", lambda: check(*pending["out"])), ("plain", lambda: dist.all_reduce(buf)),
             ("transport", lambda: through_transport(buf))]
    for i in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        pending["out"] = step()
        times["step"].append(time.perf_counter() - t0)
        for name, call in calls[i % 3:] + calls[:i % 3]:  # each goes first after the step as often
            dist.barrier()
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    everyone = [None] * world
    dist.all_gather_object(everyone, times)
    return counter.total, sum(p.numel() for p in params), everyone


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--backend", choices=("gloo", "standin"), default="gloo")
    args = ap.parse_args(argv)
    if args.world > (os.cpu_count() or 1):
        raise SystemExit(f"--world {args.world} is more ranks than this machine's {os.cpu_count()} cores")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = common.pool_run(args.world, _rank, args.iters, args.hidden, args.layers, args.batch, timeout=1800,
                          backend=args.backend)
    collectives, n_params, everyone = out[0]
    slow = common.slowest(everyone, TIMED, args.iters)
    ms = {k: 1e3 * statistics.median(v) for k, v in slow.items()}
    ratios = sorted(c / s for c, s in zip(slow["check"], slow["step"]))
    q = statistics.quantiles(ratios, n=10)
    report = {"world": args.world, "backend": args.backend, "iters": args.iters, "hidden": args.hidden,
              "layers": args.layers, "batch": args.batch, "params": n_params,
              **{f"median_ms_{k}": v for k, v in ms.items()},
              "ratio_median": statistics.median(ratios), "ratio_p10": q[0], "ratio_p90": q[-1],
              "collectives_per_check": collectives}
    print(f"StepGuard.check() on {args.world} ranks ({args.backend}), MLP {args.layers}x{args.hidden} "
          f"({n_params / 1e6:.2f} M params, batch {args.batch}): step {ms['step']:.2f} ms, check "
          f"{ms['check']:.3f} ms; an all-reduce of its size: {ms['plain']:.3f} ms plain, {ms['transport']:.3f} ms "
          f"through Transport; check/step {report['ratio_median']:.4f} (p10 {q[0]:.4f}, p90 {q[-1]:.4f}); "
          f"{collectives} collective(s) per healthy check")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        f"guard_{args.backend}_h{args.hidden}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
