"""The physical limit: a raw TCP ping-pong on loopback (tcp_pingpong.cpp, echo server in its
own process)."""

from __future__ import annotations

import json
import os
import subprocess

from cbuild import build


def pingpong_binary() -> str:
    """tcp_pingpong: $ELASTICSTORE_TCP_PINGPONG, else compiled once into a temp dir."""
    env = os.environ.get("ELASTICSTORE_TCP_PINGPONG")
    if env:
        return env
    cxx = os.environ.get("CXX", "c++")
    return build("tcp_pingpong.cpp", "tcp_pingpong", [cxx, "-O2", "-std=c++17", "-pthread"])


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
    free to run on any CPU, once with both pinned to one CPU (on VMs a cross-CPU wake-up can
    cost tens of microseconds). The floor is the pinned one where there is more than one CPU:
    the stores' latencies are measured pinned the same way (latency.LATENCY_CPU)."""
    free = pingpong_once(iters, warmup, size, max_seconds)
    out = {"free": free}
    if len(os.sched_getaffinity(0)) > 1:
        out["one_cpu"] = pingpong_once(iters, warmup, size, max_seconds, cpu=min(os.sched_getaffinity(0)))
    floor = out.get("one_cpu", free)
    out.update({k: floor[k] for k in ("size", "iters", "p50_ns", "p99_ns", "mean_ns")})
    out["floor_from"] = "one_cpu" if floor is out.get("one_cpu") else "free"
    return out
