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

import cbuild  # noqa: E402
import groups  # noqa: E402
import latency  # noqa: E402
import machine  # noqa: E402
import measures  # noqa: E402
import memory  # noqa: E402
import peers  # noqa: E402
import procs  # noqa: E402
import pingpong  # noqa: E402
import throughput  # noqa: E402
from peers import PEERS  # noqa: E402
from plot import plot  # noqa: E402
from render import render  # noqa: E402
from summary import summary  # noqa: E402

SECTIONS = ("latency", "throughput", "storm", "barrier", "memory")
RESULTS = os.path.join(procs.HERE, "results")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    last = text[-1] if text else ""
    return f"{type(e).__name__}: {last}"[:300]


def run(names, sections, sz) -> dict:
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine.machine(),
        "sizes": sz.__dict__,
        "rdns": cbuild.rdns_mode(),
        "peers": {},
        "errors": [],
        "load": {},
        "latency": {}, "throughput": {}, "storm": {}, "barrier": {}, "memory": {}, "notes": [],
    }
    log("ping-pong")
    try:
        res["pingpong"] = pingpong.pingpong(sz.pingpong_iters, sz.pingpong_iters // 10)
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

    def measured(section, n=0):
        """The usable peers measured in `section` (at n clients); why not the others: notes."""
        names = []
        for name in usable:
            why = PEERS[name].skip(section, n)
            if why is None:
                names.append(name)
            elif why not in res["notes"]:
                res["notes"].append(why)
        return names

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
                res["latency"] = latency.op_latencies(servers, sz, rounds=4)
            except Exception as e:
                failed(",".join(usable), section, e)
            finally:
                for srv in servers.values():
                    srv.close()
        elif section == "throughput":
            servers = {}
            try:
                servers = {n: PEERS[n].start_server() for n in usable}
                rounds = sz.tput_rounds
                for n in sz.tput_clients:
                    here = measured(section, n)
                    runs = {name: [] for name in here}
                    for rnd in range(rounds):
                        for name in rotated(here, rnd):
                            if runs[name] is None:
                                continue
                            try:
                                runs[name].append(throughput.throughput_run(
                                    name, servers[name], n, sz, f"tput/{n}/{rnd}",
                                    sz.tput_seconds / rounds))
                            except Exception as e:
                                failed(name, f"throughput {n} clients", e)
                                runs[name] = None
                    for name, r in runs.items():
                        if r:
                            res["throughput"].setdefault(name, {})[str(n)] = \
                                throughput.throughput_summary(r, n)
                    log(f"throughput {n} clients done")
            except Exception as e:
                failed(",".join(usable), section, e)
            finally:
                for srv in servers.values():
                    srv.close()
        elif section in ("storm", "barrier"):
            sizes = sz.storm_clients if section == "storm" else sz.barrier_sizes
            fn = groups.connect_storm if section == "storm" else groups.barrier_time
            shared = {}  # quick mode: one server per peer for the whole section
            try:
                for i, n in enumerate(sizes):
                    why_not = machine.fd_room(n, sz)
                    if why_not:
                        res["notes"].append(f"{section} {n}: skipped, {why_not}")
                        continue
                    samples: dict = {}  # (name, kind) -> points, one per round
                    for rnd in range(sz.group_rounds):
                        for name in rotated(measured(section), i + rnd):
                            for kind in PEERS[name].barriers:
                                if samples.get((name, kind), []) is None:
                                    continue  # failed in an earlier round
                                srv = None
                                try:  # a fresh server per point: earlier clients do not weigh
                                    if sz.fresh_server_per_point:
                                        srv = PEERS[name].start_server()
                                    elif name not in shared:
                                        shared[name] = PEERS[name].start_server()
                                    v = fn(name, srv or shared[name], n, kind, sz,
                                           f"{section}/{kind}/{n}/{rnd}")
                                    samples.setdefault((name, kind), []).append(v)
                                except Exception as e:
                                    failed(name, f"{section} {n} {kind}", e)
                                    samples[(name, kind)] = None
                                finally:
                                    if srv is not None:
                                        srv.close()
                    for (name, kind), pts in samples.items():
                        if pts:
                            res[section].setdefault(name, {}).setdefault(kind, {})[str(n)] = \
                                groups.median_point(pts)
                    log(f"{section} {n} done")
            finally:
                for srv in shared.values():
                    srv.close()
        elif section == "memory":
            for name in measured(section):
                if PEERS[name].measure_memory:
                    try:
                        res["memory"][name] = memory.memory(name, sz)
                    except Exception as e:
                        failed(name, section, e)
        res["load"][section] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        log(f"{section} done in {time.monotonic() - t0:.1f}s")
    return res


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
        update_readme(text, res)
    return True


def update_readme(text: str, res: dict) -> None:
    """Puts the latest full table between the markers of benchmarks/README.md, and the summary
    (summary.py) between those of the top-level README.md."""
    body = text.split("\n", 1)[1]  # without the title line
    replace_between(os.path.join(procs.HERE, "README.md"), "latest",
                    body.replace("\n## ", "\n### "))
    replace_between(os.path.join(os.path.dirname(procs.HERE), "README.md"), "bench-summary",
                    summary(res))


def replace_between(path: str, marker: str, body: str) -> None:
    """Replaces what stands between <!-- {marker}:begin --> and <!-- {marker}:end --> in path
    (nothing when the file or a marker is missing)."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return
    if begin not in text or end not in text:
        return
    head, rest = text.split(begin, 1)
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
        cbuild.reexec_without_rdns([os.path.abspath(__file__)] + sys.argv[1:])
    procs.install_sigterm_handler()
    sz = measures.QUICK if args.quick else measures.FULL
    t0 = time.monotonic()
    try:
        res = run(names, sections, sz)
    finally:
        procs.cleanup()
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
