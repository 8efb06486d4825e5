"""The measurements, shared by report.py and the pytest suites (written once, here).

Every loop is bounded in count and in time. Client processes are forked from the measuring
process after torch and elasticstore are imported, so their pages are shared copy-on-write and a
child costs a few MiB, not the ~200 MB of a fresh torch import; every peer's clients are run the
same way. Timing uses time.perf_counter_ns (CLOCK_MONOTONIC: comparable across processes).
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from dataclasses import dataclass

import peers
from peers import PEERS
from workers import ChildFailed, _read_exact, fork_child, reap, run_workers, sleep_until

pc = time.perf_counter_ns
VALUE = b"v" * 32  # the value of the latency ops


@dataclass(frozen=True)
class Sizes:
    """Counts and time bounds of one run."""

    lat_iters: int = 5000
    lat_warmup: int = 500
    lat_max_s: float = 8.0
    wake_iters: int = 300
    pingpong_iters: int = 20000
    tput_clients: tuple = (1, 8, 64, 256)
    tput_seconds: float = 4.0
    storm_clients: tuple = (256, 1024, 4096)
    barrier_sizes: tuple = (64, 1024)
    barrier_rounds: int = 5
    idle_conns: int = 4096
    mem_keys: int = 100_000
    mem_value_bytes: int = 1024
    op_timeout: float = 120.0  # per store operation, seconds
    threads_per_proc: int = 256  # storm/barrier clients are threads in forked processes
    max_procs: int = 8
    fresh_server_per_point: bool = True  # storm/barrier: a new server process per point


FULL = Sizes()
QUICK = Sizes(
    lat_iters=200, lat_warmup=20, lat_max_s=1.0, wake_iters=20, pingpong_iters=2000,
    tput_clients=(1, 8), tput_seconds=0.5, storm_clients=(32,), barrier_sizes=(16,),
    barrier_rounds=2, idle_conns=16, mem_keys=1000, op_timeout=30.0, threads_per_proc=16,
    max_procs=2, fresh_server_per_point=False,
)


def summarize(samples) -> dict:
    s = sorted(samples)
    n = len(s)
    if n == 0:
        return {"n": 0}

    def pct(p):
        return s[min(n - 1, int(p * (n - 1) + 0.5))]

    return {"n": n, "p50_ns": pct(0.50), "p99_ns": pct(0.99), "mean_ns": sum(s) / n}


# ------------------------------------------------------------------------------- ping-pong


def _build(src_name: str, out_name: str, argv: list) -> str:
    """Compiles benchmarks/<src_name> once into a per-user temp dir (rebuilt when newer)."""
    src = os.path.join(peers.HERE, src_name)
    out_dir = os.path.join(tempfile.gettempdir(), f"elasticstore-bench-{os.getuid()}")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, out_name)
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(src):
        subprocess.run(argv + ["-o", out + ".tmp", src], check=True, timeout=300)
        os.replace(out + ".tmp", out)
    return out


def pingpong_binary() -> str:
    """tcp_pingpong: $ELASTICSTORE_TCP_PINGPONG, else compiled once into a temp dir."""
    env = os.environ.get("ELASTICSTORE_TCP_PINGPONG")
    if env:
        return env
    cxx = os.environ.get("CXX", "c++")
    return _build("tcp_pingpong.cpp", "tcp_pingpong", [cxx, "-O2", "-std=c++17", "-pthread"])


def no_rdns_shim() -> str:
    """no_rdns.so (see no_rdns.c), for LD_PRELOAD."""
    cc = os.environ.get("CC", "cc")
    return _build("no_rdns.c", "no_rdns.so", [cc, "-O2", "-shared", "-fPIC", "-ldl"])


def reexec_without_rdns(argv: list) -> None:
    """Re-executes this process (argv) with the no_rdns shim preloaded, once."""
    if os.environ.get("ELASTICSTORE_BENCH_NO_RDNS") == "1":
        return
    shim = no_rdns_shim()
    env = dict(os.environ, ELASTICSTORE_BENCH_NO_RDNS="1")
    env["LD_PRELOAD"] = ":".join(x for x in (shim, env.get("LD_PRELOAD")) if x)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + argv, env)


def rdns_mode() -> str:
    return "shimmed" if os.environ.get("ELASTICSTORE_BENCH_NO_RDNS") == "1" else "real"


def pingpong_once(iters: int, warmup: int, size: int, max_seconds: float, cpu=None) -> dict:
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    out = subprocess.run(
        [pingpong_binary(), "bench", "--iters", str(iters), "--warmup", str(warmup),
         "--size", str(size), "--max-seconds", str(max_seconds)],
        check=True, capture_output=True, timeout=max_seconds + 60, preexec_fn=pin,
    )
    return json.loads(out.stdout)


def pingpong(iters: int, warmup: int, size: int = 32, max_seconds: float = 10.0) -> dict:
    """Raw TCP round trip on loopback, echo server in its own process: once with both processes
    free to run on any CPU (as the stores are measured), once with both pinned to one CPU (on
    VMs a cross-CPU wake-up can cost tens of microseconds). The floor is the lower p50."""
    free = pingpong_once(iters, warmup, size, max_seconds)
    out = {"free": free}
    if len(os.sched_getaffinity(0)) > 1:
        out["one_cpu"] = pingpong_once(iters, warmup, size, max_seconds, cpu=min(os.sched_getaffinity(0)))
    floor = min(out.values(), key=lambda r: r["p50_ns"])
    out.update({k: floor[k] for k in ("size", "iters", "p50_ns", "p99_ns", "mean_ns")})
    out["floor_from"] = "one_cpu" if floor is out.get("one_cpu") else "free"
    return out


# ----------------------------------------------------------------------- latency, one client

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
    pid, r = fork_child(_waiter, peer_name, host, port, prefix, iters, sz.op_timeout)
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


def op_latencies(servers: dict, sz: Sizes, rounds: int = 4, prefix: str = "lat") -> dict:
    """p50/p99/mean of every op of every peer (name -> server), one client, one connection
    each. The peers take turns: each op runs in `rounds` slices, in rotating peer order, so
    that noise from other work on the machine falls on every peer alike."""
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


# ---------------------------------------------------------------- throughput, mixed workload

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
                          on_ready=lambda: cpu.update(start=srv.cpu_seconds()))
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


# ------------------------------------------------------------- connect storm and barriers


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
                          on_ready=lambda: cpu.update(start=srv.cpu_seconds()))
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


# -------------------------------------------------------------------------------- memory


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


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    u = os.uname()
    import resource

    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "kernel": f"{u.sysname} {u.release}",
        "python": sys.version.split()[0],
        "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def fd_room(n_clients: int, sz: Sizes) -> str | None:
    """Why n_clients connections cannot be made here, or None. The server holds n fds; each
    client process holds n/procs (+ inherited ones)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if n_clients + 256 > soft:
        return f"fd limit {soft} < {n_clients} connections + 256"
    return None
