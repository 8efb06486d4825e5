"""``elasticstore status`` / ``stop``, events.jsonl and the metrics endpoint on a running job:
2 nodes x 1 worker on 127.0.0.2 / 127.0.0.3, an external rendezvous server on 127.0.0.2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest
from agent_nodes import agents, assert_gone, free_port, node_flags, until

pytestmark = pytest.mark.slow


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elasticstore.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def status(port: int) -> dict[str, Any]:
    out = cli("status", "--rdzv-endpoint", f"127.0.0.2:{port}", "--rdzv-id", "job", "--json")
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def running(port: int, at_least: int) -> dict[str, Any] | None:
    """The status once every member runs the current round, numbered ``at_least`` or later."""
    st = status(port)
    rnd = st["round"]
    if rnd is None or rnd["number"] < at_least or len(st["members"]) != 2:
        return None
    ok = all(m["state"] == "running" and m["round"] == rnd["number"] for m in st["members"])
    return st if ok else None


def metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def test_status_kill_metrics_events_stop(tmp_path: Any) -> None:
    port, mport = free_port(), free_port("127.0.0.1")
    logs = os.path.join(str(tmp_path), "logs")
    server = subprocess.Popen([sys.executable, "-m", "elasticstore.cli", "server", "--host",
                               "127.0.0.2", "--port", str(port)], stdout=subprocess.PIPE,
                              start_new_session=True)
    try:
        assert server.stdout is not None and b"listening" in server.stdout.readline()
        conf = ["--rdzv-conf", "last_call_timeout=1", "--max-restarts", "3", "--log-dir", logs]
        with agents(str(tmp_path)) as a:
            n1 = a.start(node_flags("127.0.0.2", port, "2", 1, *conf, "--metrics-port", str(mport)),
                         name="n1")
            n2 = a.start(node_flags("127.0.0.3", port, "2", 1, *conf), name="n2")
            until(lambda: len(a.inits(0)) == 2, 120, "2 workers past init_process_group")

            st = until(lambda: running(port, 1), 30, "both members running in round 1")
            assert st["round"]["number"] == 1 and st["round"]["world_size"] == 2
            assert [m["addr"] for m in st["members"]] == ["127.0.0.2", "127.0.0.3"]
            assert [m["group_rank"] for m in st["members"]] == [0, 1]
            assert all(m["local_workers"] == 1 for m in st["members"])
            assert st["round"]["rendezvous_seconds"] > 0 and st["round"]["formed_at"] > 0
            assert st["restarts"] == 0 and st["last_failure"] is None and st["closed"] is None
            assert st["store"]["keys"] > 0
            assert metric(mport, 'elasticstore_restarts_total{cause="worker_failure"}') == 0

            victim = next(s for s in a.starts() if s["rank"] == 1)
            os.kill(victim["pid"], signal.SIGKILL)
            until(lambda: len(a.inits(1)) == 2, 90, "both workers restarted")
            st = until(lambda: running(port, 2), 30, "round 2 running")
            assert st["restarts"] >= 1 and st["failure_restarts"] == 1
            failure = st["last_failure"]
            assert failure["rank"] == 1 and failure["host"] == "127.0.0.3"
            assert failure["how"] == "signal SIGKILL" and failure["pid"] == victim["pid"]
            assert until(lambda: metric(mport, 'elasticstore_restarts_total{cause="worker_failure"}'),
                         10, "the restart counter") == 1
            assert metric(mport, "elasticstore_rounds_total") == 2
            assert metric(mport, "elasticstore_world_size") == 2
            assert metric(mport, 'elasticstore_worker_exits_total{code="SIGKILL"}') is None  # n2's
            text = cli("status", "--rdzv-endpoint", f"127.0.0.2:{port}", "--rdzv-id", "job").stdout
            assert "round 2" in text and "SIGKILL" in text and "127.0.0.3" in text

            t0 = time.monotonic()
            out = cli("stop", "--rdzv-endpoint", f"127.0.0.2:{port}", "--rdzv-id", "job")
            assert out.returncode == 0 and "stopped by operator" in out.stdout, out.stderr
            assert a.wait(n1, 60) == 0, a.output(n1)
            assert a.wait(n2, 60) == 0, a.output(n2)
            print(f"stop -> both agents exited: {time.monotonic() - t0:.2f}s")
            for proc in (n1, n2):
                assert "stopped by operator" in a.output(proc)
            assert_gone(a.all_pids(), 5)
            assert status(port)["closed"] == "stopped by operator"

            late = a.start(node_flags("127.0.0.3", port, "2", 1, *conf), name="late")
            assert a.wait(late, 60) == 0
            assert "stopped by operator" in a.output(late)

        with open(os.path.join(logs, "job", "events.jsonl")) as f:
            events = [json.loads(line) for line in f]
        mine = [e for e in events if e["host"] == "127.0.0.2"]
        names = [e["event"] for e in mine]
        assert names[:2] == ["round_formed", "worker_started"], names
        i = names.index("restart")
        assert "worker_exited" in names[2:i] and names[i + 1:i + 3] == ["round_formed", "worker_started"]
        assert mine[i]["cause"] == "worker_failure" and mine[i]["recover_seconds"] > 0
        assert names[-1] == "stop" and mine[-1]["reason"] == "stopped by operator"
        assert [e["mono"] for e in mine] == sorted(e["mono"] for e in mine)
        theirs = [e for e in events if e["host"] == "127.0.0.3"]
        exited = next(e for e in theirs if e["event"] == "worker_exited")
        assert exited["how"] == "signal SIGKILL" and exited["rank"] == 1 and not exited["stopped"]
        assert any(e["event"] == "worker_exited" and e["stopped"] for e in mine)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        if server.stdout is not None:
            server.stdout.close()
