"""Throughput of N forked client processes, one connection each, on a mixed workload."""

from __future__ import annotations

import random
from array import array

from measures import Sizes, pc, summarize
from peers import PEERS
from workers import run_workers, sleep_until

N_SHARED = 64
# The mixed workload: 40% get of a shared key, 20% set of an own key, 20% add to one of 16
# shared counters, 10% check of a shared key, 10% compare_set of an own key. Values 64 B.
MIX = (("get", 40), ("set", 20), ("add", 20), ("check", 10), ("compare_set", 10))
MIX_VALUE = b"m" * 64


def preload_mixed(store, prefix: str) -> None:
    for i in range(N_SHARED):
        store.set(f"{prefix}/shared/{i}", MIX_VALUE)


def _mixed_ops(store, prefix: str, wid: int, native: bool = False, timeout: float = 60.0):
    rng = random.Random(wid)
    seq = [name for name, weight in MIX for _ in range(weight)]
    rng.shuffle(seq)
    own = f"{prefix}/own/{wid}"
    store.set(own, MIX_VALUE)
    fns = []
    for i, name in enumerate(seq):
        shared = f"{prefix}/shared/{rng.randrange(N_SHARED)}"
        if name == "get" and native:
            fns.append(lambda k=shared: store.get(k, timeout))
        elif name == "get":
            fns.append(lambda k=shared: store.get(k))
        elif name == "set":
            fns.append(lambda: store.set(own, MIX_VALUE))
        elif name == "add":
            fns.append(lambda k=f"{prefix}/ctr/{i % 16}": store.add(k, 1))
        elif name == "check":
            fns.append(lambda k=[shared]: store.check(k))
        else:
            fns.append(lambda: store.compare_set(own, MIX_VALUE, MIX_VALUE))
    return fns


def _tput_worker(ready, peer_name, host, port, prefix, wid, seconds, cap, timeout):
    peer = PEERS[peer_name]
    store = peer.connect(host, port, timeout)
    fns = _mixed_ops(store, prefix, wid, peer.native_api, timeout)
    for fn in fns[:20]:  # warm-up
        fn()
    t_start = ready()
    sleep_until(t_start)
    end = t_start + int(seconds * 1e9)
    lat = array("q")
    count = 0
    i = 0
    n = len(fns)
    while True:
        t0 = pc()
        fns[i % n]()
        t1 = pc()
        if t1 > end:
            break
        count += 1
        i += 1
        if len(lat) < cap:
            lat.append(t1 - t0)
    return count, lat.tobytes()


def throughput_run(peer_name: str, srv, n_clients: int, sz: Sizes, prefix: str,
                   seconds: float) -> tuple:
    """n_clients forked processes, one connection each, the mixed workload for `seconds`.
    Returns (ops completed, seconds, latency samples)."""
    peer = PEERS[peer_name]
    store = peer.connect(srv.host, srv.port, sz.op_timeout)
    preload_mixed(store, prefix)
    cap = max(1000, 400_000 // n_clients)
    args = [(peer_name, srv.host, srv.port, prefix, w, seconds, cap, sz.op_timeout)
            for w in range(n_clients)]
    cpu = {}
    results = run_workers(_tput_worker, args, timeout=sz.op_timeout + 60 + seconds,
                          on_ready=lambda: cpu.update(start=srv.cpu_seconds()),
                          fresh=peer.fresh_children)
    cpu_used = srv.cpu_seconds() - cpu["start"]
    lat = array("q")
    for _, b in results:
        lat.frombytes(b)
    return sum(c for c, _ in results), seconds, lat, cpu_used


def throughput_summary(runs: list, n_clients: int) -> dict:
    ops = sum(r[0] for r in runs)
    seconds = sum(r[1] for r in runs)
    lat = array("q")
    for r in runs:
        lat.extend(r[2])
    st = summarize(lat)
    cpu = sum(r[3] for r in runs)
    st.update(clients=n_clients, ops=ops, seconds=seconds, ops_per_s=ops / seconds,
              server_cpu_s=cpu, server_cpu_us_per_op=cpu * 1e6 / max(1, ops))
    return st


def throughput(peer_name: str, srv, n_clients: int, sz: Sizes, prefix: str) -> dict:
    run = throughput_run(peer_name, srv, n_clients, sz, prefix, sz.tput_seconds)
    return throughput_summary([run], n_clients)
