"""What the library keeps about each group it syncs over, in one registry.

``link(group)``: the group's ``Link``, made the first time. The registry holds the groups
weakly, as torch's registry does: a group destroyed (``destroy_process_group()``) takes
its link with it, and a new group, even at a freed group's address, never meets another's
plans, waits or twin. ``link(None)`` is the one link of syncs without a group.

What the world as a whole keeps (meshes built, call counts, the gloo groups made for host
exchanges, the groups the library made) is ``parallel.groups.world_state()``.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Optional


class Link:
    """One group's record: ``waits``, its waits' record (``comm.waits``: the group's store,
    calls so far, why it was closed); ``channels``, the plans agreed with each TP x PP
    group when this is a data group (``comm.fused``; weakly keyed, ``None``'s key
    ``NO_GROUP``); ``plans``, the plans of syncs without any group (``link(None)`` only);
    ``twin``, a weak reference to its twin for asynchronous calculates (``comm.transport``)."""

    __slots__ = ("waits", "channels", "plans", "twin", "__weakref__")

    def __init__(self) -> None:
        self.waits: Optional[Any] = None
        self.channels: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.plans: Dict[Any, Any] = {}
        self.twin: Optional["weakref.ref"] = None


class _NoGroup:
    """The key of "no group" where a group is a key (a weak-referenceable stand-in for None)."""


NO_GROUP = _NoGroup()
_LINKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> Link
#: guards the registry and every link's fields (the asynchronous calculate's thread uses them too)
LOCK = threading.RLock()


def link(group: Any) -> Link:
    """The ``Link`` of ``group`` (``None``: syncs without a group), made the first time."""
    key = NO_GROUP if group is None else group
    with LOCK:
        found = _LINKS.get(key)
        if found is None:
            found = _LINKS[key] = Link()
        return found


def find(group: Any) -> Optional[Link]:
    """The ``Link`` of ``group`` if it has one (never makes one)."""
    with LOCK:
        return _LINKS.get(NO_GROUP if group is None else group)
