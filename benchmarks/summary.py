"""The short benchmark summary of the top-level README, rendered from a full run's results.

report.py writes it between the README's ``<!-- bench-summary:begin -->`` and ``-end -->``
markers after a full run, so the figures there are always the latest run's, never copied by hand.
"""

from __future__ import annotations

from peers import BASELINE
from render import FLOOR, ratio, us, val

OURS, TORCH_ON_OURS, ETCD = "elasticstore", "tcpstore->elasticstore", "etcd"
_OPS = (("get", "get"), ("add", "add"), ("compare_set", "compare_set"), ("check", "check"),
        ("multi_get", "multi_get (16 keys)"), ("try_get", "try_get"),
        ("set", "set (acknowledged)"))


def _p50(res: dict, peer: str, op: str):
    return (((res["latency"].get(peer) or {}).get(op)) or {}).get("p50_ns")


def _ops(res: dict, peer: str, n: int):
    return ((res["throughput"].get(peer) or {}).get(str(n)) or {}).get("ops_per_s")


def _group(res: dict, section: str, peer: str, kind: str, n: int) -> dict:
    return val(((res[section].get(peer) or {}).get(kind) or {}).get(str(n)))


def _k(x) -> str:
    return "-" if not x else f"{x / 1000:.1f}k"


def _ms(seconds) -> str:
    return "-" if not seconds else f"{seconds * 1000:.0f} ms"


def summary(res: dict) -> str:
    m = res["machine"]
    pp = (res.get("pingpong") or {}).get("p50_ns")
    L = [f"Measured side by side in one run (`python benchmarks/report.py`, {res['date']}; "
         f"{m['cores']} cores, {m['cpu']}, {m['kernel']}, Python {m['python']}). Every server "
         "runs in its own process; \"TCPStore\" is torch's client on torch's own libuv server; "
         "ratios are to it unless said otherwise. Absolute figures move with this VM's state; "
         "the ratios are the result. \"Python limit\" is no store at all: each call is one raw "
         "socket round trip from Python to an echo server, the best any store driven by these "
         "Python clients can do. Full tables, method and the etcd comparison: "
         "[benchmarks/results/latest.md](benchmarks/results/latest.md); how to run: "
         "[benchmarks/README.md](benchmarks/README.md).", "",
         "Latency of one Python client on one connection, p50 in µs (server and client on one "
         f"CPU; the raw C++ TCP ping-pong on loopback is {us(pp)} µs there):", "",
         "| op | elasticstore.Store | x TCPStore | x ping-pong | TCPStore | torch's client on our "
         "server | Python limit | EtcdStore (etcd 3.5, fsync) |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for op, label in _OPS:
        ours, base = _p50(res, OURS, op), _p50(res, BASELINE, op)
        if not ours:
            continue
        note = {"get": " (two round trips)", "set": " (not acknowledged)"}.get(op, "") if base else ""
        etcd = _p50(res, ETCD, op)
        L.append(f"| {label} | {us(ours)} | {ratio(ours, base)} | {ratio(ours, pp)} | "
                 f"{us(base)}{note} | {us(_p50(res, TORCH_ON_OURS, op))} | "
                 f"{us(_p50(res, FLOOR, op))} | {'-' if not etcd else f'{etcd / 1000:.0f}'} |")
    L += ["", "At scale (wall time; server CPU in the report):", "",
          "| measure | elasticstore | TCPStore | ratio | Python limit |",
          "|---|---:|---:|---:|---:|"]
    for n in (16, 64, 256):
        a, b = _ops(res, OURS, n), _ops(res, BASELINE, n)
        if a and b:
            fl = _ops(res, FLOOR, n)
            L.append(f"| throughput, {n} client processes, mixed ops | {_k(a)} ops/s | "
                     f"{_k(b)} ops/s | {ratio(a, b)} | {_k(fl)} ops/s ({ratio(fl, b)}) |")
    t = [((res["throughput"].get(p) or {}).get("64") or {}).get("server_cpu_us_per_op")
         for p in (OURS, BASELINE)]
    if all(t):
        L.append(f"| server CPU per op at 64 clients | {t[0]:.1f} µs | {t[1]:.1f} µs | "
                 f"{ratio(t[0], t[1])} | |")
    for n in (1024, 4096):
        a = _group(res, "storm", OURS, "native", n)["seconds"]
        b = _group(res, "storm", BASELINE, "store-based", n)["seconds"]
        fl = _group(res, "storm", FLOOR, "one round trip", n)["seconds"]
        if a and b:
            L.append(f"| {n} clients connect + one barrier (native barrier) | {_ms(a)} | {_ms(b)} "
                     f"| {ratio(a, b)} | {_ms(fl)} ({ratio(fl, b)}), connect + one round trip |")
    for n in (1024, 64):
        a = _group(res, "barrier", OURS, "native", n)["seconds"]
        b = _group(res, "barrier", BASELINE, "store-based", n)["seconds"]
        if a and b:
            L.append(f"| barrier of {n} connected participants | {a * 1000:.1f} ms | "
                     f"{b * 1000:.1f} ms | {ratio(a, b)} | |")
    mm, mb = res["memory"].get(OURS), res["memory"].get(BASELINE)
    if mm and mb:
        L.append(f"| server RSS with {mm['conns']} idle connections ({mm['server']}; "
                 f"{mb['server']}) | "
                 f"{mm['conns_bytes'] / 2**20:.1f} MiB | {mb['conns_bytes'] / 2**20:.1f} MiB | | |")
        da = mm["keys_bytes"] - mm["keys_idle_bytes"]
        db = mb["keys_bytes"] - mb["keys_idle_bytes"]
        L.append(f"| RSS growth for {mm['keys']:,} keys of {res['sizes']['mem_value_bytes']} B | "
                 f"{da / 2**20:.0f} MiB | {db / 2**20:.0f} MiB | {ratio(da, db)} | |")
    return "\n".join(L)
