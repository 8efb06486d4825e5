"""Rendezvous join time with the agents spread as real nodes are: N agents as threads of P
processes (default 4), on an external ``elasticstore-server``, each agent connecting from its
own loopback address (127.1.x.y, through the ``source_addr.c`` preload shim) and hosting the
round's worker store there when it is rank 0. The rendezvous defaults (``lease_ttl`` 5 s,
failover on), ``min = max = N``.

The figure is the time from the common start (every process's agents created, then told to
go at one moment) to the last agent holding its rank, over all processes. ``--one-address``
runs every agent from 127.0.0.1 (past 8,192 connections the server's per-address limit
refuses); ``--procs 1`` is the one-interpreter harness of ``rendezvous.py`` on an external
server.

    python benchmarks/rendezvous_spread.py [--agents 1024,2048,4096] [--procs 4] [--runs 3]
                                           [--one-address] [--limit SECONDS] [--json PATH]

``ELASTICSTORE_BENCH_PRELUDE`` (a script path) is run before each worker (e.g. one that puts
another checkout of elasticstore first on the path: a before/after in one session), and
``--server-bin`` names the server binary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # cbuild, procs


def _agent_addr(g: int) -> str:
    return f"127.1.{g // 200}.{g % 200 + 1}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- a worker process: agents [first, first + count) of a run of ``total`` ----------------------

def worker(args: argparse.Namespace) -> None:
    import ctypes

    if args.nice:
        os.nice(args.nice)

    from elasticstore.rendezvous.handler import ElasticRendezvousHandler
    from elasticstore.rendezvous.native import create_native_backend
    from elasticstore.rendezvous.settings import RendezvousSettings

    from elasticstore.rendezvous import executor
    from elasticstore.rendezvous import handler as handler_mod

    # Phases, as moments: the round record written (its decider), each agent seeing it.
    decided: list[float] = []
    seen: list[float] = []
    decide, await_round = executor.Decider.run, handler_mod.await_round

    deciding = threading.local()
    calls: list[tuple[float, float, str]] = []  # the decider's store calls: (start, secs, name)

    def decider_run(self: Any) -> Any:
        deciding.on = True
        try:
            state = decide(self)
        finally:
            deciding.on = False
        decided.append(time.monotonic())
        return state

    from elasticstore.rendezvous.backend import StoreBackend
    from elasticstore.rendezvous.native import NativeBackend

    def timed(cls: Any, name: str) -> None:
        fn = getattr(cls, name)

        def call(self: Any, *a: Any, **kw: Any) -> Any:
            if not getattr(deciding, "on", False):
                return fn(self, *a, **kw)
            t = time.monotonic()
            try:
                return fn(self, *a, **kw)
            finally:
                calls.append((t, time.monotonic() - t, name))

        setattr(cls, name, call)

    for name in ("get", "list", "cas", "create", "delete", "watch"):
        timed(StoreBackend, name)
    timed(NativeBackend, "revision")

    def awaited(*a: Any, **kw: Any) -> Any:
        state = await_round(*a, **kw)
        seen.append(time.monotonic())
        return state

    joins: list[float] = []  # each agent's join key written
    store_set = StoreBackend.set

    def set_key(self: Any, key: str, *a: Any, **kw: Any) -> None:
        store_set(self, key, *a, **kw)
        if "/join/" in key:
            joins.append(time.monotonic())

    StoreBackend.set = set_key  # type: ignore[method-assign]
    executor.Decider.run = decider_run  # type: ignore[method-assign]
    passes: list[float] = []  # each decider pass's start (reads the run's keys)
    form = executor.Decider._form

    def form_pass(self: Any) -> Any:
        passes.append(time.monotonic())
        return form(self)

    executor.Decider._form = form_pass  # type: ignore[method-assign]
    handler_mod.await_round = awaited
    source = ctypes.CDLL(None).es_bench_source if not args.one_address else None
    handlers: list[Any] = [None] * args.count
    ranks: list[int | None] = [None] * args.count
    done_at: list[float] = [0.0] * args.count
    errors: list[str] = []
    lock = threading.Lock()
    made = threading.Semaphore(0)
    go = threading.Event()
    setup = threading.Semaphore(64)  # handlers made at once (the set-up is not measured)

    def agent(i: int) -> None:
        g = args.first + i
        addr = "127.0.0.1" if source is None else _agent_addr(g)
        try:
            if source is not None:
                source(addr.encode())
            settings = RendezvousSettings(run_id=args.run_id, host="127.0.0.1", port=args.port,
                                          min_nodes=args.total, max_nodes=args.total,
                                          local_addr=addr)
            with setup:
                handlers[i] = ElasticRendezvousHandler(create_native_backend(settings), settings)
        except BaseException as exc:
            with lock:
                errors.append(f"set-up: {exc!r}")
            made.release()
            return
        made.release()
        go.wait()
        try:
            info = handlers[i].next_rendezvous()
            ranks[i], done_at[i] = info.rank, time.monotonic()
        except BaseException as exc:
            with lock:
                errors.append(repr(exc))

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(args.count)]
    for t in threads:
        t.start()
    for _ in threads:
        made.acquire()
    print(json.dumps({"ready": True, "errors": errors[:3]}), flush=True)
    if sys.stdin.readline().strip() != "go":
        os._exit(2)
    cpu_at_go = time.process_time()
    go.set()
    deadline = time.monotonic() + args.limit
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    print(json.dumps({
        "done": sum(r is not None for r in ranks), "ranks": [r for r in ranks if r is not None],
        "last": max(done_at), "errors": errors[:3], "nerrors": len(errors),
        "cpu": time.process_time(), "join_cpu": time.process_time() - cpu_at_go, "decided": decided, "seen": sorted(seen),
        "joined_last": max(joins, default=0.0), "passes": passes, "calls": calls,
    }), flush=True)
    sys.stdin.readline()  # until the parent has every result (rank 0's worker store lives here)
    os._exit(0)


# -- the parent -----------------------------------------------------------------------------------

def _server(binary: str, port: int, nice: int = 0) -> subprocess.Popen[bytes]:
    import elasticstore

    proc = subprocess.Popen(["nice", "-n", str(nice), binary, "--host", "127.0.0.1", "--port",
                             str(port)], start_new_session=True)
    if nice:
        # The server runs in a session of its own: with the kernel's autogroups on, its nice
        # value acts only within that session's group; the group's own nice sets its share
        # against the agents' processes (sched(7)). Best effort (a negative one needs root).
        try:
            with open(f"/proc/{proc.pid}/autogroup", "w") as f:
                f.write(str(nice))
        except OSError:
            pass
    deadline = time.monotonic() + 20
    while True:
        try:
            elasticstore.Store("127.0.0.1", port).close()
            return proc
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"{binary} did not start on port {port}") from None
            time.sleep(0.1)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_stats(port: int) -> dict[str, int]:
    import elasticstore

    with elasticstore.Store("127.0.0.1", port) as st:
        return st.stats()


def join_time(n: int, procs: int, one_address: bool, limit: float, binary: str,
              nice: int = 0, server_nice: int = 0) -> dict[str, Any]:
    """One run: the seconds from the common start to the last agent's rank (None when some
    agent failed or did not finish within ``limit``), and what was seen."""
    port = _free_port()
    server = _server(binary, port, server_nice)
    env = dict(os.environ)
    if not one_address:
        import cbuild

        shim = cbuild.build("source_addr.c", "source_addr.so",
                            [os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-ldl"])
        env["LD_PRELOAD"] = ":".join(x for x in (shim, env.get("LD_PRELOAD")) if x)
    prelude = [p] if (p := os.environ.get("ELASTICSTORE_BENCH_PRELUDE")) else []
    run_id = f"spread{time.monotonic_ns()}"
    workers: list[subprocess.Popen[str]] = []
    row: dict[str, Any] = {"agents": n, "procs": procs, "one_address": one_address, "nice": nice,
                           "server_nice": server_nice,
                           "load_before": os.getloadavg()[0]}
    try:
        for i in range(procs):
            first, last = n * i // procs, n * (i + 1) // procs
            cmd = [sys.executable, *prelude, os.path.abspath(__file__), "--worker",
                   "--first", str(first), "--count", str(last - first), "--total", str(n),
                   "--port", str(port), "--run-id", run_id, "--limit", str(limit)]
            if one_address:
                cmd.append("--one-address")
            if nice:
                cmd += ["--nice", str(nice)]
            workers.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            text=True, env=env, start_new_session=True))
        for w in workers:
            assert w.stdout is not None
            ready = json.loads(w.stdout.readline() or '{"ready": false}')
            if not ready.get("ready") or ready.get("errors"):
                row.update(seconds=None, error=f"set-up: {ready}")
                return row
        before = _server_stats(port)
        row["connections"] = before.get("connections")
        row["loop_slowest_pass_ms_before_go"] = before.get("loop_slowest_pass_ms")
        server_cpu = _cpu_seconds(server.pid)
        t0 = time.monotonic()
        for w in workers:
            assert w.stdin is not None
            w.stdin.write("go\n")
            w.stdin.flush()
        results = []
        for w in workers:
            assert w.stdout is not None
            results.append(json.loads(w.stdout.readline() or "{}"))
        row["server_cpu"] = round(_cpu_seconds(server.pid) - server_cpu, 2)
        done = sum(r.get("done", 0) for r in results)
        ranks = sorted(x for r in results for x in r.get("ranks", []))
        errors = [e for r in results for e in r.get("errors", [])]
        ok = done == n and ranks == list(range(n)) and not errors
        row.update(seconds=max(r["last"] for r in results) - t0 if ok else None, done=done,
                   errors=errors[:3], nerrors=sum(r.get("nerrors", 0) for r in results),
                   worker_cpu=round(sum(r.get("cpu", 0.0) for r in results), 2),
                   join_cpu=round(sum(r.get("join_cpu", 0.0) for r in results), 2),
                   load_after=os.getloadavg()[0])
        seen = sorted(x for r in results for x in r.get("seen", []))
        decided = [x for r in results for x in r.get("decided", [])]
        if any(r.get("joined_last") for r in results):
            row["joined_last"] = round(max(r.get("joined_last", 0.0) for r in results) - t0, 3)
        calls = [c for r in results for c in r.get("calls", [])]
        if calls:
            row["decider_calls"] = len(calls)
            row["decider_slowest"] = [(round(t - t0, 3), round(d, 3), n) for t, d, n in
                                      sorted(calls, key=lambda c: -c[1])[:6]]
        passes = [x for r in results for x in r.get("passes", [])]
        if passes:
            row["decider_passes"] = [round(x - t0, 3) for x in passes][:40]
        if decided:
            row["round_written"] = round(min(decided) - t0, 3)
        if seen:
            row["round_seen_median"] = round(seen[len(seen) // 2] - t0, 3)
            row["round_seen_last"] = round(seen[-1] - t0, 3)
        stats = _server_stats(port)
        row.update(revision=stats.get("revision"), history_events=stats.get("history_events"))
        row["server_counters"] = {k: v for k, v in stats.items()
                                  if k.startswith(("connections_", "loop_")) and v}
        return row
    finally:
        for w in workers:
            try:
                os.killpg(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            w.wait()
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", default="1024,2048,4096")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one-address", action="store_true")
    parser.add_argument("--limit", type=float, default=100.0)
    parser.add_argument("--server-bin", default=shutil.which("elasticstore-server")
                        or os.path.join(os.path.dirname(sys.executable), "elasticstore-server"))
    parser.add_argument("--nice", type=int, default=0,
                        help="the agent processes' niceness: the server (one thread, as on its own "
                             "core in a job) is not starved by thousands of agent threads")
    parser.add_argument("--server-nice", type=int, default=0,
                        help="the server's niceness (negative: root). On its own host in a job, "
                             "the server is not one process among thousands of agent threads on "
                             "two cores, where a nice of the agents alone does not keep it running")
    parser.add_argument("--json", help="append each run's row (JSON lines) to this file")
    parser.add_argument("--label", default="", help="a label stored with each row")
    # a worker's own arguments
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--first", "--count", "--total", "--port"):
        parser.add_argument(name, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    # SIGTERM (a timeout's) ends the run through its clean-up: the server and agents stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for n in [int(x) for x in args.agents.split(",")]:
        for _ in range(args.runs):
            row = join_time(n, args.procs, args.one_address, args.limit, args.server_bin,
                            args.nice, args.server_nice)
            row["label"] = args.label
            secs = row.get("seconds")
            print(f"{args.label} x{n} procs {args.procs}"
                  f"{' one address' if args.one_address else ''}"
                  f"{f' nice {args.nice}' if args.nice else ''}"
                  f"{f' server nice {args.server_nice}' if args.server_nice else ''}: "
                  f"{'failed or >' + str(args.limit) if secs is None else f'{secs:.3f}'} s "
                  f"(load {row['load_before']:.1f} -> {row.get('load_after', 0):.1f}) "
                  f"{json.dumps({k: v for k, v in row.items() if k not in ('agents', 'procs', 'one_address', 'seconds', 'label', 'load_before', 'load_after')})}",
                  flush=True)
            if args.json:
                with open(args.json, "a") as out:
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
