"""A rendezvous for the ranks a test starts that no other process on the host can take.

Handing out a "free port" (bind port 0, close the socket, pass the number on) races: until
the rank that hosts the store binds the number again, any process may take it, and two
jobs that got the same number meet in one store and read each other's addresses. Here the
process that starts the ranks hosts the store itself, as ``torchrun`` does: a
``TCPStore`` on port 0 keeps its listening socket for as long as it lives, so its port is
real and cannot be taken. Use one per job: a store that served an earlier job still holds
the addresses its ranks published, and a later job's group of the same name would read
them::

    with Rendezvous() as rdzv:
        env = dict(os.environ, **rdzv.env(), RANK="0", WORLD_SIZE="2")
        subprocess.run([sys.executable, "train.py"], env=env)  # init_process_group("gloo")

* ``rdzv.env()``: the environment for ranks that call ``init_process_group()`` with its
  default ``env://`` (scripts, launchers): every rank, rank 0 included, connects to the
  store as a client.
* ``rdzv.host``, ``rdzv.port``: for ranks of one's own, which connect with
  ``TCPStore(host, port, is_master=False)`` and pass it to ``init_process_group(store=...)``
  (``DistPool`` does).

One process needs no port at all: ``init_process_group("gloo", store=dist.HashStore(),
rank=0, world_size=1)``.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Dict, Optional

HOST = "127.0.0.1"
#: torch's contract between its launcher and ``env://``: with it set, rank 0 connects to the
#: store at MASTER_ADDR:MASTER_PORT instead of hosting one (torch.distributed.rendezvous
#: ``_create_c10d_store``; ``torchrun`` sets it for its workers). The one place it is named;
#: tests/testing/test_rendezvous_dist.py fails if torch stops reading it.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


class Rendezvous:
    """A ``TCPStore`` this process hosts on a port of its own, for ranks it starts.

    Args:
        timeout_s: how long this process's own store operations wait.
    """

    def __init__(self, timeout_s: float = 300) -> None:
        import torch.distributed as dist

        self.host = HOST
        self._store: Optional[dist.TCPStore] = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))
        self.port = self._store.port

    def env(self) -> Dict[str, str]:
        """MASTER_ADDR, MASTER_PORT and the variable that makes rank 0 a client of this store
        (RANK, WORLD_SIZE and LOCAL_RANK are the caller's, or its launcher's)."""
        return {"MASTER_ADDR": self.host, "MASTER_PORT": str(self.port), AGENT_STORE_ENV: "True"}

    def close(self) -> None:
        """Stop hosting the store (the ranks that used it are done)."""
        self._store = None

    def __enter__(self) -> "Rendezvous":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

