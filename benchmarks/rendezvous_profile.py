"""Where the rendezvous join time goes: ``rendezvous.join_time`` with every backend call counted
and timed (per method, split between the round's decider and the other agents), and for etcd
the gRPC requests and watch streams opened. Optionally under cProfile.

    python benchmarks/rendezvous_profile.py --peer elasticstore-etcd --agents 128
    python benchmarks/rendezvous_profile.py --peer elasticstore --agents 1024 --cprofile 30

Counts are of the calls made inside ``next_rendezvous`` (set-up, shutdown and the background
threads are left out); times are summed over threads, so they exceed the wall time when agents
wait in parallel.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import functools
import os
import pstats
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rendezvous  # noqa: E402

_lock = threading.Lock()
_calls: collections.Counter[str] = collections.Counter()
_secs: collections.Counter[str] = collections.Counter()
_role = threading.local()
_window: list[float] = []  # wall and CPU at the first join call, then at the last return
_server_cpu: list[float] = []  # the etcd member's CPU seconds, read before it is stopped


def _count(name: str, secs: float) -> None:
    if not getattr(_role, "joining", False):
        return  # set-up, shutdown, ring watchers, lease keep-alive: not the join
    role = "decider" if getattr(_role, "decider", False) else "agent"
    with _lock:
        _calls[f"{role} {name}"] += 1
        _secs[f"{role} {name}"] += secs


def _wrap(cls: Any, name: str, label: str) -> None:
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _count(label, time.perf_counter() - t0)

    setattr(cls, name, timed)


def instrument(peer: str) -> None:
    from elasticstore.rendezvous import backend, executor

    from elasticstore.rendezvous import handler, native

    for name in ("get", "set", "create", "cas", "delete", "list", "watch"):
        _wrap(backend.StoreBackend, name, f"backend.{name}")
    _wrap(native.NativeBackend, "revision", "backend.revision")
    store_cls = handler.Store

    def worker_store(*args: Any, **kwargs: Any) -> Any:  # the round's store, in _enter
        t0 = time.perf_counter()
        try:
            return store_cls(*args, **kwargs)
        finally:
            _count("connect worker store", time.perf_counter() - t0)

    handler.Store = worker_store  # type: ignore[misc,assignment]
    join = handler.ElasticRendezvousHandler.next_rendezvous

    def joining(self: Any) -> Any:
        with _lock:
            if not _window:
                _window.extend([time.perf_counter(), time.process_time()] * 2)
        _role.joining = True
        try:
            return join(self)
        finally:
            _role.joining = False
            with _lock:
                _window[2:] = [time.perf_counter(), time.process_time()]

    handler.ElasticRendezvousHandler.next_rendezvous = joining  # type: ignore[method-assign]
    run = executor.Decider.run

    def decider_run(self: Any) -> Any:
        _role.decider = True
        try:
            return run(self)
        finally:
            _role.decider = False

    executor.Decider.run = decider_run  # type: ignore[method-assign]
    if peer == "elasticstore-etcd":
        import etcd_peer
        from elasticstore.stores.etcd import client as etcd_client

        start_server = etcd_peer.start_server

        def started(*a: Any, **kw: Any) -> Any:
            srv = start_server(*a, **kw)
            close = srv.close

            def closed() -> None:
                _server_cpu.append(srv.cpu_seconds())
                close()

            srv.close = closed
            return srv

        etcd_peer.start_server = started

        conn = etcd_client.Connection
        call = conn.call

        def counted_call(self: Any, fn: Any, deadline: Any, what: str, *a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(self, fn, deadline, what, *a)
            finally:
                _count(f"grpc {what}", time.perf_counter() - t0)

        conn.call = counted_call  # type: ignore[method-assign]
        _wrap(conn, "watch_stream", "grpc watch stream opened")


def _where_threads_are(top: int = 12) -> None:
    """Where the threads still running are (innermost two frames), most common first."""
    places: collections.Counter[str] = collections.Counter()
    for frame in sys._current_frames().values():
        names = []
        while frame is not None and len(names) < 2:
            names.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} "
                         f"{frame.f_code.co_name}")
            frame = frame.f_back
        places[" <- ".join(names)] += 1
    for place, n in places.most_common(top):
        print(f"  {n:>5} threads at {place}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", default="elasticstore-etcd", choices=rendezvous.PEERS[:2])
    parser.add_argument("--agents", type=int, default=128)
    parser.add_argument("--limit", type=float, default=120.0)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also profile (all threads) and print the N top functions")
    args = parser.parse_args()
    instrument(args.peer)
    prof = cProfile.Profile() if args.cprofile else None
    if prof is not None:
        prof.enable()
        # cProfile follows one thread only: profile the others with their own profilers.
        profs: list[cProfile.Profile] = []
        start = threading.Thread.run

        def run(self: threading.Thread) -> None:
            p = cProfile.Profile()
            with _lock:
                profs.append(p)
            p.enable()
            try:
                start(self)
            finally:
                p.disable()

        threading.Thread.run = run  # type: ignore[method-assign]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    secs = rendezvous.join_time(args.peer, args.agents, args.limit)
    if secs is None:
        _where_threads_are()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if prof is not None:
        prof.disable()
    print(f"{args.peer} x{args.agents}: {'failed' if secs is None else f'{secs:.3f} s'}; "
          f"set-up + join + shutdown {wall:.2f} s wall, this process {cpu:.2f} s CPU"
          + (f", etcd {_server_cpu[0]:.2f} s CPU" if _server_cpu else ""))
    if _window:
        print(f"  join window: {_window[2] - _window[0]:.2f} s wall, this process "
              f"{_window[3] - _window[1]:.2f} s CPU ({os.cpu_count()} cores)")
    for name in sorted(_calls):
        n = _calls[name]
        print(f"  {name:<40} {n:>8}  {n / args.agents:8.2f}/agent  {_secs[name]:9.3f} s")
    if prof is not None:
        stats = pstats.Stats(prof)
        for p in profs:
            try:
                stats.add(p)
            except TypeError:  # a profiler that saw no call
                pass
        stats.sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
