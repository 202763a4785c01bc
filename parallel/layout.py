"""Pure-Python rank layout: which global ranks share each parallel axis.

Nothing here touches torch.distributed, so a layout can be built and printed
before any process group exists. The rank order follows Megatron-core's
``RankGenerator``: in ``"tp-cp-ep-dp-pp"`` the first axis varies fastest.
Dense groups use the axes ``tp, cp, dp, pp``; expert groups use
``tp (expert tp), ep, dp (expert dp), pp`` as Megatron does.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DeviceMesh: {name} must be a positive int, got {value!r}")
    return value


def _groups(sizes: Sequence[int], mask: Sequence[bool]) -> List[List[int]]:
    """All rank groups that vary exactly the masked axes (first axis fastest)."""
    strides, acc = [], 1
    for s in sizes:
        strides.append(acc)
        acc *= s
    inner = [range(s) if m else range(1) for s, m in zip(sizes, mask)]
    outer = [range(1) if m else range(s) for s, m in zip(sizes, mask)]
    groups = []
    # itertools.product varies the last element fastest; reverse so axis 0 is fastest.
    for o in itertools.product(*reversed(outer)):
        o = tuple(reversed(o))
        base = sum(c * st for c, st in zip(o, strides))
        members = []
        for i in itertools.product(*reversed(inner)):
            i = tuple(reversed(i))
            members.append(base + sum(c * st for c, st in zip(i, strides)))
        groups.append(sorted(members))
    return groups


@dataclass(frozen=True)
class Layout:
    """Sizes of every parallel axis and the rank order, validated.

    Example:
        >>> lay = Layout(tp=2, pp=2, dp=2)
        >>> lay.world_size
        8
        >>> lay.group_ranks("dp-cp", rank=5)   # the data group of rank 5
        [5, 7]
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    etp: int = 0  # expert tensor parallel size; 0 means "same as tp"
    vpp: int = 1
    order: str = DEFAULT_ORDER
    _dense: Tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "ep", "dp", "pp", "vpp"):
            _check_size(f"{name}_size", getattr(self, name))
        if self.etp:
            _check_size("etp_size", self.etp)
        tokens = self.order.lower().split("-")
        if sorted(tokens) != sorted(AXES):
            raise ValueError(
                f"DeviceMesh: order must name each of {'-'.join(AXES)} once, got {self.order!r}"
            )
        object.__setattr__(self, "order", "-".join(tokens))
        object.__setattr__(self, "_dense", tuple(tokens))
        expert_tp = self.etp or self.tp
        if (self.dp * self.cp * self.tp) % (self.ep * expert_tp) != 0:
            raise ValueError(
                f"DeviceMesh: ep_size ({self.ep}) x expert tp ({expert_tp}) must divide "
                f"dp x cp x tp ({self.dp * self.cp * self.tp}); pick ep_size so that it does"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.pp * self.ep * (self.etp or self.tp))

    def _axes_sizes(self, expert: bool) -> Tuple[List[str], List[int]]:
        if expert:
            sizes = {"tp": self.etp or self.tp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}
        else:
            sizes = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        names = list(self._dense)
        return names, [sizes[n] for n in names]

    def all_groups(self, axes: str) -> List[List[int]]:
        """Every group of ranks that varies the hyphen-joined ``axes``.

        Expert axes (``ep``, ``expt_dp``) use the expert layout, the rest the dense one.
        """
        wanted = axes.split("-")
        expert = any(a in ("ep", "expt_dp", "etp") for a in wanted)
        wanted = ["dp" if a == "expt_dp" else "tp" if a == "etp" else a for a in wanted]
        unknown = set(wanted) - set(AXES)
        if unknown:
            raise ValueError(f"DeviceMesh: unknown axis {sorted(unknown)}; axes are {AXES}")
        names, sizes = self._axes_sizes(expert)
        return _groups(sizes, [n in wanted for n in names])

    def group_ranks(self, axes: str, rank: int) -> List[int]:
        """The ranks of the group along ``axes`` that contains ``rank``."""
        for g in self.all_groups(axes):
            if rank in g:
                return g
        raise ValueError(f"DeviceMesh: rank {rank} is outside a world of {self.world_size}")

    def coords(self, rank: int) -> Dict[str, int]:
        """Coordinates of ``rank`` on each dense axis (``ep`` on the expert layout)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"DeviceMesh: rank {rank} is outside a world of {self.world_size}")
        out = {}
        for axis in ("tp", "cp", "dp", "pp"):
            out[axis] = self.group_ranks(axis, rank).index(rank)
        out["ep"] = self.group_ranks("ep", rank).index(rank)
        return out

    def describe(self) -> str:
        """A one-line summary, e.g. ``tp2 x cp1 x dp2 x pp2 (order tp-cp-ep-dp-pp)``."""
        parts = " x ".join(f"{a}{getattr(self, a)}" for a in self._dense if a != "ep")
        extra = f", ep{self.ep}" if self.ep > 1 else ""
        extra += f", vpp{self.vpp}" if self.vpp > 1 else ""
        return f"{parts}{extra} (order {self.order}, world {self.world_size})"
