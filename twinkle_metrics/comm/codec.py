"""``Codec``: what a sync does between its collectives, callable without a process group.

``calculate()`` packs every state of a set of intervals into one float64 buffer (int64
states bit-cast), gathers the buffers of the data group's ranks and merges them (or, on
large groups, all-reduces what the reduce path sends and unpacks what comes back), and
unpacks the merged row into plain numbers. ``Codec`` is that codec for one set of
intervals, with no collective: tests and simulations of many ranks check the sync's
arithmetic through it, as ``calculate()`` runs it.

Example (two simulated ranks of one data group)::

    codec = Codec([interval_of(m) for m in metrics_of_rank0])
    rows = torch.stack([codec.pack([interval_of(m) for m in ms]) for ms in (rank0, rank1)])
    states = codec.unpack(codec.merge(rows))      # per interval: {state: plain number}
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from twinkle_metrics.comm import fused, plan, reduce


class Codec:
    """The packed layout of ``intervals`` (``core.interval.Interval``, one per metric) and
    its four operations. ``fingerprints``: each metric's sync fingerprint (default empty),
    part of the layout's hash as in ``calculate()``."""

    def __init__(self, intervals: Sequence, fingerprints: Optional[Sequence[str]] = None) -> None:
        self.intervals = list(intervals)
        names = [sorted(iv.specs) for iv in self.intervals]
        prints = tuple(fingerprints) if fingerprints is not None else ("",) * len(self.intervals)
        self._plan = plan._Plan(self.intervals, names, prints)

    @property
    def length(self) -> int:
        """Columns of states (the header not counted)."""
        return self._plan.length

    @property
    def hash(self) -> float:
        """The layout's hash (48 bits, exact in float64), as the buffer's header carries it."""
        return self._plan.hash

    @property
    def reduce_sizes(self) -> Tuple[int, int, int, int]:
        """What the reduce path's collectives carry: float sums, int sums, extremes, gathered."""
        return self._plan.reduce_sizes

    @property
    def order(self) -> List[str]:
        """The states as the buffer holds them, ``"metric.state"``: kind by kind (float and int
        sums, maxima, minima), then the states that merge themselves."""
        return [f"{self.intervals[i].name}.{n}" for i, n, _ in self._plan.order]

    @property
    def self_merged(self) -> List[Tuple[str, torch.dtype]]:
        """The states merged by their own callable reduction (``"metric.state"``, dtype): the
        gather path merges them from every rank's rows, the reduce path gathers them."""
        return [(f"{self.intervals[i].name}.{name}", spec.dtype)
                for i, entries in self._plan.custom for name, spec, _, _ in entries]

    def pieces(self, intervals: Optional[Sequence] = None) -> List[torch.Tensor]:
        """The flat float64 pieces (int64 bit-cast) ``pack`` concatenates, in buffer order:
        one per run of scalars of one dtype where every interval is on one device, else one
        per state, on its own device."""
        ivs = self.intervals if intervals is None else list(intervals)
        return self._plan.pieces(ivs, torch.device("cpu"))

    def pack(self, intervals: Optional[Sequence] = None, *, need: bool = False) -> torch.Tensor:
        """One rank's buffer, on the host: the header (layout hash, ``need`` a new layout,
        result source, pipeline rank 0) and the states of ``intervals`` (default: the
        codec's own), or only the header when ``need``."""
        ivs = self.intervals if intervals is None else list(intervals)
        cpu = torch.device("cpu")
        return fused._pack(self._plan, ivs, self.length, cpu, cpu, need=need, is_source=True, pp_rank=0)

    def merge(self, rows: torch.Tensor) -> torch.Tensor:
        """The merged row of every rank's buffer (``[ranks, header + length]``): the gather
        path's, each state by its declared reduction."""
        return plan._merge(self._plan, self.intervals, rows)

    def reduce_send(self, buf: Optional[torch.Tensor] = None, *, need: bool = False) -> Tuple:
        """What the reduce path sends from one rank's ``buf``: (int64 MAX keys, float64 sums
        or None, int64 sums or None, the self-merged columns to gather or None)."""
        buf = self.pack(need=need) if buf is None else buf
        return reduce._reduce_pack(None if need else self._plan, buf, self.reduce_sizes)

    def reduce_receive(self, buf: torch.Tensor, top: torch.Tensor, sums_f: Optional[torch.Tensor],
                       sums_i: Optional[torch.Tensor], rows: Optional[torch.Tensor]) -> torch.Tensor:
        """The merged row the reduce path makes of its collectives' results (``top``: the MAX
        of every rank's keys; the sums; the gathered self-merged columns)."""
        return reduce._reduce_unpack(self._plan, self.intervals, buf, top, sums_f, sums_i, rows)

    def needs_layout(self, row: torch.Tensor) -> bool:
        """Whether a merged row says some rank asked for a new layout (or held another)."""
        return bool(row[plan._H_NEED].item() != 0)

    def unpack(self, row: torch.Tensor) -> List[Dict[str, Any]]:
        """Plain states per interval from a merged host row: ints for int64 states
        (bit-exact), floats for float64, nested lists for shaped states."""
        return fused._unpack(row, self._plan, self.intervals)

    def states_of(self, row: torch.Tensor) -> torch.Tensor:
        """The states of ``row`` (its header dropped), float64 (int64 bit-cast)."""
        return row[plan._HEADER:plan._HEADER + self.length]

    def int_columns(self) -> torch.Tensor:
        """Which columns of ``states_of`` hold int64 states (bool mask)."""
        mask = torch.zeros(self.length, dtype=torch.bool)
        for entries in self._plan.entries:
            for _, spec, offset in entries:
                mask[offset:offset + spec.numel] = spec.dtype == torch.int64
        return mask
