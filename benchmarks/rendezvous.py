"""Rendezvous join time: N simulated agents (threads, each a handler with its own connections)
start ``next_rendezvous()`` together; the figure is the time from that start (every agent has
joined within it) to the last agent holding its rank. Side by side:

- ``elasticstore``: our handler on an in-process native server (``min = max = N``), the
  rendezvous defaults (``lease_ttl`` 5 s: the silent-node checks run, with N agents' threads
  in one interpreter);
- ``elasticstore-tuned``: the same with the settings of the etcd peer (lease 120 s,
  ``last_call_timeout`` 1 s, ``join_timeout`` 120 s), as this benchmark ran before;
- ``elasticstore-etcd``: our handler on one etcd v3 member (``etcd_peer.py``: etcd's defaults,
  WAL fsync on), lease TTL 120 s (as ``elasticstore``'s heartbeat: no silent-node timeouts);
- ``torch-c10d``: torch's ``DynamicRendezvousHandler`` with ``C10dRendezvousBackend`` on torch's
  ``TCPStore`` (``is_master`` in this process, one client per agent), as ``--rdzv-backend=c10d``.

    python benchmarks/rendezvous.py [--agents 8,64,256] [--peers elasticstore,torch-c10d]
                                    [--limit SECONDS] [--shutdown] [--switch-interval S]

``--shutdown`` also measures N handlers waiting in the rendezvous shut down at once.
``--switch-interval`` sets the interpreter's GIL switch interval (default CPython's 5 ms): the N
agents are threads of one interpreter here, N processes in a real job, and at 1024 agents the
forced GIL hand-offs between a few thousand threads take most of the time (1024 agents: 9-14 s
at 5 ms, 1.5 s at 50 ms on the 2-core VM).

``rendezvous_spread.py`` runs ours with the agents spread over processes and loopback
source addresses, on an external server, as real nodes are.

A peer that does not finish within ``--limit`` is reported as such (its threads are left to the
process exit; the rendezvous timeouts bound them). The pytest entry points are in
``rendezvous_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # etcd_peer, procs

PEERS = ("elasticstore", "elasticstore-etcd", "torch-c10d")
TUNED = "elasticstore-tuned"  # ours with the 120 s lease the etcd peer needs (see _etcd)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ours(n: int, run_id: str, tuned: bool = False, nodes: int | None = None,
          ) -> tuple[list[Any], Callable[[], None]]:
    """``n`` handlers of a run of ``nodes`` (default ``n``) nodes; the rendezvous defaults
    (``lease_ttl`` 5 s: silent-node checks on) unless ``tuned`` (120 s lease, as before)."""
    import elasticstore
    from elasticstore.rendezvous.handler import ElasticRendezvousHandler
    from elasticstore.rendezvous.native import create_native_backend
    from elasticstore.rendezvous.settings import RendezvousSettings

    server = elasticstore.StoreServer("127.0.0.1", 0)
    conf: dict[str, Any] = {"join_timeout": 120, "last_call_timeout": 1, "lease_ttl": 120} if tuned else {}
    settings = RendezvousSettings(run_id=run_id, host="127.0.0.1", port=server.port,
                                  min_nodes=nodes or n, max_nodes=nodes or n,
                                  local_addr="127.0.0.1", **conf)
    handlers = [ElasticRendezvousHandler(create_native_backend(settings), settings)
                for _ in range(n)]

    def close() -> None:
        for h in handlers:
            h.shutdown()
        server.close()

    return handlers, close


def _etcd(n: int, run_id: str) -> tuple[list[Any], Callable[[], None]]:
    import etcd_peer
    from elasticstore.rendezvous.etcd import create_etcd_backend
    from elasticstore.rendezvous.handler import ElasticRendezvousHandler
    from elasticstore.rendezvous.settings import RendezvousSettings

    srv = etcd_peer.start_server()
    settings = RendezvousSettings(run_id=run_id, host=srv.host, port=srv.port,
                                  min_nodes=n, max_nodes=n, local_addr="127.0.0.1",
                                  join_timeout=120, last_call_timeout=1,
                                  # as for ours: N lease keep-alive threads share one interpreter
                                  # here; with the default 5 s, 512 agents' leases lapsed
                                  lease_ttl=120)
    endpoint = f"{srv.host}:{srv.port}"
    handlers = [ElasticRendezvousHandler(create_etcd_backend(settings, endpoint), settings)
                for _ in range(n)]

    def close() -> None:
        for h in handlers:
            h.shutdown()
        srv.close()

    return handlers, close


def _torch(n: int, run_id: str) -> tuple[list[Any], Callable[[], None]]:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler, RendezvousTimeout,
    )

    port = _free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, use_libuv=True,
                           timeout=timedelta(seconds=120))
    keep = [master]
    handlers = []
    for _ in range(n):
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        backend = C10dRendezvousBackend(store, run_id)
        handlers.append(DynamicRendezvousHandler.from_backend(
            run_id, store, backend, n, n, local_addr="127.0.0.1",
            timeout=RendezvousTimeout(join=timedelta(seconds=120), last_call=timedelta(seconds=1)),
        ))

    def close() -> None:
        for h in handlers:
            try:
                h.shutdown()
            except Exception:
                pass
        keep.clear()  # the master store lives until here

    return handlers, close


def join_time(peer: str, n: int, limit: float = 120.0) -> float | None:
    """Seconds from the common start to the last agent's rank (None: over ``limit``, or the
    peer's own join timeout fired)."""
    make = {"elasticstore": _ours, TUNED: lambda n, run: _ours(n, run, tuned=True),
            "elasticstore-etcd": _etcd, "torch-c10d": _torch}[peer]
    handlers, close = make(n, f"bench{time.monotonic_ns()}")
    start_gate = threading.Barrier(n + 1)
    ranks: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def agent(h: Any) -> None:
        start_gate.wait()
        try:
            info = h.next_rendezvous()
            with lock:
                ranks.append(info.rank)
        except BaseException as exc:  # reported below
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=agent, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    start_gate.wait()
    t0 = time.perf_counter()
    deadline = time.monotonic() + limit
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    elapsed = time.perf_counter() - t0
    done = not any(t.is_alive() for t in threads)
    if errors:  # torch's handler gives up at its join timeout (120 s here) at 256 agents
        print(f"{peer} x{n}: failed: {errors[0]!r}", file=sys.stderr, flush=True)
        return None
    if done:
        assert sorted(ranks) == list(range(n)), (peer, n, sorted(ranks)[:10])
        close()
        return elapsed
    return None


def shutdown_time(n: int, limit: float = 120.0) -> float | None:
    """Seconds for ``n`` handlers of one process, all waiting in ``next_rendezvous`` for a node
    that never comes (rendezvous defaults), to be shut down at once (from ``n`` threads) until
    every wait has ended; None when some wait outlived ``limit``."""
    from concurrent.futures import ThreadPoolExecutor

    handlers, close = _ours(n, f"bench{time.monotonic_ns()}", nodes=n + 1)
    threads = [threading.Thread(target=_swallow, args=(h.next_rendezvous,), daemon=True)
               for h in handlers]
    for t in threads:
        t.start()
    store = handlers[0]._backend.store.clone()  # the run's keys: wait until all n joined
    deadline = time.monotonic() + limit
    while len(store.list_keys(handlers[0]._keys.join_prefix(1))) < n:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    store.close()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda h: h.shutdown(), handlers))
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    elapsed = time.perf_counter() - t0
    close()
    return None if any(t.is_alive() for t in threads) else elapsed


def _swallow(call: Callable[[], Any]) -> None:
    try:
        call()
    except Exception:  # the shutdown ends the wait with an error: expected
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", default="8,64,256")
    parser.add_argument("--peers", default=",".join((PEERS[0], TUNED) + PEERS[1:]),
                        help=f"of {', '.join((PEERS[0], TUNED) + PEERS[1:])}")
    parser.add_argument("--shutdown", action="store_true",
                        help="also: N waiting handlers shut down at once (ours, defaults)")
    parser.add_argument("--limit", type=float, default=120.0)
    parser.add_argument("--switch-interval", type=float, default=sys.getswitchinterval(),
                        help="the interpreter's GIL switch interval for the run (default: "
                             "CPython's, 0.005 s); N agents are N processes in a real job, and "
                             "with thousands of threads in one interpreter the forced GIL "
                             "hand-offs every 5 ms dominate: 0.05 s brings the simulation closer")
    args = parser.parse_args()
    sys.setswitchinterval(args.switch_interval)
    print(f"GIL switch interval {sys.getswitchinterval():g} s", flush=True)
    results = []
    for n in [int(x) for x in args.agents.split(",")]:
        row: dict[str, Any] = {"agents": n}
        for peer in args.peers.split(","):
            secs = join_time(peer, n, args.limit)
            row[peer] = secs
            print(f"{peer:>18} x{n:<5} {'failed or >' + str(args.limit) if secs is None else f'{secs:.3f}'} s",
                  flush=True)
        if args.shutdown:
            secs = row["shutdown"] = shutdown_time(n, args.limit)
            print(f"{'shutdown':>18} x{n:<5} {'>' + str(args.limit) if secs is None else f'{secs:.3f}'} s",
                  flush=True)
        results.append(row)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
