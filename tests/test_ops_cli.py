"""``elasticstore status`` / ``stop`` addressing errors: one line, exit 1, within the timeout."""

from __future__ import annotations

import subprocess
import sys
import time

from agent_procs import free_port

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
