"""``elasticstore status`` and ``stop`` on the etcd backend: one node, one worker."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from agent_nodes import agents, assert_gone, until

pytestmark = pytest.mark.slow

etcd_cluster = pytest.importorskip("etcd_cluster")
pytest.importorskip("etcd3")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elasticstore.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_status_and_stop_on_etcd(tmp_path: Any) -> None:
    with etcd_cluster.running(1) as cluster, agents(str(tmp_path)) as a:
        endpoint = cluster.endpoints[0]
        addressing = ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", "etcdjob"]
        node = a.start([*addressing, "--nnodes", "1", "--nproc-per-node", "1", "--local-addr",
                        "127.0.0.2", "--rdzv-conf", "lease_ttl=2"], name="n1")
        until(lambda: len(a.inits(0)) == 1, 120, "the worker past init_process_group")

        def running() -> dict[str, Any] | None:
            out = cli("status", *addressing, "--json")
            assert out.returncode == 0, out.stderr
            st: dict[str, Any] = json.loads(out.stdout)
            ok = st["members"] and st["members"][0]["state"] == "running"
            return st if ok else None

        st = until(running, 30, "the member running")
        assert st["round"]["number"] == 1 and st["members"][0]["addr"] == "127.0.0.2"
        assert "error" in st["store"]  # etcd has no server counters: the status says so
        missing = cli("status", *addressing[:-1], "nojob", "--timeout", "3")
        assert missing.returncode == 1 and "no job 'nojob'" in missing.stderr
        out = cli("stop", *addressing)
        assert out.returncode == 0, out.stderr
        assert a.wait(node, 60) == 0, a.output(node)
        assert "stopped by operator" in a.output(node)
        assert_gone(a.all_pids(), 5)
