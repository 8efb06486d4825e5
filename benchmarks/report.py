"""Runs every benchmark against every peer in one go and writes the report.

    python benchmarks/report.py            full run (minutes); writes benchmarks/results/latest.*
    python benchmarks/report.py --quick    seconds, small counts, no thresholds (CI)

Prints a markdown table (absolute figures, ratios to torch's TCPStore and to the raw TCP
ping-pong), writes results/latest.md, latest.json and latest.png (throughput and connect-storm
time against client count). Every process it starts is killed on exit, Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import measures  # noqa: E402
import peers  # noqa: E402
from peers import BASELINE, PEERS  # noqa: E402

SECTIONS = ("latency", "throughput", "storm", "barrier", "memory")
RESULTS = os.path.join(peers.HERE, "results")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    last = text[-1] if text else ""
    return f"{type(e).__name__}: {last}"[:300]


def run(names, sections, sz) -> dict:
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": measures.machine(),
        "sizes": sz.__dict__,
        "rdns": measures.rdns_mode(),
        "peers": {},
        "errors": [],
        "load": {},
        "latency": {}, "throughput": {}, "storm": {}, "barrier": {}, "memory": {}, "notes": [],
    }
    log("ping-pong")
    try:
        res["pingpong"] = measures.pingpong(sz.pingpong_iters, sz.pingpong_iters // 10)
    except Exception as e:
        res["errors"].append(f"ping-pong: {short_error(e)}")
        res["pingpong"] = None

    usable = []
    for name in names:
        peer = PEERS[name]
        why = peer.missing()
        if not why:
            why = peers.probe(peer)
            why = why and f"not usable: {why}"
        res["peers"][name] = {"description": peer.description, "status": why or "ok"}
        if why:
            log(f"{name}: skipped: {why}")
        else:
            usable.append(name)

    def failed(name, what, e):
        msg = f"{name} {what}: {short_error(e)}"
        log(msg)
        res["errors"].append(msg)
        res.setdefault("tracebacks", []).append(traceback.format_exc())
        if name in res["peers"] and res["peers"][name]["status"] == "ok":
            res["peers"][name]["status"] = "partial (see errors)"

    def rotated(items, k):
        k %= max(1, len(items))
        return items[k:] + items[:k]

    for section in sections:
        t0 = time.monotonic()
        load0 = os.getloadavg()[0]
        log(f"{section}: {', '.join(usable)}")
        if section == "latency":
            servers = {}
            try:
                servers = {n: PEERS[n].start_server() for n in usable}
                res["latency"] = measures.op_latencies(servers, sz, rounds=4)
            except Exception as e:
                failed(",".join(usable), section, e)
            finally:
                for srv in servers.values():
                    srv.close()
        elif section == "throughput":
            servers = {}
            try:
                servers = {n: PEERS[n].start_server() for n in usable}
                rounds = 2
                for n in sz.tput_clients:
                    runs = {name: [] for name in usable}
                    for rnd in range(rounds):
                        for name in rotated(usable, rnd):
                            if runs[name] is None:
                                continue
                            try:
                                runs[name].append(measures.throughput_run(
                                    name, servers[name], n, sz, f"tput/{n}/{rnd}",
                                    sz.tput_seconds / rounds))
                            except Exception as e:
                                failed(name, f"throughput {n} clients", e)
                                runs[name] = None
                    for name, r in runs.items():
                        if r:
                            res["throughput"].setdefault(name, {})[str(n)] = \
                                measures.throughput_summary(r, n)
                    log(f"throughput {n} clients done")
            except Exception as e:
                failed(",".join(usable), section, e)
            finally:
                for srv in servers.values():
                    srv.close()
        elif section in ("storm", "barrier"):
            sizes = sz.storm_clients if section == "storm" else sz.barrier_sizes
            fn = measures.connect_storm if section == "storm" else measures.barrier_time
            shared = {}  # quick mode: one server per peer for the whole section
            try:
                for i, n in enumerate(sizes):
                    why_not = measures.fd_room(n, sz)
                    if why_not:
                        res["notes"].append(f"{section} {n}: skipped, {why_not}")
                        continue
                    for name in rotated(usable, i):
                        for kind in PEERS[name].barriers:
                            srv = None
                            try:  # a fresh server per point: earlier clients do not weigh on it
                                if sz.fresh_server_per_point:
                                    srv = PEERS[name].start_server()
                                elif name not in shared:
                                    shared[name] = PEERS[name].start_server()
                                v = fn(name, srv or shared[name], n, kind, sz,
                                       f"{section}/{kind}/{n}")
                                res[section].setdefault(name, {}).setdefault(kind, {})[str(n)] = v
                            except Exception as e:
                                failed(name, f"{section} {n} {kind}", e)
                            finally:
                                if srv is not None:
                                    srv.close()
                    log(f"{section} {n} done")
            finally:
                for srv in shared.values():
                    srv.close()
        elif section == "memory":
            for name in usable:
                if PEERS[name].measure_memory:
                    try:
                        res["memory"][name] = measures.memory(name, sz)
                    except Exception as e:
                        failed(name, section, e)
        res["load"][section] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        log(f"{section} done in {time.monotonic() - t0:.1f}s")
    return res


# ------------------------------------------------------------------------------- rendering


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
             "way for every peer; storm/barrier clients are threads in up to "
             f"{res['sizes']['max_procs']} such processes")
    L.append("- peers take turns (latency in 4 slices per op, throughput in 2 per point, "
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
             f"{us(one.get('p99_ns'))} with both pinned to one CPU. The ping-pong ratio uses the "
             f"lower p50 ({us(pp50)}, {pp.get('floor_from', '-')}). `wait` is the wake-up time: "
             "from another client's `set` call to `wait` returning. torch's TCPStore has no "
             "`try_get`, and its `set` does not wait for an answer (the figure is a send); "
             "its `get` is two round trips (wait, then get).")
    L.append("")
    L.append("| op | peer | p50 | p99 | mean | p50 x TCPStore | p99 x TCPStore | p50 x ping-pong |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|")
    base = res["latency"].get(BASELINE, {})
    for op in measures.OPS:
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

    for section, title in (
        ("storm", "Connect storm: N clients connect and pass one barrier (wall time)"),
        ("barrier", "Barrier, N connected participants (time per barrier, mean of "
                    f"{res['sizes']['barrier_rounds']} in a row)"),
    ):
        L.append(f"## {title}")
        L.append("")
        L.append("`native`: the server's BARRIER op; `store-based`: torch's "
                 "`torch.distributed.elastic.utils.store.barrier` (add a counter, the last "
                 "sets a key, all wait).")
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
    for section, label in (("storm", "1024-client connect storm"), ("barrier", "1024-participant barrier")):
        ours = val(((res[section].get(es) or {}).get("native") or {}).get("1024"))["seconds"]
        theirs = val(((res[section].get(tc) or {}).get("store-based") or {}).get("1024"))["seconds"]
        yield check(f"{label} <= 0.5x torch", ours / theirs if ours and theirs else None, 0.5)
    mm = res["memory"].get(es)
    if mm and mm["conns"] >= 4096:
        v = mm["conns_bytes"] / 2**20
        yield (f"RSS with 4096 idle connections <= 64 MiB ({mm['server']})", f"{v:.1f} MiB", v <= 64)
    else:
        yield ("RSS with 4096 idle connections <= 64 MiB", "not measured", None)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, pts in res["throughput"].items():
        xs = sorted(int(n) for n in pts)
        a.plot(xs, [pts[str(x)]["ops_per_s"] for x in xs], marker="o", label=name)
    a.set_xscale("log", base=2)
    a.set_xlabel("client processes")
    a.set_ylabel("ops/s (mixed workload)")
    a.set_title("Throughput")
    a.grid(True, alpha=0.3)
    a.legend(fontsize=8)
    for name, kinds in res["storm"].items():
        for kind, pts in kinds.items():
            xs = sorted(int(n) for n in pts)
            b.plot(xs, [val(pts[str(x)])["seconds"] for x in xs], marker="o",
                   label=f"{name} ({kind} barrier)")
    b.set_xscale("log", base=2)
    b.set_xlabel("clients")
    b.set_ylabel("seconds")
    b.set_title("Connect storm: connect + one barrier")
    b.grid(True, alpha=0.3)
    b.legend(fontsize=8)
    m = res["machine"]
    fig.suptitle(f"{res['date']} - {m['cores']} cores {m['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(res: dict, text: str, out: str) -> bool:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "latest.md"), "w") as f:
        f.write(text + f"\nTotal run time: {res.get('seconds', '-')} s.\n")
    with open(os.path.join(out, "latest.json"), "w") as f:
        json.dump({k: v for k, v in res.items() if k != "tracebacks"}, f, indent=1)
    try:
        plot(res, os.path.join(out, "latest.png"))
    except Exception as e:
        log(f"plot failed: {short_error(e)}")
        return False
    if not res.get("quick") and os.path.abspath(out) == os.path.abspath(RESULTS):
        update_readme(text)
    return True


def update_readme(text: str) -> None:
    """Puts the latest full table between the markers of benchmarks/README.md."""
    path = os.path.join(peers.HERE, "README.md")
    begin, end = "<!-- latest:begin -->", "<!-- latest:end -->"
    with open(path) as f:
        readme = f.read()
    if begin not in readme or end not in readme:
        return
    body = text.split("\n", 1)[1]  # without the title line
    body = body.replace("\n## ", "\n### ")
    head, rest = readme.split(begin, 1)
    tail = rest.split(end, 1)[1]
    with open(path, "w") as f:
        f.write(f"{head}{begin}\n{body.strip()}\n{end}{tail}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="seconds, small counts (CI)")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma-separated, of: " + ",".join(PEERS))
    ap.add_argument("--sections", default=",".join(SECTIONS), help=",".join(SECTIONS))
    ap.add_argument("--out", default=RESULTS, help="directory for latest.md/.json/.png")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--from", dest="from_json", metavar="JSON",
                    help="re-render a saved latest.json (no measuring)")
    ap.add_argument("--real-dns", action="store_true",
                    help="do not preload no_rdns.so (torch's client then does real reverse DNS "
                         "lookups on every connect)")
    args = ap.parse_args(argv)
    names = [n for n in args.peers.split(",") if n]
    sections = [s for s in args.sections.split(",") if s]
    for n in names:
        if n not in PEERS:
            ap.error(f"unknown peer {n}")
    for s in sections:
        if s not in SECTIONS:
            ap.error(f"unknown section {s}")
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
        quick = res.get("quick", False)
        text = render(res, quick)
        print(text)
        if not args.no_write:
            write(res, text, args.out)
        return 0
    if not args.real_dns:
        measures.reexec_without_rdns([os.path.abspath(__file__)] + sys.argv[1:])
    peers.install_sigterm_handler()
    sz = measures.QUICK if args.quick else measures.FULL
    t0 = time.monotonic()
    try:
        res = run(names, sections, sz)
    finally:
        peers.cleanup()
    res["seconds"] = round(time.monotonic() - t0, 1)
    res["quick"] = args.quick
    text = render(res, args.quick)
    print(text)
    if not args.no_write and not write(res, text, args.out):
        return 1
    log(f"done in {res['seconds']} s")
    # quick mode has no thresholds; a crashed measurement still fails it (the code rotted)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
