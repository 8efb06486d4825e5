"""``elasticstore stop`` for a job whose rendezvous store is hosted by one of its agents (the
default: the agent on the endpoint's address serves it in-process): 2 nodes x 1 worker on
127.0.0.2 (the host) / 127.0.0.3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from agent_nodes import agents, assert_gone, free_port, node_flags, until

from elasticstore.ops import JobAddress, stop_job

pytestmark = pytest.mark.slow

CONF = ["--rdzv-conf", "last_call_timeout=1", "--max-restarts", "3"]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elasticstore.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def running(port: int) -> dict[str, Any] | None:
    """The status once both members run round 1 (read from the host agent's server)."""
    out = cli("status", "--rdzv-endpoint", f"127.0.0.2:{port}", "--rdzv-id", "job", "--json")
    assert out.returncode == 0, out.stderr
    st: dict[str, Any] = json.loads(out.stdout)
    if st["round"] is None or len(st["members"]) != 2:
        return None
    return st if all(m["state"] == "running" for m in st["members"]) else None


def watching(port: int) -> dict[str, Any] | None:
    """The status once both members run and wait for the round's end: the server holds 4 waiters
    (each agent's round watch and ring watch)."""
    st = running(port)
    return st if st is not None and st["store"]["waiters"] >= 4 else None


def stop(port: int) -> None:
    out = cli("stop", "--rdzv-endpoint", f"127.0.0.2:{port}", "--rdzv-id", "job")
    assert out.returncode == 0 and "stopped by operator" in out.stdout, out.stderr


def both(a: Any, host: Any, other: Any) -> str:
    return f"--- host:\n{a.output(host)}\n--- other:\n{a.output(other)}"


def assert_stopped_cleanly(out: str) -> None:
    """The agent's own lines say "stopped by operator" and name no error (the workers' lines,
    prefixed [host:rank], may: a peer's worker stopped under them)."""
    mine = [line for line in out.splitlines() if line.startswith("[elasticstore-run]")]
    assert any("stopped by operator" in line for line in mine), out
    assert not any("Error" in line or "failed" in line for line in mine), out


def start_both(a: Any, port: int, conf: list[str]) -> tuple[Any, Any]:
    """The hosting agent on 127.0.0.2 and the other on 127.0.0.3, once both workers are past
    init_process_group."""
    host = a.start(node_flags("127.0.0.2", port, "2", 1, *conf), name="host")
    other = a.start(node_flags("127.0.0.3", port, "2", 1, *conf), name="other")
    until(lambda: len(a.inits(0)) == 2, 120, "2 workers past init_process_group")
    return host, other


def test_stop_a_job_whose_agent_hosts_the_store(tmp_path: Any) -> None:
    port = free_port()
    with agents(str(tmp_path)) as a:
        host, other = start_both(a, port, CONF)
        st = until(lambda: running(port), 30, "both members running")
        assert [m["addr"] for m in st["members"]] == ["127.0.0.2", "127.0.0.3"]
        assert st["store"]["keys"] > 0 and st["closed"] is None

        t0 = time.monotonic()
        stop(port)
        assert a.wait(other, 60) == 0, a.output(other)
        assert a.wait(host, 60) == 0, a.output(host)
        print(f"stop -> both agents exited: {time.monotonic() - t0:.2f}s")
        for proc in (host, other):
            assert_stopped_cleanly(a.output(proc))
        assert_gone(a.all_pids(), 5)


def test_host_leaves_first_the_other_still_stops_cleanly(tmp_path: Any) -> None:
    """The other agent is frozen (SIGSTOP) while the stop arrives, so the host sees it first; the
    host keeps serving until the other left (its liveness outlasts the freeze: lease_ttl=60),
    and the other, thawed, reads the closed run there and exits 0 as well."""
    port = free_port()
    conf = [CONF[0], CONF[1] + ",lease_ttl=60", *CONF[2:]]
    with agents(str(tmp_path)) as a:
        host, other = start_both(a, port, conf)
        until(lambda: watching(port), 30, "both members running and watching the round")

        os.kill(other.pid, signal.SIGSTOP)
        try:
            stop(port)
            until(lambda: host.poll() is not None or "until the other 1 node(s) left" in
                  a.output(host), 60, "the host serving until the other left")
        finally:
            os.kill(other.pid, signal.SIGCONT)
        assert a.wait(other, 60) == 0, both(a, host, other)
        assert a.wait(host, 60) == 0, both(a, host, other)
        assert "serving until the other 1 node(s) left" in a.output(host)
        for proc in (host, other):
            assert_stopped_cleanly(a.output(proc))
        assert_gone(a.all_pids(), 5)


def test_host_gone_before_the_other_thaws(tmp_path: Any) -> None:
    """The other agent stays frozen past its liveness timeout (lease_ttl=6), so the host no
    longer waits for it and exits; the other, thawed, finds the store gone: it saw the stop in
    its round watch (buffered before the host left), and exits 0 too. The stop is sent from here,
    at once after the freeze: it must land before the host takes the frozen node for lost (6 s
    leaves room on a loaded machine). Once thawed, the other's threads all wake at once: the one
    that finds the host gone must not drop the stop its round watch already received."""
    port = free_port()
    conf = [CONF[0], CONF[1] + ",lease_ttl=6", *CONF[2:]]
    with agents(str(tmp_path)) as a:
        host, other = start_both(a, port, conf)
        until(lambda: watching(port), 30, "both members running and watching the round")

        os.kill(other.pid, signal.SIGSTOP)
        try:
            stop_job(JobAddress(f"127.0.0.2:{port}", "job"))
            assert a.wait(host, 60) == 0, both(a, host, other)
        finally:
            os.kill(other.pid, signal.SIGCONT)
        assert a.wait(other, 60) == 0, both(a, host, other)
        assert "stopped by operator" in a.output(other)
        assert_gone(a.all_pids(), 5)
