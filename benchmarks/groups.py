"""Connect storm and barrier: many clients (threads in forked processes) pass barriers."""

from __future__ import annotations

import threading
import time

from measures import Sizes, pc
from peers import PEERS
from workers import run_workers, sleep_until


def _group_worker(ready, peer_name, host, port, key, n_total, n_here, kind, rounds, preconnect,
                  timeout):
    """n_here threads; each connects (before the start when preconnect) and passes `rounds`
    barriers of n_total participants. Returns, per round, the latest release time here."""
    peer = PEERS[peer_name]
    barrier = peer.barriers[kind]
    threading.stack_size(512 * 1024)
    stores = [None] * n_here
    if preconnect:
        for j in range(n_here):
            stores[j] = peer.connect(host, port, timeout)
    go = threading.Event()
    done = [[0] * rounds for _ in range(n_here)]
    errors = []

    def run(j):
        try:
            go.wait()
            if stores[j] is None:
                stores[j] = peer.connect(host, port, timeout)
            for rnd in range(rounds):
                barrier(stores[j], f"{key}/{rnd}", n_total, timeout)
                done[j][rnd] = pc()
        except Exception as e:  # reported, and the run fails
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(n_here)]
    for t in threads:
        t.start()
    t_start = ready()
    sleep_until(t_start)
    go.set()
    deadline = time.monotonic() + timeout * (rounds + 1)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"{len(errors)} clients failed, first: {errors[:1]}")
    return t_start, [max(done[j][r] for j in range(n_here)) for r in range(rounds)]


def group(peer_name: str, srv, n: int, kind: str, rounds: int, preconnect: bool, sz: Sizes,
          key: str) -> dict:
    """Seconds from the common start until the last of n clients passed `rounds` barriers, and
    the server's CPU time meanwhile (from all clients ready to all results in)."""
    procs = max(1, min(sz.max_procs, -(-n // sz.threads_per_proc)))
    per = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    args = [(peer_name, srv.host, srv.port, key, n, k, kind, rounds, preconnect, sz.op_timeout)
            for k in per]
    cpu = {}
    results = run_workers(_group_worker, args, timeout=sz.op_timeout * (rounds + 2) + 60,
                          on_ready=lambda: cpu.update(start=srv.cpu_seconds()),
                          fresh=PEERS[peer_name].fresh_children)
    cpu_used = srv.cpu_seconds() - cpu["start"]
    t_start = results[0][0]
    return {"seconds": (max(r[1][-1] for r in results) - t_start) / 1e9,
            "server_cpu_s": cpu_used, "clients": n, "procs": procs}


def connect_storm(peer_name, srv, n, kind, sz, key) -> dict:
    return group(peer_name, srv, n, kind, 1, False, sz, key)


def barrier_time(peer_name, srv, n, kind, sz, key) -> dict:
    """Mean seconds (and server CPU) per barrier over barrier_rounds consecutive barriers of
    connected clients."""
    r = group(peer_name, srv, n, kind, sz.barrier_rounds, True, sz, key)
    r["seconds"] /= sz.barrier_rounds
    r["server_cpu_s"] /= sz.barrier_rounds
    return r


def median_point(points: list) -> dict:
    """The point of median wall time among rounds (its server CPU with it), and every round's
    seconds under "rounds_s"."""
    ordered = sorted(points, key=lambda p: p["seconds"])
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid["rounds_s"] = [p["seconds"] for p in points]
    return mid
