"""The report as markdown: the tables with their ratios, and the goals of issue 4."""

from __future__ import annotations

from latency import OPS
from peers import BASELINE

FLOOR = "python ping-pong"  # floor_peer.py: the limit for Python clients


def us(ns) -> str:
    return "-" if ns is None else f"{ns / 1000:.1f}"


def ratio(a, b) -> str:
    if not a or not b:
        return "-"
    r = a / b
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.3f}x" if r >= 0.01 else f"{r:.1e}x"


def fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def val(v) -> dict:
    """A storm/barrier point: {"seconds", "server_cpu_s"} (older JSON: a float)."""
    if v is None:
        return {"seconds": None, "server_cpu_s": None}
    return v if isinstance(v, dict) else {"seconds": v, "server_cpu_s": None}


def mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def render(res: dict, quick: bool) -> str:
    m = res["machine"]
    pp = res.get("pingpong") or {}
    pp50 = pp.get("p50_ns")
    L = []
    L.append(f"# elasticstore benchmarks ({'QUICK mode: small counts, figures not meaningful' if quick else 'full run'})")
    L.append("")
    L.append(f"- date: {res['date']}")
    L.append(f"- machine: {m['cores']} cores, {m['cpu']}, {m['kernel']}, {m['mem_gib']} GiB, "
             f"Python {m['python']}, fd limit {m['fd_limit']}")
    L.append("- every server runs in its own process; clients are processes forked from the "
             "measuring process after `import torch, elasticstore` (pages shared), the same "
             "way for every peer but etcd, whose gRPC client does not survive a fork: its client "
             "processes are forked by a fresh interpreter that imported the client once for the run; "
             "storm/barrier clients are threads in up to "
             f"{res['sizes']['max_procs']} such processes")
    L.append("- peers take turns (latency in 4 slices per op, throughput in "
             f"{res['sizes'].get('tput_rounds', 2)} per point, "
             "rotating order) so that other load on the machine falls on all alike; 1-min load "
             "average before/after each section (this run's own clients included): "
             + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in res.get("load", {}).items()))
    L.append("")
    if res.get("rdns") == "shimmed":
        L.append("- reverse DNS: torch's TCPStore client calls getnameinfo() on every connect; this "
                 "machine's resolver drops some PTR queries under load (each then costs its 5 s "
                 "timeout), so the run preloads `no_rdns.so` (benchmarks/no_rdns.c): name lookups "
                 "fail at once, as with a healthy resolver. `report.py --real-dns` measures as is.")
    else:
        L.append("- reverse DNS: real (torch's client does a reverse lookup per connect; stalls of "
                 "the resolver show in its connect figures)")
    L.append("")
    L.append("| peer | what | status |")
    L.append("|---|---|---|")
    for name, p in res["peers"].items():
        L.append(f"| {name} | {p['description']} | {p['status']} |")
    L.append("")

    L.append("## Latency per operation, one Python client, one connection (µs)")
    L.append("")
    free, one = pp.get("free") or {}, pp.get("one_cpu") or {}
    L.append(f"Raw TCP ping-pong on loopback (C++, {pp.get('size', '-')} B, echo server in its own "
             f"process): p50 {us(free.get('p50_ns'))}, p99 {us(free.get('p99_ns'))} with both "
             f"processes free to run on any CPU; p50 {us(one.get('p50_ns'))}, p99 "
             f"{us(one.get('p99_ns'))} with both pinned to one CPU. Every store below is measured "
             "with its server and clients pinned to one CPU too (cross-CPU wake-ups on this VM "
             "cost tens of µs and vary with the host), and the ping-pong ratio uses the pinned "
             f"p50 ({us(pp50)}, {pp.get('floor_from', '-')}). `wait` is the wake-up time: "
             "from another client's `set` call to `wait` returning. torch's TCPStore has no "
             "`try_get`, and its `set` does not wait for an answer (the figure is a send); "
             "its `get` is two round trips (wait, then get).")
    L.append("")
    L.append("| op | peer | p50 | p99 | mean | p50 x TCPStore | p99 x TCPStore | p50 x ping-pong |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|")
    base = res["latency"].get(BASELINE, {})
    for op in OPS:
        for name, lat in res["latency"].items():
            st = lat.get(op)
            if not st or not st.get("n"):
                continue
            b = base.get(op) or {}
            L.append(f"| {op} | {name} | {us(st['p50_ns'])} | {us(st['p99_ns'])} | "
                     f"{us(st['mean_ns'])} | {ratio(st['p50_ns'], b.get('p50_ns'))} | "
                     f"{ratio(st['p99_ns'], b.get('p99_ns'))} | {ratio(st['p50_ns'], pp50)} |")
    L.append("")

    L.append("## Throughput, mixed workload, N client processes (one connection each)")
    L.append("")
    L.append("40% get, 20% set, 20% add, 10% check, 10% compare_set; 64 B values; "
             f"{res['sizes']['tput_seconds']} s per point; latency in µs.")
    L.append("")
    L.append("| clients | peer | ops/s | p50 | p99 | ops/s x TCPStore | p99 x TCPStore | server CPU µs/op | x TCPStore |")
    L.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    tb = res["throughput"].get(BASELINE, {})
    for n in res["sizes"]["tput_clients"]:
        for name, t in res["throughput"].items():
            st = t.get(str(n))
            if not st:
                continue
            b = tb.get(str(n)) or {}
            L.append(f"| {n} | {name} | {st['ops_per_s']:.0f} | {us(st.get('p50_ns'))} | "
                     f"{us(st.get('p99_ns'))} | {ratio(st['ops_per_s'], b.get('ops_per_s'))} | "
                     f"{ratio(st.get('p99_ns'), b.get('p99_ns'))} | "
                     f"{fmt(st.get('server_cpu_us_per_op'))} | "
                     f"{ratio(st.get('server_cpu_us_per_op'), b.get('server_cpu_us_per_op'))} |")
    L.append("")

    L += etcd_cost(res)

    g = res["sizes"].get("group_rounds", 1)
    rounds = f"; median of {g} rounds, peers rotating" if g > 1 else ""
    for section, title in (
        ("storm", f"Connect storm: N clients connect and pass one barrier (wall time{rounds})"),
        ("barrier", "Barrier, N connected participants (time per barrier, mean of "
                    f"{res['sizes']['barrier_rounds']} in a row{rounds})"),
    ):
        L.append(f"## {title}")
        L.append("")
        L.append("`native`: the server's BARRIER op; `store-based`: torch's "
                 "`torch.distributed.elastic.utils.store.barrier` (add a counter, the last "
                 "sets a key, all wait)" + ("; `one round trip`: the python ping-pong row, each "
                 "client connects and makes one round trip to an echo server (no barrier: the "
                 "least that connecting and passing any barrier can cost these clients)."
                 if section == "storm" else "."))
        L.append("")
        L.append("| N | peer | barrier | wall ms | x TCPStore | server CPU ms | x TCPStore |")
        L.append("|---:|---|---|---:|---:|---:|---:|")
        sizes = res["sizes"]["storm_clients" if section == "storm" else "barrier_sizes"]
        bb = res[section].get(BASELINE, {}).get("store-based", {})
        for n in sizes:
            for name, kinds in res[section].items():
                for kind, pts in kinds.items():
                    if str(n) in pts:
                        v, b = val(pts[str(n)]), val(bb.get(str(n)))
                        L.append(f"| {n} | {name} | {kind} | {ms(v['seconds'])} | "
                                 f"{ratio(v['seconds'], b['seconds'])} | "
                                 f"{ms(v['server_cpu_s'])} | "
                                 f"{ratio(v['server_cpu_s'], b['server_cpu_s'])} |")
        L.append("")

    L.append("## Server memory (RSS of the server process, MiB)")
    L.append("")
    L.append("| peer | server process | idle | with N idle conns | N | Δ conns | with K keys | K | Δ keys | Δ keys x TCPStore |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    mb = res["memory"].get(BASELINE, {})
    for name, mm in res["memory"].items():
        dconn = mm["conns_bytes"] - mm["idle_bytes"]
        dkeys = mm["keys_bytes"] - mm["keys_idle_bytes"]
        bkeys = mb and mb["keys_bytes"] - mb["keys_idle_bytes"]
        L.append(f"| {name} | {mm['server']} | {mib(mm['idle_bytes'])} | {mib(mm['conns_bytes'])} "
                 f"| {mm['conns']} | {mib(dconn)} | {mib(mm['keys_bytes'])} | {mm['keys']} | "
                 f"{mib(dkeys)} | {ratio(dkeys, bkeys)} |")
    L.append("")

    L.append("## Goals (issue 4)" + (" (quick mode: not judged)" if quick else ""))
    L.append("")
    L.append("| goal | measured | met |")
    L.append("|---|---|---|")
    for goal, measured, ok in goals(res):
        L.append(f"| {goal} | {measured} | {'-' if quick or ok is None else ('yes' if ok else 'NO')} |")
    L.append("")
    if res["notes"]:
        L.append("Notes: " + "; ".join(res["notes"]))
        L.append("")
    if res["errors"]:
        L.append("## Errors")
        L.append("")
        for e in res["errors"]:
            L.append(f"- {e}")
        L.append("")
    return "\n".join(L)


def etcd_cost(res: dict) -> list:
    """Issue 5: EtcdStore (one etcd member) against elasticstore.Store, the same run: what etcd's
    availability costs. Empty when either row is missing."""
    lat, tput = res["latency"], res["throughput"]
    etcd, es = "etcd", "elasticstore"
    if not (lat.get(etcd) and lat.get(es)) and not (tput.get(etcd) and tput.get(es)):
        return []
    L = ["## What etcd's availability costs: EtcdStore against elasticstore.Store (issue 5)", "",
         "Same run, same measuring code; etcd is one member with the WAL fsynced per commit, as "
         "deployed (a 3-member cluster adds a replication round trip per write).", "",
         "| measure | EtcdStore | elasticstore.Store | EtcdStore x elasticstore |",
         "|---|---:|---:|---:|"]
    for op in OPS:
        a, b = (lat.get(etcd) or {}).get(op), (lat.get(es) or {}).get(op)
        if a and b and a.get("n") and b.get("n"):
            for q in ("p50", "p99"):
                L.append(f"| {op} {q} µs | {us(a[q + '_ns'])} | {us(b[q + '_ns'])} | "
                         f"{ratio(a[q + '_ns'], b[q + '_ns'])} |")
    for n in res["sizes"]["tput_clients"]:
        a, b = (tput.get(etcd) or {}).get(str(n)), (tput.get(es) or {}).get(str(n))
        if a and b:
            L.append(f"| ops/s, {n} clients | {a['ops_per_s']:.0f} | {b['ops_per_s']:.0f} | "
                     f"{ratio(a['ops_per_s'], b['ops_per_s'])} |")
    return L + [""]


def goals(res: dict):
    es, tc = "elasticstore", BASELINE
    pp = (res.get("pingpong") or {}).get("p50_ns")
    lat = res["latency"]

    def p50(peer, op):
        return ((lat.get(peer) or {}).get(op) or {}).get("p50_ns")

    def check(name, value, limit):
        if value is None:
            return (name, "not measured", None)
        return (name, f"{value:.2f}x", value <= limit)

    g = p50(es, "get"), p50(tc, "get")
    yield check("get p50 <= 0.6x TCPStore", g[0] / g[1] if all(g) else None, 0.6)
    for op in ("add", "compare_set", "check"):
        a, b = p50(es, op), p50(tc, op)
        yield check(f"{op} p50 <= 1.0x TCPStore", a / b if a and b else None, 1.0)
        yield check(f"{op} p50 <= 1.25x ping-pong", a / pp if a and pp else None, 1.25)
    t = [((res["throughput"].get(p) or {}).get("64") or {}).get("ops_per_s") for p in (es, tc)]
    if all(t):
        yield ("throughput at 64 clients >= 1.5x TCPStore", f"{t[0] / t[1]:.2f}x", t[0] / t[1] >= 1.5)
    else:
        yield ("throughput at 64 clients >= 1.5x TCPStore", "not measured", None)
    fl = ((res["throughput"].get(FLOOR) or {}).get("64") or {}).get("ops_per_s")
    if fl and t[1]:
        yield (f"(the limit: {FLOOR}, 64 clients, x TCPStore)", f"{fl / t[1]:.2f}x", None)
    for section, label in (("storm", "1024-client connect storm"), ("barrier", "1024-participant barrier")):
        ours = val(((res[section].get(es) or {}).get("native") or {}).get("1024"))["seconds"]
        theirs = val(((res[section].get(tc) or {}).get("store-based") or {}).get("1024"))["seconds"]
        yield check(f"{label} <= 0.5x torch", ours / theirs if ours and theirs else None, 0.5)
        floor = val(((res[section].get(FLOOR) or {}).get("one round trip") or {}).get("1024"))["seconds"]
        if floor and theirs:
            yield (f"(the limit: {FLOOR}, 1024 clients connect + one round trip, x torch)",
                   f"{floor / theirs:.2f}x", None)
    mm = res["memory"].get(es)
    if mm and mm["conns"] >= 4096:
        v = mm["conns_bytes"] / 2**20
        yield (f"RSS with 4096 idle connections <= 64 MiB ({mm['server']})", f"{v:.1f} MiB", v <= 64)
    else:
        yield ("RSS with 4096 idle connections <= 64 MiB", "not measured", None)
