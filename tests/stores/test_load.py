"""Load beside hostile connections, against ``elasticstore-server`` (benchmarks/load.py has the
code; run it there with 4096 connections x 1000 operations): many concurrent native connections
doing mixed operations (shared and per-connection counters, set/get of their own key, ping) while
garbage, slowloris and half-open connections come and go. Nothing may fail or be lost: every
counter exact, every read sees its own last write; the hostile connections are closed by the
server; its peak RSS stays bounded."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
from paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import load  # noqa: E402

pytestmark = pytest.mark.slow

CONNECTIONS = int(os.environ.get("ELASTICSTORE_LOAD_CONNECTIONS", "2048"))
OPS = int(os.environ.get("ELASTICSTORE_LOAD_OPS", "100"))
HOSTILE = int(os.environ.get("ELASTICSTORE_LOAD_HOSTILE", "512"))
MAX_RSS_MIB = 256


def test_load_with_hostile_connections() -> None:
    limit = load.raise_nofile(2 * (CONNECTIONS + HOSTILE) + 256)
    assert limit >= CONNECTIONS + HOSTILE + 64, f"RLIMIT_NOFILE hard limit {limit} is too low"
    proc, port = load.start_server("--frame-timeout-ms", "1000", "--handshake-timeout-ms", "1000")
    try:
        res = asyncio.run(load.run(port, CONNECTIONS, OPS, HOSTILE))
        shared, own = asyncio.run(load.read_counters(port, CONNECTIONS))
        rss = load.peak_rss_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    print(
        f"\n{CONNECTIONS} connections x {OPS} ops in {res.seconds:.1f} s, "
        f"p50 {load.percentile(res.latencies_us, 0.5):.0f} us, "
        f"p99 {load.percentile(res.latencies_us, 0.99):.0f} us, server peak RSS {rss:.1f} MiB, "
        f"{res.hostile_opened} hostile connections"
    )
    assert not res.errors, res.errors[:10]
    assert res.ops == CONNECTIONS * OPS
    assert shared == res.shared_adds == CONNECTIONS * ((OPS + 4) // 5)
    assert own == {c: res.own_counts[c] for c in range(CONNECTIONS)}
    assert res.hostile_opened >= HOSTILE
    assert res.hostile_closed_by_server == res.hostile_opened
    assert rss < MAX_RSS_MIB
