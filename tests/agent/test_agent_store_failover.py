"""The node hosting the rendezvous store is lost (its agent SIGKILLed with its workers): the
survivors agree on the next host, the job goes on at the smaller size and finishes; a node started
later with the same command line, and the old host coming back, join the moved store as members.

Three simulated nodes on 127.0.0.2-4, one ``--rdzv-endpoint`` list naming all three, 2 workers
each. The failover path never waits for the last call (a round after a loss forms once the
survivors are back); the last call is shortened here only for the later scale-up rounds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from agent_nodes import agents, assert_gone, events, free_port, until

pytestmark = pytest.mark.slow

ADDRS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def _flags(addr: str, port: int, nnodes: str, *extra: str) -> list[str]:
    endpoints = ",".join(f"{a}:{port}" for a in ADDRS)
    return ["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-endpoint", endpoints,
            "--local-addr", addr, "--rdzv-id", "job", "--max-restarts", "0", *extra]


def test_store_host_lost_survivors_go_on_and_late_nodes_find_the_new_host(tmp_path: object) -> None:
    port = free_port()
    conf = ["--rdzv-conf", "last_call_timeout=2"]
    with agents(str(tmp_path)) as a:
        logs = [os.path.join(str(tmp_path), f"logs-{i + 1}") for i in range(len(ADDRS))]
        nodes = [a.start(_flags(addr, port, "2:4", *conf, "--log-dir", logs[i]), name=f"n{i + 1}")
                 for i, addr in enumerate(ADDRS)]
        until(lambda: a.world_ready(6) is not None, 180, "3 nodes x 2 workers running")
        host_workers = [s["pid"] for s in a.starts() if s["world"] == 6 and s["env"]["GROUP_RANK"] == "0"]
        assert len(host_workers) == 2
        killed_at = time.time()
        os.kill(nodes[0].pid, signal.SIGKILL)  # the agent hosting the store; its workers follow
        assert_gone(host_workers, 5.0)
        until(lambda: a.world_ready(4, killed_at) is not None, 60, "survivors at world size 4")
        att = a.world_ready(4, killed_at)
        assert att is not None
        print(f"store host lost -> survivors past init_process_group at world size 4: "
              f"{max(a.inits(att).values()) - killed_at:.3f}s")
        moved = f"the rendezvous store moved from {ADDRS[0]}:{port} to {ADDRS[1]}:{port} (epoch 2)"
        for proc in nodes[1:]:
            assert moved in a.output(proc), a.output(proc)
        # elasticstore status, given the same endpoint list, reads the moved store and shows it.
        endpoints = ",".join(f"{addr}:{port}" for addr in ADDRS)
        host = _status(endpoints)["host"]
        assert (host["endpoint"], host["epoch"], host["previous"]) == (
            f"{ADDRS[1]}:{port}", 2, f"{ADDRS[0]}:{port}"), host
        assert host["node"].startswith(ADDRS[1] + "-") and time.time() - host["since"] < 120
        text = subprocess.run([sys.executable, "-m", "elasticstore.cli", "status", "--rdzv-endpoint",
                               endpoints, "--rdzv-id", "job"], capture_output=True, text=True,
                              timeout=60).stdout
        assert f"store host: {ADDRS[1]}:{port}" in text and f"took over from {ADDRS[0]}:{port}" in text, text

        # The old host comes back with the same command line: a member of the moved store, which
        # stays where it is; then a fourth node, started later with the same command line.
        back_at = time.time()
        back = a.start(_flags(ADDRS[0], port, "2:4", *conf), name="n1-back")
        until(lambda: a.world_ready(6, back_at) is not None, 120, "the old host taken in as a member")
        st = _status(endpoints)
        assert (st["host"]["endpoint"], st["host"]["epoch"]) == (f"{ADDRS[1]}:{port}", 2), st["host"]
        assert sorted(m["addr"] for m in st["members"]) == sorted(ADDRS), st["members"]
        fourth_at = time.time()
        fourth = a.start(_flags("127.0.0.5", port, "2:4", *conf), name="n4")
        until(lambda: a.world_ready(8, fourth_at) is not None, 120, "a fourth node taken in")
        assert _status(endpoints)["host"]["epoch"] == 2
        a.release()
        for proc in (*nodes[1:], back, fourth):
            assert a.wait(proc, 90) == 0, a.output(proc)
        for proc in nodes[1:]:
            assert "restart 1/0" not in a.output(proc)  # a lost host spends no restart
        for log_dir in logs[1:]:
            (event,) = [e for e in events(log_dir) if e["event"] == "store_moved"]
            assert (event["previous"], event["endpoint"], event["epoch"]) == (
                f"{ADDRS[0]}:{port}", f"{ADDRS[1]}:{port}", 2)


def _status(endpoints: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "elasticstore.cli", "status", "--rdzv-endpoint",
                          endpoints, "--rdzv-id", "job", "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result
