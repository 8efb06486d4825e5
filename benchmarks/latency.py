"""Latency per operation from one Python client on one connection, and wait wake-up time."""

from __future__ import annotations

import os
import struct
import time

from measures import VALUE, Sizes, pc, summarize
from peers import PEERS
from procs import pin_threads
from workers import ChildFailed, _read_exact, fork_child, reap

OPS = ("set", "get", "try_get", "add", "compare_set", "check", "multi_get", "wait")


def make_op(store, op: str, prefix: str, native: bool = False, timeout: float = 60.0):
    """A zero-argument callable doing one `op` on `store` (keys prepared here). `native`: the
    store is a _C.Client, whose get/multi_get take a timeout."""
    k = f"{prefix}/{op}"
    T = timeout
    if op == "set":
        return lambda: store.set(k, VALUE)
    if op in ("get", "try_get", "check"):
        store.set(k, VALUE)
        if op == "get":
            return (lambda: store.get(k, T)) if native else (lambda: store.get(k))
        if op == "try_get":
            return lambda: store.try_get(k)
        keys = [k]
        return lambda: store.check(keys)
    if op == "add":
        return lambda: store.add(k, 1)
    if op == "compare_set":
        store.set(k, VALUE)
        return lambda: store.compare_set(k, VALUE, VALUE)  # always swaps (same value)
    if op == "multi_get":
        keys = [f"{k}/{i}" for i in range(16)]
        for key in keys:
            store.set(key, VALUE)
        return (lambda: store.multi_get(keys, T)) if native else (lambda: store.multi_get(keys))
    raise ValueError(op)


def latency_samples(fn, iters: int, warmup: int, max_seconds: float) -> list:
    for _ in range(warmup):
        fn()
    samples = []
    deadline = pc() + int(max_seconds * 1e9)
    for _ in range(iters):
        t0 = pc()
        fn()
        t1 = pc()
        samples.append(t1 - t0)
        if t1 > deadline:
            break
    return samples


def latency(fn, iters: int, warmup: int, max_seconds: float) -> dict:
    return summarize(latency_samples(fn, iters, warmup, max_seconds))


def _waiter(w, peer_name, host, port, prefix, iters, timeout):
    peer = PEERS[peer_name]
    store = peer.connect(host, port, timeout)
    for i in range(iters):
        os.write(w, b"r")
        if peer.native_api:
            store.wait([f"{prefix}/wake/{i}"], timeout)
        else:
            store.wait([f"{prefix}/wake/{i}"])
        os.write(w, struct.pack("<q", pc()))


def wait_wakeup_samples(peer_name: str, store, host: str, port: int, prefix: str, sz: Sizes,
                        iters: int, max_seconds: float) -> list:
    """From `store.set(key)` in this process to `wait([key])` returning in another process
    (a forked waiter on its own connection); the waiter blocks ~3 ms before each set."""
    pid, r = fork_child(_waiter, peer_name, host, port, prefix, iters, sz.op_timeout,
                        fresh=PEERS[peer_name].fresh_children)
    samples = []
    try:
        deadline = time.monotonic() + sz.op_timeout + iters * 0.1
        stop = pc() + int(max(max_seconds, 0.5) * 1e9)
        for i in range(iters):
            tag = _read_exact(r, 1, deadline)
            if tag == b"E":
                _recv_rest_error(r, deadline)
            time.sleep(0.003)
            t0 = pc()
            store.set(f"{prefix}/wake/{i}", VALUE)
            (t1,) = struct.unpack("<q", _read_exact(r, 8, deadline))
            samples.append(t1 - t0)
            if pc() > stop and len(samples) >= 5:
                break
    finally:
        os.close(r)
        reap(pid, kill=True)
    return samples


def wait_wakeup(peer_name: str, store, host: str, port: int, prefix: str, sz: Sizes) -> dict:
    return summarize(wait_wakeup_samples(peer_name, store, host, port, prefix, sz,
                                         sz.wake_iters, sz.lat_max_s))


def _recv_rest_error(r, deadline):
    (n,) = struct.unpack("<I", _read_exact(r, 4, deadline))
    raise ChildFailed(_read_exact(r, n, deadline).decode(errors="replace"))


# Latency runs with the measuring process, its forked clients and every server on one CPU. A
# loopback round trip whose two ends sit on different CPUs pays a cross-CPU wake-up, and on a
# VM that cost is large and shifts with the host (15 us to 75 us for the same ping-pong here),
# so unpinned samples mix two states at random; pinned, every peer is measured in the same one
# (like the ping-pong's one-CPU mode). Throughput and the storms stay unpinned.
LATENCY_CPU = 0


def op_latencies(servers: dict, sz: Sizes, rounds: int = 4, prefix: str = "lat") -> dict:
    """p50/p99/mean of every op of every peer (name -> server), one client, one connection
    each, all on LATENCY_CPU. The peers take turns: each op runs in `rounds` slices, in
    rotating peer order, so that noise from other work on the machine falls on every peer
    alike."""
    before = os.sched_getaffinity(0)
    try:
        for srv in servers.values():
            pin_threads(srv.pid, {LATENCY_CPU})
        pin_threads(os.getpid(), {LATENCY_CPU})
        return _op_latencies(servers, sz, rounds, prefix)
    finally:
        pin_threads(os.getpid(), before)


def _op_latencies(servers: dict, sz: Sizes, rounds: int, prefix: str) -> dict:
    stores = {n: PEERS[n].connect(s.host, s.port, sz.op_timeout) for n, s in servers.items()}
    out = {n: {} for n in servers}
    for op in OPS:
        names = [n for n in servers if op in PEERS[n].ops]
        if not names:
            continue
        fns = {}
        if op != "wait":
            fns = {n: make_op(stores[n], op, prefix, PEERS[n].native_api, sz.op_timeout)
                   for n in names}
        samples = {n: [] for n in names}
        for rnd in range(rounds):
            k = rnd % len(names)
            for n in names[k:] + names[:k]:
                if op == "wait":
                    srv = servers[n]
                    samples[n] += wait_wakeup_samples(
                        n, stores[n], srv.host, srv.port, f"{prefix}/{rnd}", sz,
                        -(-sz.wake_iters // rounds), sz.lat_max_s / rounds)
                else:
                    samples[n] += latency_samples(
                        fns[n], -(-sz.lat_iters // rounds),
                        sz.lat_warmup if rnd == 0 else sz.lat_warmup // 5, sz.lat_max_s / rounds)
        for n in names:
            out[n][op] = summarize(samples[n])
    return out
