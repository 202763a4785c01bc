"""Test helpers that ship with the package: use them on your own metrics too.

* ``check_metric(make_metric, feed, layouts)``: the conformance check of a metric in one
  call: declared keys, idempotent ``calculate(reset=False)``, the ``state_dict`` round trip,
  pickling, a rejected call that changes nothing, the export / ``calculate_from`` round trip,
  then ``assert_layout_invariant`` on ``layouts`` (see ``twinkle_metrics.testing.conformance``
  and docs/testing.md).
* ``assert_layout_invariant(make_metric, feed, layouts)``: runs the metric on real gloo
  ranks for each layout (``"dp2"``, ``"tp2xdp2"``, ``"cp2xdp2"``, ``"pp2xdp2"``,
  ``"tp2xpp2xdp2"``, ``"ep2xdp2"``, ...) and on one process, and raises
  ``AssertionError`` naming the layout, the rank and the key when a rank's results differ,
  or when a steady-state ``calculate()`` issues more collectives than the library's
  budget. ``feed(metric, shard)`` gets the rank's place as a ``Shard``. See
  ``twinkle_metrics.testing.layout`` and docs/testing.md.
* ``DistPool(world)``: a pool of gloo ranks on this host; ``pool.run(fn, *args)`` calls
  ``fn`` on every rank. Pass one as ``assert_layout_invariant(..., pool=pool)`` to reuse it.
* ``Rendezvous()``: a store this process hosts for ranks it starts, on a port no other
  process can take; ``dict(os.environ, **rdzv.env(), RANK=..., WORLD_SIZE=...)`` for
  ranks that call ``init_process_group()`` (see ``twinkle_metrics.testing.rendezvous``).
* ``forbid_device_waits()``: inside it, any Python-level call that would make the
  host wait for the device (``.item()``, ``.tolist()``, ``.cpu()``, ``float(t)``,
  ``bool(t)``, ``nonzero``, ``torch.equal``, ``is_nonzero``, ``bincount``,
  ``repeat_interleave`` without ``output_size``, one-argument ``torch.where``,
  boolean-mask indexing and assignment, ...) raises ``DeviceWaitError``. Not caught:
  ``.to("cpu")`` and device-to-host ``copy_`` (on a CPU-only machine every tensor is a
  host tensor, so they cannot be told from harmless calls).
  On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is the ground-truth check;
  this guard gives the same verdict on a CPU-only machine.
* ``assert_results_close(got, want)``: same keys, numbers equal to a tolerance.
* ``state_dict_differences(a, b)``: the keys where two ``state_dict()`` results differ
  (of a metric or a collection; NaN equals NaN), e.g. to show a rejected call changed
  nothing: ``assert not state_dict_differences(before, metric.state_dict())``.
* ``CollectiveCounter``: counts the torch.distributed collectives made inside it.
* ``merged_results(shards)``: the single-process conformance check of a metric's merge:
  metrics that each accumulated one shard, merged as ``calculate()`` merges the ranks of
  a data group; compare with one metric that accumulated everything.
"""
from twinkle_metrics.testing.compare import assert_results_close, merged_results, state_dict_differences
from twinkle_metrics.testing.conformance import check_metric
from twinkle_metrics.testing.counter import CollectiveCounter
from twinkle_metrics.testing.guard import DeviceWaitError, forbid_device_waits, intercept_device_waits
from twinkle_metrics.testing.layout import (
    DEFAULT_LAYOUTS,
    LayoutReport,
    Shard,
    assert_layout_invariant,
    collective_budget,
    parse_layout,
)
from twinkle_metrics.testing.pool import DistPool
from twinkle_metrics.testing.rendezvous import Rendezvous

__all__ = ["CollectiveCounter", "DEFAULT_LAYOUTS", "DeviceWaitError", "DistPool", "LayoutReport", "Shard",
           "assert_layout_invariant", "assert_results_close", "check_metric", "collective_budget",
           "forbid_device_waits", "intercept_device_waits", "merged_results", "parse_layout", "Rendezvous",
           "state_dict_differences"]
