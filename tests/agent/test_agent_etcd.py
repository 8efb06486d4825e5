"""The kill-a-node test on the etcd backend: the node that hosted the round's worker store is
SIGKILLed with its workers; the survivor's next round gets a new worker store and finishes.

On etcd a node's loss is seen when its lease expires (``lease_ttl``), so the survivor's workers
usually fail first (gloo: connection closed by peer): that failure spends a restart, hence
``--max-restarts 1``."""

from __future__ import annotations

import os
import signal
import time

import pytest
from agent_nodes import agents, assert_gone, until

pytestmark = pytest.mark.slow

etcd_cluster = pytest.importorskip("etcd_cluster")
pytest.importorskip("etcd3")


def test_etcd_backend_loses_the_worker_store_host(tmp_path: object) -> None:
    with etcd_cluster.running(1) as cluster, agents(str(tmp_path)) as a:
        endpoint = cluster.endpoints[0]
        conf = ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", "etcdjob",
                "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1",
                "--rdzv-conf", "last_call_timeout=1,lease_ttl=1"]
        procs = {addr: a.start([*conf, "--local-addr", addr], name=addr) for addr in ("127.0.0.2", "127.0.0.3")}
        # Both nodes in one round: the first one, or (when one node came more than the 1 s last
        # call after the other, as on a loaded machine) the next.
        until(lambda: a.world_ready(2) is not None, 120, "2 workers past init_process_group")
        both = a.world_ready(2)
        starts = [s for s in a.starts() if s["attempt"] == both]
        host = next(s for s in starts if s["env"]["GROUP_RANK"] == "0")["env"]["MASTER_ADDR"]
        victim = procs.pop(host)
        (survivor,) = procs.values()
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        assert_gone([s["pid"] for s in starts if s["env"]["GROUP_RANK"] == "0"], 1.0)
        until(lambda: a.world_ready(1, killed_at) is not None, 60, "the survivor running alone")
        alone = a.world_ready(1, killed_at)
        (s1,) = [s for s in a.starts() if s["attempt"] == alone]
        assert s1["env"]["MASTER_ADDR"] != host  # a new worker store, on the survivor
        print(f"etcd: store host lost -> survivor past init_process_group in "
              f"{a.inits(alone)[0] - killed_at:.3f}s (lease_ttl 1s, last_call 1s)")
        a.release()
        assert a.wait(survivor, 60) == 0, a.output(survivor)
