"""``elasticstore status`` / ``stop`` addressing errors: one line, exit 1, within the timeout."""

from __future__ import annotations

import subprocess
import sys
import time

from agent_nodes import free_port

from elasticstore import StoreServer


def cli(*args: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "elasticstore.cli", *args], capture_output=True,
                         text=True, timeout=60)
    return out.returncode, out.stderr, time.monotonic() - t0


def test_endpoint_not_answering_one_line_exit_1() -> None:
    port = free_port()
    for command in ("status", "stop"):
        code, err, took = cli(command, "--rdzv-endpoint", f"127.0.0.2:{port}", "--rdzv-id", "job",
                              "--timeout", "2")
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("elasticstore: ")
        assert took < 2 + 15  # interpreter and torch import on a loaded machine


def test_missing_job_one_line_exit_1() -> None:
    with StoreServer("127.0.0.2", 0) as server:
        for command in ("status", "stop"):
            code, err, _ = cli(command, "--rdzv-endpoint", server.address, "--rdzv-id", "nojob",
                               "--timeout", "2")
            assert code == 1 and err.strip() == f"elasticstore: no job 'nojob' at {server.address}", err
        code, _, _ = cli("status", "--rdzv-endpoint", server.address, "--json")
        assert code == 1  # --json / stop need --rdzv-id


def test_plain_status_still_prints_server_counters() -> None:
    with StoreServer("127.0.0.2", 0) as server:
        out = subprocess.run([sys.executable, "-m", "elasticstore.cli", "status", "--addr",
                              server.address], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "keys " in out.stdout


def test_metrics_exports_server_counters() -> None:
    import os
    import signal
    import urllib.request

    port = free_port("127.0.0.1")
    with StoreServer("127.0.0.2", 0) as server:
        proc = subprocess.Popen([sys.executable, "-m", "elasticstore.cli", "metrics", "--addr",
                                 server.address, "--metrics-port", str(port)],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert proc.stdout is not None and "/metrics" in proc.stdout.readline()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            assert "elasticstore_server_up 1.0" in text
            assert "elasticstore_server_keys " in text and "elasticstore_server_connections " in text
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(30) == 0
            if proc.stdout is not None:
                proc.stdout.close()


def test_server_command_serves_its_own_metrics() -> None:
    """``elasticstore server --metrics-port``: the in-process server's counters, read directly."""
    import os
    import signal
    import urllib.request

    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "elasticstore.cli", "server", "--port", "0",
                             "--metrics-port", str(port)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("elasticstore server listening on 127.0.0.1:")
        assert f"127.0.0.1:{port}/metrics" in proc.stdout.readline()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert "elasticstore_server_up 1.0" in text and "elasticstore_server_keys " in text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0
        if proc.stdout is not None:
            proc.stdout.close()


def test_status_of_a_recorded_round_and_watch() -> None:
    """A round record and status records written by hand: the table, then --watch until SIGINT."""
    import json
    import os
    import signal

    from elasticstore import Store

    with StoreServer("127.0.0.2", 0) as server:
        with Store(server.host, server.port) as st:
            nodes = ["127.0.0.2-10-0", "127.0.0.3-11-0"]
            st.set("rdzv/j/ctl/round", json.dumps({"schema": 1, "round": 3, "participants": nodes,
                                                   "standby": ["127.0.0.4-12-0"]}))
            st.set("rdzv/j/alive/127.0.0.5-13-0", "x")
            for rank, node in enumerate(nodes):
                st.set(f"status/j/node/{node}", json.dumps(
                    {"node": node, "addr": node[:9], "state": "running", "round": 3,
                     "local_workers": 4, "formed_at": 1.0e9, "rendezvous_seconds": 0.25}))
            st.set("status/j/failure", json.dumps({"rank": 5, "host": "127.0.0.3", "how": "exit code 1",
                                                   "exit_code": 1, "message": "boom", "when": 1.0e9}))
            out = subprocess.run([sys.executable, "-m", "elasticstore.cli", "status", "--addr",
                                  server.address, "--rdzv-id", "j"], capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            text = out.stdout
            assert "round 3: 2 node(s), 8 worker(s)" in text and "rendezvous took 0.250s" in text
            assert "127.0.0.3-11-0" in text and "(lost)" in text  # no alive key for either member
            assert "waiting: 127.0.0.5-13-0; standby: 127.0.0.4-12-0" in text
            assert "restarts: 2" in text and "rank 5 on 127.0.0.3: exit code 1" in text and "boom" in text
            proc = subprocess.Popen([sys.executable, "-m", "elasticstore.cli", "status", "--addr",
                                     server.address, "--rdzv-id", "j", "--watch", "--interval", "0.2"],
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
            assert proc.stdout is not None
            seen = 0
            for line in proc.stdout:
                seen += line.startswith("job j at")
                if seen == 2:
                    break
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(30) == 0
            proc.stdout.close()
