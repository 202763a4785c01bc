"""A clean end: what the library started is stopped before the process groups go.

Without ``destroy_process_group()``, gloo's groups are torn down while the interpreter
finalises, and a rank can abort there ("terminate called without an active
exception", exit code -6) after printing every result, even in plain torch. So the
first time a process syncs over real groups (``ensure``), the library:

* registers an exit handler (it runs before torch's own, registered earlier, and before
  the interpreter finalises): pending asynchronous syncs get ``pending.EXIT_WAIT_S``
  seconds, the background thread stops, the groups the library made are destroyed
  newest first, and then, unless ``TWINKLE_METRICS_DESTROY_AT_EXIT=0``, the default
  group too (``destroy_process_group()``, as torch asks every program to do);
* wraps ``torch.distributed.destroy_process_group`` so that a script's own call does
  the first three steps before torch destroys the groups (a sync still running on
  the background thread would otherwise use a group being destroyed).

Both are idempotent; ``destroy_process_group(group)`` of one group is passed through.
"""
from __future__ import annotations

import atexit
import functools
import os
import threading

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from parallel import groups as G

_REGISTERED = {"pid": None}
_LOCK = threading.Lock()


def ensure() -> None:
    """Register the exit handler and the ``destroy_process_group`` wrapper (once per
    process; a forked child registers its own)."""
    if _REGISTERED["pid"] == os.getpid():
        return
    with _LOCK:
        if _REGISTERED["pid"] == os.getpid():
            return
        _REGISTERED["pid"] = os.getpid()
        atexit.register(_at_exit)
        for mod in (dist, c10d):
            original = getattr(mod, "destroy_process_group", None)
            if original is not None and not getattr(original, "_twinkle_metrics", False):
                mod.destroy_process_group = _wrap(original)


def release() -> None:
    """Stop the background syncs and destroy what the library created (the process
    groups stay); what ``destroy_process_group()`` runs first."""
    from twinkle_metrics.comm import bounded, pending

    pending.shutdown()
    bounded.forget()
    G.release_owned()


def _wrap(original):
    @functools.wraps(original)
    def destroy_process_group(group=None):
        if group is None or group is dist.group.WORLD:
            release()
        return original(group)

    destroy_process_group._twinkle_metrics = True
    return destroy_process_group


def _at_exit() -> None:
    if _REGISTERED["pid"] != os.getpid():
        return
    try:
        release()
        if G.dist_ready() and os.environ.get("TWINKLE_METRICS_DESTROY_AT_EXIT", "1") != "0":
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - an exit handler must not turn a clean exit into a failure
        pass
