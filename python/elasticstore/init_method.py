"""The ``elasticstore://`` rendezvous scheme for ``torch.distributed.init_process_group``.

``import elasticstore`` registers it::

    dist.init_process_group("gloo", init_method="elasticstore://10.0.0.1:29400",
                            rank=rank, world_size=world_size)

torch adds ``rank`` and ``world_size`` to the URL's query and passes the group's ``timeout``; the
handler yields ``(elasticstore.Store, rank, world_size)`` once, as ``tcp://`` does.

Who serves the store:

- By default **rank 0 hosts the server** on ``host:port`` of the URL (as ``tcp://`` makes rank 0
  host the TCPStore master) and every rank, rank 0 included, connects to it. ``host`` must then be
  an address or a name of rank 0's machine (``0.0.0.0`` or ``::`` are not: clients need a real
  address; add ``?bind=0.0.0.0`` to listen on every interface while the others connect to
  ``host``); a name is resolved forward within the group's timeout. The server is tied to rank
  0's store object, which torch keeps for the whole job (see ``keepalive.py``): it serves until
  torch lets the store go (``destroy_process_group``) and the store is released, at the latest
  when the scheme is initialised again in this process (so one URL can be used again, as with
  ``tcp://``), or until the process exits.
- ``?server=external``: nobody hosts; every rank only connects, to a server started separately::

      elasticstore server --host 10.0.0.1 --port 29400 &
      ... init_method="elasticstore://10.0.0.1:29400?server=external" ...

Clients retry connecting with backoff until the timeout, so ranks may start in any order.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any
import gc
from urllib.parse import parse_qsl, urlparse

from torch.distributed.rendezvous import register_rendezvous_handler
from torch.distributed.constants import default_pg_timeout

from .stores import keepalive
from .stores.native.server import StoreServer
from .stores.native.store import Store

__all__ = ["SCHEME", "register"]

SCHEME = "elasticstore"
_SERVER_MODES = ("rank0", "external")


def _error(msg: str) -> ValueError:
    return ValueError(f"Error initializing torch.distributed using {SCHEME}:// rendezvous: {msg}")


def _handler(
    url: str, timeout: timedelta = default_pg_timeout, **kwargs: Any
) -> Iterator[tuple[Store, int, int]]:
    result = urlparse(url)
    if result.hostname is None:
        raise _error("host missing")
    if result.port is None:
        raise _error("port number missing")
    query = dict(parse_qsl(result.query))
    if "rank" not in query:
        raise _error("rank parameter missing")
    if "world_size" not in query:
        raise _error("world size parameter missing")
    rank = int(query["rank"])
    world_size = int(query["world_size"])
    mode = query.get("server", "rank0")
    if mode not in _SERVER_MODES:
        raise _error(f"server={mode!r}: expected one of {', '.join(_SERVER_MODES)}")

    # Stores of an earlier group torch released (destroy_process_group) let go of their
    # connections and servers now: this rank 0 may bind the same port again.
    keepalive.sweep()
    if keepalive.PARKED:
        gc.collect()  # torch's objects may hold a store in reference cycles (gc then sweeps)
    server = None
    if mode == "rank0" and rank == 0:
        server = StoreServer(
            query.get("bind", result.hostname), result.port, resolve_timeout=timeout
        )
    try:
        store = Store(result.hostname, result.port, timeout=timeout, client_name=f"rank{rank}")
    except BaseException:
        if server is not None:
            server.close()
        raise
    if server is not None:
        store.host_server(server)  # the server lives as long as the store torch holds
    yield (store, rank, world_size)
    raise RuntimeError(f"Unable to perform re-rendezvous using {SCHEME}:// method")


def register() -> None:
    """Registers the scheme with torch (idempotent: ``import elasticstore`` calls it)."""
    try:
        register_rendezvous_handler(SCHEME, _handler)
    except RuntimeError:  # already registered
        pass
