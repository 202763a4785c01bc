"""The sync's plan and merges, run on states that travel as plain data (exports) instead
of through collectives: a worker's local states in one device-to-host copy, and a
driver's merge of many workers' states, row by row, by the same code ``calculate()``
runs after its gathers (``plan._merge`` over the data shards, ``fused._merge_placed``
over the TP x PP positions, ``fused._unpack``). No process group is involved.
"""
from __future__ import annotations

import array
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from twinkle_metrics.comm.fused import _local_plan, _merge_placed, _pack, _unpack, first_disagreement
from twinkle_metrics.comm.plan import _H_PP, _HEADER, _merge, _Plan


def local_states(intervals: Sequence, configs: Sequence[str]) -> List[Dict[str, Any]]:
    """Each interval's local (unreduced) states as plain numbers (ints for int64 states,
    floats, nested lists for shaped ones): packed where they are, then one copy to the
    host for all of them, as the local path of ``calculate()`` does. ``configs``: the
    metrics' sync fingerprints."""
    metrics = intervals
    plan = _local_plan(metrics, tuple(configs))
    buf = _pack(plan, metrics, plan.length, metrics[0].device, torch.device("cpu"), need=False,
                is_source=True, pp_rank=0)
    return _unpack(buf, plan, metrics)


class Rows:
    """A metric's states laid out as the sync lays them out, for rows that came as data;
    ``interval``: one of the metric's (``core.interval.Interval``), ``config`` its sync
    fingerprint.

    ``names``: every state of the merge (the union over the rows); each row gives a flat
    list of numbers per state it holds (``{name: [numbers]}``), and the identity stands
    for a state it lacks, as in the sync.
    """

    def __init__(self, interval: Any, names: Sequence[str], config: str) -> None:
        self.metric = interval
        self.plan = _Plan([interval], [list(names)], (config,))
        self._float: List[Tuple[str, Any, int]] = []
        self._int: List[Tuple[str, Any, int]] = []
        for name, spec, offset in self.plan.entries[0]:
            (self._int if spec.dtype == torch.int64 else self._float).append((name, spec, offset))
        self._fcols = self._columns(self._float)
        self._icols = self._columns(self._int)

    @staticmethod
    def _columns(entries) -> torch.Tensor:
        cols = [_HEADER + offset + k for _, spec, offset in entries for k in range(spec.numel)]
        return torch.tensor(cols, dtype=torch.long)

    def rows(self, states: Sequence[Mapping[str, List[Any]]]) -> torch.Tensor:
        """``[len(states), header + width]`` float64 rows (int64 states bit-cast)."""
        n = len(states)
        out = torch.zeros(n, _HEADER + self.plan.length, dtype=torch.float64)
        for entries, cols, dtype in ((self._float, self._fcols, torch.float64), (self._int, self._icols, torch.int64)):
            if not entries:
                continue
            flat: List[Any] = []
            for row in states:
                for name, spec, _ in entries:
                    value = row.get(name)
                    flat.extend(value if value is not None else [spec.identity] * spec.numel)
            # through array: a C loop over the numbers, several times faster than torch.tensor(list)
            packed = array.array("d" if dtype == torch.float64 else "q", flat)
            block = torch.frombuffer(packed, dtype=dtype).reshape(n, -1) if flat else torch.zeros(n, 0, dtype=dtype)
            out[:, cols] = block if dtype == torch.float64 else block.view(torch.float64)
        return out

    def disagreement(self, rows: torch.Tensor, first: int, other: int) -> Optional[Tuple[str, Any, Any]]:
        """``(state, value in row first, value in row other)`` where two TP replicas' rows
        differ beyond the sync's tolerance, or None (``fused.first_disagreement``)."""
        found = first_disagreement(self.plan, [self.metric], rows, first, other)
        return None if found is None else found[1:]

    def merge(self, positions: Sequence[Tuple[int, torch.Tensor]]) -> Dict[str, Any]:
        """The reduced states ``calculate()`` hands ``compute``, from ``[(pp rank, rows of
        every data shard in data-group order)]``, one entry per TP x PP position in the
        TP x PP group's order (stage by stage, TP rank 0 first): each position's rows
        merged over the data shards, then the last stage's first position, with the
        states of scope ``"stage"`` and ``"model"`` merged over the positions."""
        merged = []
        for pp, rows in positions:
            vec = _merge(self.plan, [self.metric], rows)
            vec[_H_PP] = float(pp)
            merged.append(vec)
        host = torch.stack(merged)
        last = max(pp for pp, _ in positions)
        source = next(i for i, (pp, _) in enumerate(positions) if pp == last)
        return _unpack(_merge_placed(self.plan, host, host[source]), self.plan, [self.metric])[0]
