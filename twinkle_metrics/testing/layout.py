"""``assert_layout_invariant``: a metric gives the same results under any parallel layout.

The harness runs a metric on real gloo ranks (this host's CPUs) for each layout and on
one process, and compares::

    def make_metric(mesh):
        return MaskedMean(mesh)

    def feed(metric, shard):
        # this rank's part of the interval's batch: shard.dp_rank of shard.dp_size
        # sequences, shard.cp_rank's tokens; a non-last pipeline stage has no outputs
        ...

    if __name__ == "__main__":
        assert_layout_invariant(make_metric, feed, ["dp2", "tp2xdp2", "cp2xdp2", "pp2xdp2"])

Layouts are ``"<axis><size>"`` joined by ``"x"``, each of ``tp``, ``cp``, ``ep``, ``dp``,
``pp`` at most once (order free). The world is the product of the sizes. Expert
parallelism lives inside the data ranks, as in Megatron: ``"ep2xdp2"`` is 4 ranks that
all hold different tokens (``shard.dp_size == 4``) in expert groups of 2
(``shard.ep_rank``, ``shard.ep_size``). Ranks are ordered as ``parallel.layout``'s
``DEFAULT_ORDER`` (``tp-cp-ep-dp-pp``), the order the mesh is built in.
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import pickle
import re
from datetime import timedelta
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Union

from parallel import GROUP_NAMES, LAYOUT_AXES, DeviceMesh, Layout
from twinkle_metrics.testing.compare import assert_results_close
from twinkle_metrics.testing.counter import CollectiveCounter
from twinkle_metrics.testing.pool import DistPool

DEFAULT_LAYOUTS = ("dp2", "tp2xdp2", "cp2xdp2", "pp2xdp2")
_AXES = ("tp", "cp", "ep", "dp", "pp")
_TOKEN = re.compile(r"(tp|cp|ep|dp|pp)([1-9][0-9]*)")
ACCEPTED_FORMS = ("'<axis><size>' joined by 'x', axes tp, cp, ep, dp, pp each at most once, e.g. "
                  "'dp2', 'tp2xdp2', 'cp2xdp2', 'pp2xdp2', 'tp2xpp2xdp2', 'ep2xdp2'")
# the axes of parallel.layout.Layout.all_groups that make each mesh group
@dataclasses.dataclass(frozen=True)
class Shard:
    """A rank's place in a layout, as ``feed(metric, shard)`` sees it.

    The single-process reference gets every rank 0, every size 1, ``is_last_stage=True``.
    ``dp_rank``/``dp_size`` count every rank that holds different data (DP, EP
    included); TP replicas of one (dp, cp) place get the same ``dp_rank`` and ``cp_rank``.
    ``interval``: 0, 1, ... (``feed`` may vary the data per interval).
    """

    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    is_last_stage: bool = True
    interval: int = 0
    layout: str = "single"
    rank: int = 0


@dataclasses.dataclass
class LayoutReport:
    """What ``assert_layout_invariant`` saw: ``reference[i]`` is the single process's
    results of interval ``i``, ``results[layout][rank][i]`` a rank's, ``collectives[layout][rank][i]``
    the collectives its ``calculate()`` of interval ``i`` issued."""

    reference: List[Dict[str, Any]]
    results: Dict[str, List[List[Dict[str, Any]]]]
    collectives: Dict[str, List[List[int]]]


def parse_layout(layout: str) -> Layout:
    """The ``parallel.Layout`` of a layout string (``"tp2xpp2xdp2"``); ``ValueError`` naming
    the accepted forms for anything else."""
    if not isinstance(layout, str) or not layout:
        raise ValueError(f"assert_layout_invariant: layout {layout!r} is not a layout string; "
                         f"accepted: {ACCEPTED_FORMS}")
    sizes: Dict[str, int] = {}
    for token in layout.lower().split("x"):
        m = _TOKEN.fullmatch(token)
        if m is None or m.group(1) in sizes:
            raise ValueError(f"assert_layout_invariant: unknown layout {layout!r}; accepted: {ACCEPTED_FORMS}")
        sizes[m.group(1)] = int(m.group(2))
    ep = sizes.get("ep", 1)
    return Layout(tp=sizes.get("tp", 1), cp=sizes.get("cp", 1), pp=sizes.get("pp", 1),
                  dp=sizes.get("dp", 1) * ep, ep=ep)


def collective_budget(layout: Layout) -> int:
    """The library's collectives per steady-state ``calculate()``: one over the data
    group, one more over TP x PP when the layout has TP or PP (``twinkle_metrics.comm.fused``)."""
    return 1 + (layout.tp > 1 or layout.pp > 1)


def shard_of(layout: Layout, rank: int, interval: int = 0, name: str = "") -> Shard:
    """The ``Shard`` of global ``rank`` (a rank of ``layout``)."""
    c = layout.coords(rank)
    return Shard(dp_rank=c["dp"], dp_size=layout.dp, cp_rank=c["cp"], cp_size=layout.cp,
                 tp_rank=c["tp"], tp_size=layout.tp, pp_rank=c["pp"], pp_size=layout.pp,
                 ep_rank=c["ep"], ep_size=layout.ep, is_last_stage=c["pp"] == layout.pp - 1,
                 interval=interval, layout=name or layout.describe(), rank=rank)


def layout_mesh(layout: Layout, timeout_s: float = 60, source: str = "layout") -> Optional[DeviceMesh]:
    """A ``DeviceMesh`` of ``layout`` over the first ``layout.world_size`` ranks of the
    world (the others get ``None``). Collective over the whole world: every rank calls it."""
    import torch.distributed as dist

    world, me = dist.get_world_size(), dist.get_rank()
    n = layout.world_size
    if n > world:
        raise ValueError(f"layout {layout.describe()} needs {n} ranks; the world has {world}")
    timeout = timedelta(seconds=timeout_s)
    made: Dict[tuple, Any] = {}
    groups: Dict[str, Any] = {}
    for name in GROUP_NAMES:
        if name not in LAYOUT_AXES:
            continue  # dp_cp_cpu: the data group itself (gloo); gtp, expt_gtp: Megatron's only
        mine = None
        for ranks in layout.all_groups(LAYOUT_AXES[name]):
            if len(ranks) == 1:
                continue
            key = tuple(ranks)
            if key not in made:  # every rank creates every group, in the same order
                made[key] = (dist.group.WORLD if len(ranks) == world
                             else dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout))
            if me in ranks:
                mine = made[key]
        groups[name] = mine
    if me >= n:
        return None
    return DeviceMesh(groups, layout=layout, source=source)


def run_layout_rank(name: str, make_metric: Callable, feed: Callable, intervals: int,
                    timeout_s: float, exports: bool = False) -> Optional[List[tuple]]:
    """One rank's part of a layout (a ``DistPool`` job): ``[(results, collectives, export),
    ...]`` per interval, or ``None`` on a rank outside the layout. ``exports``: a twin of
    the metric is fed alike and exported each interval (its JSON text; else None), and a
    third one fed every interval calculates once, at the end: one more entry
    ``(results, None, None)`` (what a driver merging every interval must return)."""
    import torch.distributed as dist

    layout = parse_layout(name)
    mesh = layout_mesh(layout, timeout_s, source=f"layout {name}")
    if mesh is None:
        return None
    metric = make_metric(mesh)
    twin = make_metric(mesh) if exports else None
    long = make_metric(mesh) if exports else None
    out = []
    for i in range(intervals):
        shard = shard_of(layout, dist.get_rank(), i, name)
        feed(metric, shard)
        with CollectiveCounter() as c:
            res = metric.calculate()
        sent = None
        if twin is not None:
            feed(twin, shard)
            sent = json.dumps(twin.export(), allow_nan=False)  # strict JSON, as any transport takes it
            feed(long, shard)
        out.append((res, c.total, sent))
    if long is not None:
        out.append((long.calculate(), None, None))
    return out


def _default_start_method() -> str:
    import torch.distributed as dist

    if "fork" in mp.get_all_start_methods() and not (dist.is_available() and dist.is_initialized()):
        return "fork"
    return "spawn"


#: result keys a comparison leaves out: names, or a predicate on the key
Ignore = Union[None, Collection[str], Callable[[str], bool]]


def _ignored(ignore: Ignore) -> Callable[[str], bool]:
    if ignore is None:
        return lambda key: False
    if callable(ignore):
        return ignore
    names = set(ignore)
    return lambda key: key in names


def check_results(name: str, rank: Union[int, str], interval: Union[int, str], got: Dict[str, Any],
                  want: Dict[str, Any], rel: float = 1e-9, abs_tol: float = 1e-12, ignore: Ignore = None) -> None:
    """``AssertionError`` naming the layout, the rank, the interval and the key when a rank's
    results differ from the reference (keys only one side has are differences too)."""
    skip = _ignored(ignore)
    got = {k: v for k, v in got.items() if not skip(k)}
    want = {k: v for k, v in want.items() if not skip(k)}
    problems = []
    if set(got) != set(want):
        problems.append(f"keys differ: only on the rank {sorted(set(got) - set(want))}, only in the "
                        f"single process {sorted(set(want) - set(got))}")
    for key in [k for k in want if k in got]:  # every differing key, not only the first
        try:
            assert_results_close({key: got[key]}, {key: want[key]}, rel=rel, abs_tol=abs_tol)
        except AssertionError as e:
            problems.append(str(e))
    if problems:
        raise AssertionError(f"layout {name!r}, rank {rank}, interval {interval}: results differ from the "
                             f"single process (rank first): " + "; ".join(problems))


def check_collectives(name: str, rank: int, counts: Sequence[int], budget: int) -> None:
    """``AssertionError`` when a steady-state ``calculate()`` (every interval after the first,
    which agrees on the sync plan) issued more than ``budget`` collectives."""
    for i, n in enumerate(counts):
        if i >= 1 and n > budget:
            raise AssertionError(f"layout {name!r}, rank {rank}, interval {i}: calculate() issued {n} "
                                 f"collectives, over the budget of {budget} per steady-state calculate()")


def assert_layout_invariant(make_metric: Callable, feed: Callable,
                            layouts: Union[str, Sequence[str]] = DEFAULT_LAYOUTS, *,
                            intervals: int = 2, rel: float = 1e-9, abs_tol: float = 1e-12,
                            ignore: Ignore = None,
                            max_collectives: Optional[int] = None, exports: bool = True,
                            pool: Optional[DistPool] = None, start_method: Optional[str] = None,
                            timeout_s: float = 60, job_timeout_s: float = 300,
                            backend: str = "gloo") -> LayoutReport:
    """Raise ``AssertionError`` unless every rank of every layout gets the single process's results.

    For each interval (``intervals`` >= 2: feed, then ``calculate()``, which resets), each
    rank calls ``feed(metric, shard)`` with its ``Shard`` then ``metric.calculate()``; the
    reference does the same in this process with ``make_metric(DeviceMesh.single())`` and
    ``Shard()`` (ranks 0, sizes 1, last stage). A steady-state ``calculate()`` (intervals
    after the first) may issue at most the library's collectives: 1, or 2 with TP or PP
    (``max_collectives`` replaces it).

    With ``exports=True`` (default) a twin of the metric on every rank is fed alike and
    ``export()``-ed each interval, and a driver (``make_metric(DeviceMesh.single())``, no
    group) must get the single process's results from ``calculate_from``: given every
    rank's export (as strict JSON); given the data sources' alone (last stage, TP rank 0)
    where every state is of scope ``"data"``; and given every interval's exports with
    ``merge_intervals=True``, what the ranks' own ``calculate()`` of one interval spanning
    them all returns (a third instance per rank).

    Args:
        make_metric: ``make_metric(mesh)`` builds the metric (or a ``MetricCollection``).
        feed: ``feed(metric, shard)`` accumulates this rank's part of interval ``shard.interval``.
            Both must be picklable: module-level functions (in ``__main__`` too, under
            ``if __name__ == "__main__":``) or ``functools.partial`` of them.
        layouts: layout strings (see the module docstring).
        rel, abs_tol: relative and absolute tolerance of the comparison (NaN equals NaN).
        ignore: result keys left out of the comparison (names, or a predicate), e.g. wall-clock rates.
        exports: check the export path too (above); False for a metric that cannot export.
        pool: a ``DistPool`` to run on (its first ranks; the others idle). None: fresh ranks
            per layout, sized from it, killed afterwards.
        start_method: for fresh ranks: ``"fork"`` (default where available and this process
            holds no process group) or ``"spawn"``.
        timeout_s: every collective's timeout; ``job_timeout_s``: a layout's whole run.
        backend: the ranks' backend: ``"gloo"``, or ``"standin"`` (``testing.standin``: gloo
            that the library takes for a device backend, so the sync takes its device path;
            a rank that makes a bounded wait, abort, barrier or destroy on one of its groups
            fails).

    Returns a ``LayoutReport`` of everything seen, for further checks.
    """
    if isinstance(layouts, str):
        layouts = [layouts]
    parsed = {name: parse_layout(name) for name in layouts}  # ValueError before any rank starts
    if intervals < 2:
        raise ValueError(f"assert_layout_invariant: intervals must be >= 2 (one steady-state "
                         f"calculate() at least), got {intervals}")
    if pool is not None:
        too_big = [n for n, lay in parsed.items() if lay.world_size > pool.world]
        if too_big:
            raise ValueError(f"assert_layout_invariant: layouts {too_big} need more ranks than the "
                             f"pool's {pool.world}")
    try:  # the ranks get them through a queue: fail now, not at the job's timeout
        pickle.dumps((make_metric, feed))
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same
        raise TypeError(f"assert_layout_invariant: make_metric and feed must be picklable to reach the "
                        f"ranks (module-level functions or classes, or functools.partial of them); {e}") from None
    single = make_metric(DeviceMesh.single())
    reference = []
    for i in range(intervals):
        feed(single, Shard(interval=i))
        reference.append(single.calculate())
    report = LayoutReport(reference, {}, {})
    for name, layout in parsed.items():
        out = _run(name, layout, make_metric, feed, intervals, pool, start_method, timeout_s, job_timeout_s,
                   exports, backend)
        per_rank = [r[:intervals] for r in out[:layout.world_size]]
        report.results[name] = [[res for res, _, _ in r] for r in per_rank]
        report.collectives[name] = [[n for _, n, _ in r] for r in per_rank]
        budget = max_collectives if max_collectives is not None else collective_budget(layout)
        for rank, r in enumerate(per_rank):
            for i, (res, _, _) in enumerate(r):
                check_results(name, rank, i, res, reference[i], rel, abs_tol, ignore)
            check_collectives(name, rank, report.collectives[name][rank], budget)
        if exports:
            sent = [[json.loads(text) for _, _, text in r] for r in per_rank]
            check_exports(name, make_metric, sent, reference, out[0][intervals][0], rel, abs_tol, ignore)
    return report


def check_exports(name: str, make_metric: Callable, sent: List[List[Dict[str, Any]]],
                  reference: List[Dict[str, Any]], whole: Dict[str, Any], rel: float, abs_tol: float,
                  ignore: Ignore) -> None:
    """``AssertionError`` naming the layout and the exports a driver merged when its
    ``calculate_from`` differs from the single process (``reference``: per interval), or,
    merging every interval, from the ranks' own calculate() of one interval spanning them
    all (``whole``; records that count sequences over the interval count them rank by
    rank there). ``sent[rank][interval]``: the exports."""
    driver = make_metric(DeviceMesh.single())
    for i, ref in enumerate(reference):
        exports = [r[i] for r in sent]
        check_results(name, "driver (every rank's export)", i, driver.calculate_from(exports), ref, rel,
                      abs_tol, ignore)
        scopes = {d["scope"] for e in exports for m in e["metrics"] for d in m["decls"]}
        if scopes == {"data"}:
            sources = [e for e in exports if e["place"]["source"]]
            check_results(name, "driver (the data sources' exports)", i, driver.calculate_from(sources), ref, rel,
                          abs_tol, ignore)
    every = [e for r in sent for e in r]
    check_results(name, "driver (every interval, merge_intervals=True)", "all",
                  driver.calculate_from(every, merge_intervals=True), whole, rel, abs_tol, ignore)


def _run(name, layout, make_metric, feed, intervals, pool, start_method, timeout_s, job_timeout_s, exports,
         backend):
    own = pool is None
    if own:
        pool = DistPool(layout.world_size, timeout_s, start_method=start_method or _default_start_method(),
                        restart_on_failure=False)
    try:
        return pool.run(run_layout_rank, name, make_metric, feed, intervals, timeout_s, exports,
                        timeout=job_timeout_s, backend=backend)
    except AssertionError as e:
        raise AssertionError(f"layout {name!r}: {e}") from None
    except TimeoutError as e:
        raise TimeoutError(f"layout {name!r}: {e}") from None
    finally:
        if own:
            pool.close()
