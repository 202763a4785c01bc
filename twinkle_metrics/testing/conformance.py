"""``check_metric``: one call that checks a metric keeps the library's contract.

For a metric (yours or a shipped one) and the ``feed(metric, shard)`` that
``assert_layout_invariant`` takes, it checks in this process, on one interval fed with
``Shard()``:

* every key ``calculate()`` returns is declared (the library raises otherwise), and
  ``calculate(reset=False)`` is idempotent: it changes no state and a second call returns
  the same results;
* the ``state_dict`` round trip: through ``torch.save`` and ``torch.load(weights_only=True)``
  into a fresh metric, the same states and results;
* pickling: a pickled copy holds the same states and returns the same results;
* a rejected call changes nothing: a call refused after ``update`` returned (every
  ``update`` of the metric is made to raise once it returned) leaves every state as it was
  (``update`` must not change the metric), and so does ``reject(metric)`` when given;
* the export round trip: a twin's ``export()``, as strict JSON, gives a driver's
  ``calculate_from`` the same results, leaves the driver's states alone and ends the twin's
  interval;
* ``calculate()`` ends the interval: the states are back at their defaults (those kept over
  the run, ``State(keep=True)``, go on);

then runs ``assert_layout_invariant`` on ``layouts`` (real gloo ranks). Each failure is an
``AssertionError`` naming the metric and the check (an undeclared key: the library's own
``ValueError``).
"""
from __future__ import annotations

import contextlib
import io
import json
import pickle
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Sequence, Union

import torch

from parallel import DeviceMesh
from twinkle_metrics.testing.compare import assert_results_close, state_dict_differences
from twinkle_metrics.testing.layout import DEFAULT_LAYOUTS, LayoutReport, Shard, assert_layout_invariant


def check_metric(make_metric: Callable, feed: Callable, layouts: Union[str, Sequence[str]] = DEFAULT_LAYOUTS, *,
                 reject: Optional[Callable[[Any], Any]] = None, rel: float = 1e-9, abs_tol: float = 1e-12,
                 ignore: Union[None, Collection[str], Callable[[str], bool]] = None, exports: bool = True,
                 **layout_options: Any) -> Optional[LayoutReport]:
    """Raise ``AssertionError`` unless the metric keeps the contract (see the module docstring;
    an undeclared key raises the library's ``ValueError``).

    Example (``feed`` as in docs/testing.md; arguments with ``functools.partial``)::

        def test_my_metric_conforms():
            check_metric(functools.partial(MyMetric, threshold=2), feed, ["dp2", "cp2xdp2"])

    Args:
        make_metric: ``make_metric(mesh)`` builds the metric: its class, or a
            ``functools.partial`` of it with constructor arguments (a ``MetricCollection``
            factory works too).
        feed: ``feed(metric, shard)`` accumulates this rank's part of interval
            ``shard.interval``; it must reach ``update`` at least once for ``Shard()``.
        layouts: for ``assert_layout_invariant`` (``()``: the single-process checks only).
        reject: ``reject(metric)`` makes one call the metric must refuse (it must raise),
            e.g. labels that do not match the logits.
        rel, abs_tol: the tolerance of every comparison (NaN equals NaN).
        ignore: result keys left out of every comparison (names, or a predicate), e.g.
            wall-clock rates.
        exports: check the export path (here and on the layouts); False for a metric that
            cannot export.
        **layout_options: the other arguments of ``assert_layout_invariant`` (``pool``,
            ``intervals``, ``max_collectives``, ``start_method``, ``timeout_s``, ...).

    Returns the ``LayoutReport`` of the layouts, None without layouts.
    """
    def build():
        return make_metric(DeviceMesh.single())

    check = _Checker(build(), rel, abs_tol, ignore)
    m = check.metric
    feed(m, Shard())
    fed = m.state_dict()
    first = m.calculate(reset=False)  # an undeclared key raises here
    check.same_states(fed, "calculate(reset=False) changed the states")
    check.same_results(m.calculate(reset=False), first, "a second calculate(reset=False)")

    loaded = build().load_state_dict(_through_torch_save(fed))
    check.same_states(fed, "load_state_dict(state_dict()) (through torch.save) holds other states", loaded)
    check.same_results(loaded.calculate(reset=False), first, "load_state_dict(state_dict())")

    try:
        pickled = pickle.loads(pickle.dumps(m))
    except Exception as e:  # noqa: BLE001 - whatever stops pickling (a lambda, a lock, a handle)
        raise AssertionError(f"check_metric: {check.name}: it cannot be pickled ({type(e).__name__}: {e}); define "
                             "its class at module level and keep lambdas, locks and handles out of its attributes"
                             ) from None
    check.same_states(fed, "a pickled copy holds other states", pickled)
    check.same_results(pickled.calculate(reset=False), first, "a pickled copy")

    with _refusing_after_update(m) as refused:
        try:
            feed(m, Shard())
        except _Refused:
            pass
    if not refused:
        raise AssertionError(f"check_metric: {check.name}: feed(metric, Shard()) never reached update(); feed "
                             "must accumulate something for the single-process shard")
    check.same_states(fed, "a call refused after update() returned changed the states (update must change "
                           "nothing of the metric: return the contributions)")
    if reject is not None:
        try:
            reject(m)
        except Exception:  # noqa: BLE001 - any refusal counts; what matters is that nothing changed
            pass
        else:
            raise AssertionError(f"check_metric: {check.name}: reject(metric) was accepted; pass a call the "
                                 "metric refuses")
        check.same_states(fed, "a rejected call (reject) changed the states")

    if exports:
        twin = build()
        feed(twin, Shard())
        sent = json.loads(json.dumps(twin.export(), allow_nan=False))  # strict JSON, as any transport takes it
        check.at_defaults(twin, "export() did not end the interval")
        driver = build()
        before = driver.state_dict()
        check.same_results(driver.calculate_from([sent]), first, "calculate_from([export()])")
        check.same_states(before, "calculate_from changed the driver's own states", driver)

    check.same_results(m.calculate(), first, "calculate()")
    check.at_defaults(m, "calculate() did not end the interval")
    if isinstance(layouts, str):
        layouts = [layouts]
    if not layouts:
        return None
    return assert_layout_invariant(make_metric, feed, layouts, rel=rel, abs_tol=abs_tol, ignore=ignore,
                                   exports=exports, **layout_options)


class _Checker:
    """The comparisons of ``check_metric``, each failure naming the metric and the check."""

    def __init__(self, metric, rel: float, abs_tol: float, ignore):
        self.metric, self.rel, self.abs_tol = metric, rel, abs_tol
        self.name = type(metric).__name__
        if ignore is None:
            self.kept = lambda key: True
        elif callable(ignore):
            self.kept = lambda key: not ignore(key)
        else:
            names = set(ignore)
            self.kept = lambda key: key not in names

    def same_states(self, want: Dict[str, Any], what: str, metric=None) -> None:
        differ = state_dict_differences((metric or self.metric).state_dict(), want)
        if differ:
            raise AssertionError(f"check_metric: {self.name}: {what}: states {differ[:8]} differ")

    def at_defaults(self, metric, what: str) -> None:
        """Every state of ``metric`` (of each member, for a collection) at its declaration's
        default: those created on the fly stay over a reset, at their defaults; those kept over
        the run (``State(keep=True)``) go on."""
        members = list(metric) if hasattr(metric, "members") else [metric]
        differ = []
        for member in members:
            kept = {k for k, spec in member.declarations.items() if spec.keep}
            got = {k: v for k, v in member.states.items() if k not in kept}
            want = {k: spec.new(member.device) for k, spec in member.declarations.items() if k not in kept}
            differ += [f"{type(member).__name__}.{k}" for k in state_dict_differences(got, want)]
        if differ:
            raise AssertionError(f"check_metric: {self.name}: {what}: states {differ[:8]} are not at their "
                                 "defaults")

    def same_results(self, got: Dict[str, Any], want: Dict[str, Any], what: str) -> None:
        try:
            assert_results_close({k: v for k, v in got.items() if self.kept(k)},
                                 {k: v for k, v in want.items() if self.kept(k)}, self.rel, self.abs_tol)
        except AssertionError as e:
            raise AssertionError(f"check_metric: {self.name}: {what} returned other results than the first "
                                 f"calculate(reset=False): {e}") from None


def _through_torch_save(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """``state_dict`` saved and loaded as a checkpoint is (``weights_only=True``)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


class _Refused(Exception):
    """The call ``check_metric`` refuses after ``update`` returned."""


@contextlib.contextmanager
def _refusing_after_update(metric) -> Iterator[List[str]]:
    """Inside it, each ``update`` of ``metric`` (each member's, for a collection) runs, then
    raises ``_Refused``: the call is refused after ``update`` had its say. Yields the names
    of the metrics whose ``update`` ran."""
    members = list(metric) if hasattr(metric, "members") else [metric]
    ran: List[str] = []

    def refusing(member):
        update = member.update

        def refused(*args, **kwargs):
            update(*args, **kwargs)
            ran.append(type(member).__name__)
            raise _Refused(f"{type(member).__name__}: refused after update() returned")
        return refused

    for member in members:
        member.update = refusing(member)  # on the instance: the class stays as it is
    try:
        yield ran
    finally:
        for member in members:
            del member.update
