"""Agreement before the collectives that run inside ``accumulate``.

Some metrics communicate inside ``accumulate`` (vocab-parallel argmax and entropy
over TP, sequence completion over CP, the in-batch gather of ``EmbeddingMetric``
over the data group). If one rank rejects its input and the training loop catches
the error, its peers, already inside the collective, would be paired with the
wrong step and hang later. So before any such collective the ranks *agree*: one
fixed-size host-side exchange (``agree``) that tells every rank whether a peer
rejected its input, and carries a few host-known sizes so that peers holding
different sizes raise instead of reaching a size-mismatched collective.

Contract for a metric that communicates in ``accumulate``:

1. ``exchange_groups()`` lists the groups it communicates over, in the order its
   ``update`` agrees on them (only groups of more than one rank).
2. ``update`` validates *all* of its input first, then calls ``agree(self, g, ...)``
   exactly once per listed group per call, whatever the input (also when it holds
   nothing), before any payload collective. A validation error ``e`` becomes
   ``agree(self, g, error=e)``, which re-raises it; ``guard(self)`` does this for
   every listed group. After the agreements nothing may raise, except a check of
   the agreed (identical on every rank) values, which then raises on every rank.
3. Whatever fails where, every rank performs the same sequence of agreements:
   ``join_failed`` (called by ``guard``, by ``Metric.accumulate`` and by
   ``MetricCollection.accumulate`` for the metrics after a failing one) agrees,
   with the error, on every listed group not yet agreed on.

Example (inside ``update``)::

    with exchange.guard(self):
        work = self._validate(inputs, outputs)          # may raise ValueError
        n = work.numel()
        n_max, neg_n_min = exchange.agree(self, tp_group, values=[n, -n])
        if n_max != -neg_n_min:
            raise ValueError("TP ranks hold different token counts ...")  # on every rank
    return self._payload(work)                          # the collective; cannot raise
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from parallel.groups import ProcessGroup, group_rank, group_size
from twinkle_metrics.comm.fused import MetricSyncError
from twinkle_metrics.comm.host import host_max

_SLOTS = 3


def _label(metric: Any, group: ProcessGroup) -> str:
    try:
        return metric.resolve_mesh().group_label(group)
    except Exception:  # noqa: BLE001 - a label must never raise
        return "process group"


def agree(metric: Any, group: ProcessGroup, *, error: Optional[BaseException] = None, values: Sequence[int] = (),
          cpu_group: ProcessGroup = None) -> List[int]:
    """One host-side agreement over ``group``; returns the MAX of ``values`` over it.

    All-reduces ``[bad, v1, v2, v3]`` (int64, MAX) over a CPU group over the ranks of
    ``group`` (``DeviceMesh.host_group``): no device read. ``bad`` is this rank's global rank + 1 when ``error``
    is given. If any rank of ``group`` is bad, every rank raises: a rejecting rank
    its own ``error``, the others ``MetricSyncError`` naming the rejecting rank.
    Encode a minimum as the maximum of the negation (``values=[n, -n]`` checks that
    every rank holds ``n``).

    Args:
        metric: the metric agreeing (named in messages; records the group in
            this call's record of agreed groups, ``begin``).
        group: the group the payload collective will run over; ``None`` or one
            rank: nothing to agree on (the error, if any, is raised at once).
        error: this rank's validation error, or ``None``.
        values: up to 3 host-known Python integers.
        cpu_group: a CPU group over the ranks of ``group`` to use instead of the
            mesh's (``DeviceMesh.host_group``).

    Returns:
        the reduced values, as many as given.
    """
    ints = [int(v) for v in values]
    if len(ints) > _SLOTS:
        raise ValueError(f"exchange.agree: at most {_SLOTS} values, got {len(ints)}")
    _AGREED.setdefault(metric, []).append(group)
    if group is None or group_size(group) <= 1:
        if error is not None:
            raise error
        return ints
    import torch.distributed as dist

    mesh = metric.resolve_mesh()
    if cpu_group is None:
        cpu_group = mesh.host_group(group)
    bad = dist.get_rank() + 1 if error is not None else 0
    name = type(metric).__name__
    reduced = host_max(name, [bad] + ints + [0] * (_SLOTS - len(ints)), group, cpu_group,
                       _label(metric, group), mesh.wait_timeout())
    if reduced[0]:
        if error is not None:
            raise error
        raise MetricSyncError(
            f"{name}.accumulate: rank {reduced[0] - 1} rejected its input, so this call was skipped "
            f"on every rank of the {_label(metric, group)} and nothing was accumulated (rank "
            f"{group_rank(group)} of the group is this one); the error with its cause is raised "
            f"on rank {reduced[0] - 1}")
    return reduced[1:1 + len(ints)]


def agree_same(metric: Any, group: ProcessGroup, value: int) -> Tuple[int, int]:
    """``agree`` on one host-known integer that every rank of ``group`` must hold (a
    size, or several packed in one key); returns ``(lowest, highest)`` over the group,
    equal when every rank holds the same value."""
    high, neg_low = agree(metric, group, values=[value, -value])
    return -neg_low, high


#: per metric, the groups agreed on in its current ``update`` call (weak: a metric that is
#: gone takes its record with it)
_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def begin(metric: Any) -> None:
    """Start a new record of the groups ``metric`` agrees on (one per ``update`` call)."""
    _AGREED[metric] = []


def agreed(metric: Any) -> List[ProcessGroup]:
    """The groups ``metric`` agreed on in its current ``update`` call, in order."""
    return list(_AGREED.get(metric, ()))


def join_failed(metric: Any, error: BaseException, fresh: bool = False) -> None:
    """Agree, with ``error``, on every group of ``metric`` not yet agreed on in this call.

    ``fresh``: the metric's ``update`` never ran in this call (an earlier metric of a
    collection failed), so join all of its groups. Swallows what the agreements
    raise; the caller re-raises ``error``.
    """
    done = [] if fresh else list(_AGREED.get(metric, ()))
    for group in metric.exchange_groups():
        if any(group is g for g in done):
            continue
        try:
            agree(metric, group, error=error)
        except MetricSyncError:
            pass
        except BaseException as exc:  # noqa: BLE001 - our own error, re-raised by the caller
            if exc is not error:
                raise


@contextlib.contextmanager
def guard(metric: Any) -> Iterator[None]:
    """Wrap validation and agreements in ``update``: an exception inside joins every
    remaining group with it (so peers raise too), then propagates.

    Starts the call's record of agreed groups (``begin``). A metric that
    communicates checks first that its mesh can (``DeviceMesh.check_live``): a
    layout-only or destroyed mesh raises here, on every rank alike, before anything.
    """
    begin(metric)
    if metric.exchange_groups():
        metric.resolve_mesh().check_live(f"{type(metric).__name__}.accumulate()")
    try:
        yield
    except Exception as exc:
        join_failed(metric, exc)
        raise
