"""The counts of a run and the statistics every measurement shares.

The measurements themselves are one module each (latency.py, throughput.py, groups.py,
memory.py, pingpong.py), used both by report.py and by the pytest suites (written once). Every
loop is bounded in count and in time. Client processes are forked from the measuring process
after torch and elasticstore are imported, so their pages are shared copy-on-write and a child
costs a few MiB, not the ~200 MB of a fresh torch import; every peer's clients are run the same
way. Timing uses time.perf_counter_ns (CLOCK_MONOTONIC: comparable across processes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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
    tput_clients: tuple = (1, 8, 16, 64, 256)  # 1, 16, 64: issue 3; 1, 8, 64, 256: issue 4
    tput_seconds: float = 4.0
    tput_rounds: int = 4  # each point in this many slices, peers in rotating order
    storm_clients: tuple = (256, 1024, 4096)
    barrier_sizes: tuple = (64, 1024)
    barrier_rounds: int = 5
    group_rounds: int = 3  # storm/barrier points: the median of this many, peers rotating
    idle_conns: int = 4096
    mem_keys: int = 100_000
    mem_value_bytes: int = 1024
    op_timeout: float = 120.0  # per store operation, seconds
    threads_per_proc: int = 256  # storm/barrier clients are threads in forked processes
    max_procs: int = 8
    fresh_server_per_point: bool = True  # storm/barrier: a new server process per point


FULL = Sizes()
QUICK = Sizes(
    lat_iters=100, lat_warmup=10, lat_max_s=0.5, wake_iters=10, pingpong_iters=1000,
    tput_clients=(1, 8), tput_seconds=0.25, tput_rounds=2, storm_clients=(32,), barrier_sizes=(16,),
    barrier_rounds=2, group_rounds=1, idle_conns=16, mem_keys=1000, op_timeout=30.0, threads_per_proc=16,
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
