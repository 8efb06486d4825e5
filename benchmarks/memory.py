"""Server memory: RSS of the server process idle, with idle connections, with many keys."""

from __future__ import annotations

import threading
import time

from measures import VALUE, Sizes
from peers import PEERS
from workers import run_workers


def _holder(ready, peer_name, host, port, n, timeout):
    """Opens n idle connections (from up to 64 threads: torch's client does a reverse DNS
    lookup per connect, which can stall), holds them until the parent has measured."""
    peer = PEERS[peer_name]
    conns = []
    lock = threading.Lock()
    errors = []
    n_threads = max(1, min(64, n))

    def opener(k):
        try:
            for _ in range(k):
                c = peer.connect(host, port, timeout)
                with lock:
                    conns.append(c)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")

    threading.stack_size(512 * 1024)
    ths = [threading.Thread(target=opener, args=(n // n_threads + (i < n % n_threads),))
           for i in range(n_threads)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout * 4)
    if errors or len(conns) != n:
        raise RuntimeError(f"{len(conns)}/{n} connections; first error: {errors[:1]}")
    ready()
    return len(conns)


def memory(peer_name: str, sz: Sizes) -> dict:
    """Server RSS: idle, with idle_conns idle connections, with mem_keys keys of mem_value_bytes.
    Uses the peer's torch-free server host when it has one (else its normal server)."""
    peer = PEERS[peer_name]
    start = peer.start_light_server or peer.start_server
    out = {}
    srv = start()
    try:
        out["server"] = srv.what
        store = peer.connect(srv.host, srv.port, sz.op_timeout)
        store.set("mem/warm", VALUE)
        out["idle_bytes"] = srv.rss()
        procs = max(1, min(sz.max_procs, -(-sz.idle_conns // 1024)))
        per = [sz.idle_conns // procs + (1 if i < sz.idle_conns % procs else 0)
               for i in range(procs)]
        seen = {}
        run_workers(
            _holder, [(peer_name, srv.host, srv.port, k, sz.op_timeout) for k in per],
            timeout=sz.op_timeout + 120, on_ready=lambda: seen.update(rss=_settled_rss(srv)),
            fresh=peer.fresh_children,
        )
        out["conns"] = sz.idle_conns
        out["conns_bytes"] = seen["rss"]
    finally:
        srv.close()
    srv = start()
    try:
        store = peer.connect(srv.host, srv.port, sz.op_timeout)
        store.set("mem/warm", VALUE)
        base = srv.rss()
        value = b"k" * sz.mem_value_bytes
        batch = 100
        for i in range(0, sz.mem_keys, batch):
            keys = [f"mem/key/{j:08d}" for j in range(i, min(sz.mem_keys, i + batch))]
            store.multi_set(keys, [value] * len(keys))
        if store.num_keys() < sz.mem_keys:
            raise RuntimeError(f"only {store.num_keys()} keys stored")
        out["keys"] = sz.mem_keys
        out["keys_bytes"] = _settled_rss(srv)
        out["keys_idle_bytes"] = base
    finally:
        srv.close()
    return out


def _settled_rss(srv) -> int:
    time.sleep(0.3)
    return srv.rss()
