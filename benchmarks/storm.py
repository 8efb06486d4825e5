"""The worker store's connection storm: N clients connect at once and pass one store barrier.

    python benchmarks/storm.py [--sizes 4096,16384] [--runs 3] [--peers ...] [--somaxconn N]
                               [--out benchmarks/results/storm] [--no-netns]

Every client is driven by one C load generator (`storm.c`, one epoll thread, non-blocking
connects from 127.0.0.2-9), speaking its peer's protocol byte for byte: connect, handshake, ADD a
counter, the last one SETs a key, everyone WAITs on it. Each run gets a fresh server; peers take
turns in rotating order. The run happens in a private network namespace (`unshare -n`, as root),
so that the kernel's counters (`ListenOverflows`, `ListenDrops`, `TCPTimeouts`, ...) are this
run's alone and `--somaxconn` changes nothing outside it; the process raises its open-file limit
(soft to hard) before starting servers, which inherit it. After each storm the clients stay
connected, idle, while the server's RSS is read: its memory per idle connection.

Results: OUT.json and OUT.md (the machine named, each run's figures, the medians and the ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Callable

import cbuild
import machine
import peers
import procs
from procs import ServerProc

NETNS_FLAG = "ELASTICSTORE_STORM_NETNS"
CLIENT_TIMEOUT_S = 60  # one storm; the whole run stays bounded
COUNTERS = ("TcpExtListenOverflows", "TcpExtListenDrops", "TcpExtTCPTimeouts", "TcpExtTCPSynRetrans",
            "TcpRetransSegs", "TcpExtTCPReqQFullDrop", "TcpExtSyncookiesSent", "TcpEstabResets")


def storm_binary() -> str:
    cc = os.environ.get("CC", "cc")
    return cbuild.build("storm.c", "storm", [cc, "-O2", "-Wall", "-Wextra", "-Werror", "-std=c11"])


def start_echo() -> ServerProc:
    return procs.start_server_process([storm_binary(), "echo", "--host", procs.HOST, "--port", "0"],
                                      "storm echo")


def start_ours() -> ServerProc:
    binary = peers.native_server_binary()
    if not binary:
        raise SystemExit("storm: elasticstore-server is not installed next to this Python")
    return procs.start_server_process([binary, "--host", procs.HOST, "--port", "0"], "elasticstore-server")


def server_at(binary: str, what: str) -> Callable[[], ServerProc]:
    return lambda: procs.start_server_process([binary, "--host", procs.HOST, "--port", "0"], what)


# name -> (server, protocol the clients speak, what it is)
PEERS: dict[str, tuple[Callable[[], ServerProc], str, str]] = {
    "elasticstore": (start_ours, "native", "elasticstore-server, native protocol (HELLO)"),
    "elasticstore/torch-protocol": (start_ours, "torch", "elasticstore-server, torch's TCPStore protocol"),
    "tcpstore": (peers.start_tcpstore_server, "torch",
                 "TCPStore(is_master=True, use_libuv=True) in a subprocess, torch's protocol"),
    "echo": (start_echo, "echo", "storm.c's echo server: connect + one 32 B round trip, no store"),
}


def kernel_counters() -> dict[str, int]:
    """The TCP counters of this network namespace (/proc/net/netstat and snmp, as nstat reads)."""
    out: dict[str, int] = {}
    for path in ("/proc/net/netstat", "/proc/net/snmp"):
        with open(path) as f:
            lines = f.read().splitlines()
        for head, vals in zip(lines[::2], lines[1::2]):
            prefix, names = head.split(":", 1)
            for n, v in zip(names.split(), vals.split(":", 1)[1].split()):
                out[prefix + n] = int(v)
    return {k: out.get(k, 0) for k in COUNTERS}


def sched_ms(pid: int) -> tuple[float, float]:
    """Milliseconds every thread of pid has run, and waited runnable for a CPU (schedstat)."""
    run = wait = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                a, b = f.read().split()[:2]
        except (FileNotFoundError, ProcessLookupError):
            continue
        run, wait = run + int(a), wait + int(b)
    return run / 1e6, wait / 1e6


def tcp_mem_pages() -> int:
    """Pages the kernel holds for TCP socket buffers in this namespace (/proc/net/sockstat)."""
    with open("/proc/net/sockstat") as f:
        for line in f:
            if line.startswith("TCP:"):
                fields = line.split()
                return int(fields[fields.index("mem") + 1])
    return 0


def enter_netns(argv: list[str]) -> None:
    """Re-executes this script in a private network namespace with loopback up (once)."""
    if os.environ.get(NETNS_FLAG) == "1":
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        return
    if os.geteuid() != 0:
        raise SystemExit("storm: a private network namespace needs root (or pass --no-netns)")
    env = dict(os.environ, **{NETNS_FLAG: "1"})
    sys.stdout.flush()
    os.execvpe("unshare", ["unshare", "-n", sys.executable, os.path.abspath(__file__)] + argv, env)


def raise_fd_limit(need: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < need:
        raise SystemExit(f"storm: open-file hard limit {hard} < {need} (clients + headroom)")
    return hard


SERVER_CPU, CLIENT_CPU = 1, 0  # --pin: each on its own CPU, as a server on its own host


def client_setup(pin: bool) -> Callable[[], None]:
    def setup() -> None:
        procs.set_pdeathsig()
        if pin:
            os.sched_setaffinity(0, {CLIENT_CPU})
    return setup


def one_run(peer: str, n: int, key: str, batch: int, pin: bool = False) -> dict:
    start, proto, _ = PEERS[peer]
    srv = start()
    try:
        time.sleep(0.2)
        if pin:
            procs.pin_threads(srv.pid, {SERVER_CPU})
        rss0, cpu0, k0, mem0 = srv.rss(), srv.cpu_seconds(), kernel_counters(), tcp_mem_pages()
        client = subprocess.Popen(
            [storm_binary(), "client", "--port", str(srv.port), "--clients", str(n), "--proto", proto,
             "--key", key, "--batch", str(batch), "--timeout-s", str(CLIENT_TIMEOUT_S), "--hold", "1"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            preexec_fn=client_setup(pin))
        try:
            assert client.stdout is not None and client.stdin is not None
            s0, c0 = sched_ms(srv.pid), sched_ms(client.pid)
            line = client.stdout.readline()
            k1, cpu1 = kernel_counters(), srv.cpu_seconds()
            s1, c1 = sched_ms(srv.pid), sched_ms(client.pid)
            time.sleep(0.3)  # replies sent, idle: what the server keeps per connection
            rss1, mem1 = srv.rss(), tcp_mem_pages()
            client.stdin.close()
            client.wait(CLIENT_TIMEOUT_S + 30)
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
        if not line:
            raise RuntimeError(f"storm client for {peer} printed nothing (exit {client.returncode})")
        r = json.loads(line)
        r.update(peer=peer, server_cpu_s=round(cpu1 - cpu0, 3), server_rss_idle=rss0,
                 server_rss_connected=rss1,
                 rss_per_connection=round((rss1 - rss0) / max(r["done"], 1)),
                 tcp_mem_pages_connected=mem1 - mem0,
                 # time runnable but waiting for a CPU, as a share of the run (server, generator)
                 server_runqueue_wait_ms=round(s1[1] - s0[1]), client_runqueue_wait_ms=round(c1[1] - c0[1]),
                 kernel={k: k1[k] - k0[k] for k in COUNTERS})
        return r
    finally:
        srv.close()


def summarize(runs: list[dict]) -> dict:
    times = [r["all_done_ms"] for r in runs]
    total = lambda k: sum(r[k] for r in runs)  # noqa: E731
    return {
        "runs": len(runs), "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
        "unfinished": total("unfinished") + total("failed"),
        "refused": total("refused"),
        "reset": total("reset_at_connect") + total("reset_in_handshake") + total("closed_in_handshake"),
        "retries": total("retries"),
        "kernel": {k: statistics.median(r["kernel"][k] for r in runs) for k in COUNTERS},
        "rss_per_connection": statistics.median(r["rss_per_connection"] for r in runs),
        "server_cpu_us_per_client": statistics.median(r["server_cpu_s"] / r["clients"] * 1e6 for r in runs),
        "client_cpu_s": statistics.median(r["client_cpu_s"] for r in runs),
        "tcp_mem_pages": statistics.median(r["tcp_mem_pages_connected"] for r in runs),
        "server_waiting": statistics.median(r.get("server_runqueue_wait_ms", 0) / r["all_done_ms"] for r in runs),
        "client_waiting": statistics.median(r.get("client_runqueue_wait_ms", 0) / r["all_done_ms"] for r in runs),
    }


def render(doc: dict) -> str:
    m = doc["machine"]
    lines = [
        f"# Connection storm (`benchmarks/storm.py`), {doc['date']}",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['kernel']}, {m['mem_gib']} GiB; "
        f"{doc['machine_note']}. Private network namespace: somaxconn {doc['somaxconn']}, "
        f"tcp_max_syn_backlog {doc['max_syn_backlog']}; open-file limit {doc['fd_limit']}; "
        f"nice {doc['nice']}; "
        f"{'server and load generator pinned to CPUs 1 and 0' if doc.get('pinned') else 'not pinned'}; "
        f"1-min load {doc['load_before']} before, {doc['load_after']} after; up to {doc['runs']} "
        "runs per cell (a run cut at its time bound counts fewer), fresh server each, peers in "
        "rotating order.",
        "",
        f"Each client: non-blocking connect from 127.0.0.2-9 ({doc['batch'] or 'all'} connects "
        "issued between two looks at the clients' events), its protocol's handshake, ADD a "
        "counter, the last one SETs a key, all WAIT on it (echo: one 32 B round trip). Time: from "
        "the first connect to the last client released. Kernel counters: medians per run.",
        "",
        "| clients | peer | all done, median (range; runs) | vs tcpstore | vs echo | refused / reset / "
        "retries (all runs) | ListenOverflows | ListenDrops | TCPTimeouts | server CPU per client | "
        "load generator CPU | waiting for a CPU (server / generator) | server RSS per idle connection |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, cell in doc["summary"].items():
        base = cell.get("tcpstore", {}).get("median_ms")
        echo = cell.get("echo", {}).get("median_ms")
        for peer, s in cell.items():
            vs_t = f"{s['median_ms'] / base:.2f}x" if base else ""
            vs_e = f"{s['median_ms'] / echo:.2f}x" if echo else ""
            unf = f" ({s['unfinished']} unfinished)" if s["unfinished"] else ""
            k = s["kernel"]
            rss = f"{s['rss_per_connection'] / 1024:.1f} KiB" if peer != "echo" else ""
            lines.append(
                f"| {n} | {peer} | {s['median_ms']:.0f} ms ({s['min_ms']:.0f}-{s['max_ms']:.0f}; {s['runs']}){unf} | "
                f"{vs_t} | {vs_e} | {s['refused']} / {s['reset']} / {s['retries']} | "
                f"{k['TcpExtListenOverflows']:.0f} | {k['TcpExtListenDrops']:.0f} | "
                f"{k['TcpExtTCPTimeouts']:.0f} | {s['server_cpu_us_per_client']:.1f} us | "
                f"{s['client_cpu_s']:.2f} s | {s['server_waiting']:.0%} / {s['client_waiting']:.0%} | {rss} |")
    if doc.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in doc["notes"]]
    lines += ["", "Peers:", ""]
    notes = doc.get("peer_notes", {})
    lines += [f"- `{p}`: {notes.get(p) or PEERS[p][2]}" for p in doc["peers"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,16384")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--somaxconn", type=int, default=0, help="set in the private namespace (0: as is)")
    ap.add_argument("--out", default=os.path.join(procs.HERE, "results", "storm"))
    ap.add_argument("--machine-note", default="", help="named in the results (e.g. shared 2-core VM)")
    ap.add_argument("--batch", type=int, default=0,
                    help="connects issued between two looks at the clients' events (0: all at once; "
                         "a client whose connect completed within the call sends its handshake at once)")
    ap.add_argument("--nice", type=int, default=0,
                    help="run servers and clients at this nice value (negative: root; a shared "
                         "machine's other load then delays them less)")
    ap.add_argument("--pin", action="store_true",
                    help=f"server on CPU {SERVER_CPU}, load generator on CPU {CLIENT_CPU} (never "
                         "on one CPU together, as with a server on its own host)")
    ap.add_argument("--no-netns", action="store_true")
    ap.add_argument("--merge", default="", metavar="A.json,B.json",
                    help="no measuring: merge earlier runs' results (e.g. one per size) into OUT")
    ap.add_argument("--notes", default="", metavar="FILE",
                    help="with --merge: a text file of notes (one per line) for OUT.md")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=BINARY[=NOTE]",
                    help="another elasticstore-server build as peer NAME (native protocol), e.g. "
                         "an earlier commit's, measured in the same run")
    args = ap.parse_args(argv)
    for spec in args.also:
        name, _, rest = spec.partition("=")
        binary, _, note = rest.partition("=")
        if not name or not os.access(binary, os.X_OK):
            raise SystemExit(f"storm: --also {spec!r}: want NAME=BINARY[=NOTE] (an executable)")
        PEERS[name] = (server_at(binary, name), "native", note or f"`{binary}`, native protocol")
        args.peers += "," + name
    if args.merge:
        notes = open(args.notes).read().splitlines() if args.notes else []
        return merge(args.merge.split(","), args.out, [n for n in notes if n.strip()])
    sizes = [int(x) for x in args.sizes.split(",")]
    names = args.peers.split(",")
    unknown = [p for p in names if p not in PEERS]
    if unknown:
        raise SystemExit(f"storm: unknown peers {unknown} (known: {', '.join(PEERS)})")
    if not args.no_netns:
        enter_netns(argv)
    if args.somaxconn:
        with open("/proc/sys/net/core/somaxconn", "w") as f:
            f.write(str(args.somaxconn))
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # inherited by the servers and clients
    fd_limit = raise_fd_limit(max(sizes) + 256)
    procs.install_sigterm_handler()
    storm_binary()
    read = lambda p: open(p).read().strip()  # noqa: E731
    doc: dict = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine.machine(), "machine_note": args.machine_note or "shared machine",
        "somaxconn": int(read("/proc/sys/net/core/somaxconn")),
        "max_syn_backlog": int(read("/proc/sys/net/ipv4/tcp_max_syn_backlog")),
        "fd_limit": fd_limit, "nice": args.nice, "pinned": args.pin, "runs": args.runs, "batch": args.batch, "peers": names,
        "load_before": round(os.getloadavg()[0], 2), "results": [],
        "peer_notes": {p: PEERS[p][2] for p in names},
    }
    for n in sizes:
        for i in range(args.runs):
            order = names[i % len(names):] + names[:i % len(names)]
            for peer in order:
                r = one_run(peer, n, f"storm{i}", args.batch or n, args.pin)
                doc["results"].append(r)
                print(f"{n:6d} {peer:28s} {r['all_done_ms']:8.1f} ms  refused {r['refused']} "
                      f"reset {r['reset_in_handshake'] + r['reset_at_connect'] + r['closed_in_handshake']} "
                      f"retries {r['retries']} unfinished {r['unfinished'] + r['failed']} "
                      f"overflows {r['kernel']['TcpExtListenOverflows']} "
                      f"timeouts {r['kernel']['TcpExtTCPTimeouts']}", flush=True)
                doc["load_after"] = round(os.getloadavg()[0], 2)
                write(doc, args.out, quiet=True)  # a run cut short keeps what it measured
    write(doc, args.out)
    return 0


def write(doc: dict, out: str, quiet: bool = False) -> None:
    sizes = sorted({r["clients"] for r in doc["results"]})
    doc["summary"] = {
        str(n): {p: summarize([r for r in doc["results"] if r["clients"] == n and r["peer"] == p])
                 for p in doc["peers"] if any(r["clients"] == n and r["peer"] == p for r in doc["results"])}
        for n in sizes
    }
    with open(out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(render(doc))
    if not quiet:
        print(render(doc))


def merge(paths: list[str], out: str, notes: list[str]) -> int:
    """One document from several runs (the first one's machine and settings; every run's
    results; the loads of each)."""
    docs = [json.load(open(p)) for p in paths]
    doc = dict(docs[0])
    doc["results"] = [r for d in docs for r in d["results"]]
    doc["peers"] = list(dict.fromkeys(p for d in docs for p in d["peers"]))
    doc["date"] = ", ".join(d["date"] for d in docs)
    doc["load_before"] = "/".join(str(d["load_before"]) for d in docs)
    doc["load_after"] = "/".join(str(d["load_after"]) for d in docs)
    for d in docs:
        doc.setdefault("peer_notes", {}).update(d.get("peer_notes", {}))
    doc["notes"] = notes or doc.get("notes", [])
    write(doc, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
