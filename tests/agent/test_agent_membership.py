"""--nnodes 1:3: a third node is taken in at the next round; an agent SIGKILLed with its
workers -> its workers are gone within a second and the survivors finish at the smaller size."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
from agent_nodes import agents, assert_gone, free_port, node_flags, until

pytestmark = pytest.mark.slow

CONF = ["--rdzv-conf", "last_call_timeout=1", "--max-restarts", "1"]


def test_scale_up_then_node_lost(tmp_path: object) -> None:
    port = free_port()
    with agents(str(tmp_path)) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "1:3", 1, *CONF), name="n1")
        n2 = a.start(node_flags("127.0.0.3", port, "1:3", 1, *CONF), name="n2")
        until(lambda: a.world_ready(2) is not None, 120, "2 nodes running")
        t_new = time.time()
        n3 = a.start(node_flags("127.0.0.4", port, "1:3", 1, *CONF), name="n3")
        until(lambda: a.world_ready(3) is not None, 120, "the third node taken in")
        att3 = a.world_ready(3)
        assert att3 is not None
        print(f"new node started -> 3 workers past init_process_group: "
              f"{max(a.inits(att3).values()) - t_new:.3f}s (includes its cold start)")
        n2_workers = [s["pid"] for s in a.starts() if s["world"] == 3 and s["env"]["GROUP_RANK"] == "1"]
        assert len(n2_workers) == 1
        killed_at = time.time()
        os.kill(n2.pid, signal.SIGKILL)
        gone = assert_gone(n2_workers, 1.0)
        print(f"agent SIGKILL -> its workers gone in {gone:.3f}s")
        until(lambda: a.world_ready(2, killed_at) is not None, 60, "survivors at world size 2")
        att = a.world_ready(2, killed_at)
        assert att is not None
        print(f"node lost -> survivors past init_process_group at world size 2: "
              f"{max(a.inits(att).values()) - killed_at:.3f}s (last_call_timeout 1s)")
        a.release()
        for proc in (n1, n3):
            assert a.wait(proc, 60) == 0, a.output(proc)
        out = a.output(n1) + a.output(n3)
        assert "world size 2" in out and "no restart spent" in out
        assert "restart 1/1" not in out  # membership changes never spend the budget


def test_node_lost_with_default_settings_reforms_without_the_last_call(tmp_path: object) -> None:
    """Default ``--rdzv-conf`` (last_call_timeout 30 s): both nodes enter the first round at once
    (max joined); after one node's agent is SIGKILLed the survivor's workers run again at world
    size 2 long before the last call could have ended: every live node of the last round was
    back, so the round formed at once."""
    port = free_port()
    with agents(str(tmp_path)) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "1:2", 2, "--max-restarts", "1"), name="n1")
        n2 = a.start(node_flags("127.0.0.3", port, "1:2", 2, "--max-restarts", "1"), name="n2")
        until(lambda: a.world_ready(4) is not None, 120, "2 nodes x 2 workers running")
        killed_at = time.time()
        os.kill(n2.pid, signal.SIGKILL)
        until(lambda: a.world_ready(2, killed_at) is not None, 60, "the survivor at world size 2")
        att = a.world_ready(2, killed_at)
        assert att is not None
        took = max(a.inits(att).values()) - killed_at
        print(f"node lost -> survivor past init_process_group at world size 2: {took:.3f}s "
              "(default settings)")
        assert took < 15.0, f"{took:.1f}s: the round waited as if for the last call (30 s)"
        a.release()
        assert a.wait(n1, 60) == 0, a.output(n1)


SLOW_FORK_SERVER = """import os, time
with open("/proc/self/cmdline", "rb") as f:
    if b"forkserver.py" in f.read():  # this test's stand-in for a slow torch import
        time.sleep(float(os.environ.get("TEST_FORK_SERVER_DELAY", "0")))
"""


def test_a_joining_node_enters_the_rendezvous_once_its_fork_server_is_warm(tmp_path: Any) -> None:
    """Node 2 joins a job that node 1 runs alone; node 2's fork server, a fresh interpreter
    (``ELASTICSTORE_FORK_SERVER=fresh``: it imports torch itself, as a replacement server does),
    takes 6 s longer to start (a ``sitecustomize`` on its PYTHONPATH). Node 2 joins only once its
    fork server is warm, so node 1's workers go on training meanwhile: its workers of the next
    round start no earlier than 6 s after node 2 was started (before, node 2 joined at once and
    node 1's workers waited in the new round for node 2's import)."""
    delay = 6.0
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_FORK_SERVER)
    port = free_port()
    (tmp_path / "run").mkdir()
    with agents(str(tmp_path / "run")) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "1:2", 1, "--max-restarts", "1"), name="n1")
        until(lambda: a.world_ready(1) is not None, 120, "node 1 running alone")
        started = time.time()
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(slow), os.environ.get("PYTHONPATH")])),
               "TEST_FORK_SERVER_DELAY": str(delay), "ELASTICSTORE_FORK_SERVER": "fresh"}
        n2 = a.start(node_flags("127.0.0.3", port, "1:2", 1, "--max-restarts", "1"), name="n2", env=env)
        until(lambda: a.world_ready(2, started) is not None, 120, "both nodes in one round")
        att = a.world_ready(2, started)
        assert att is not None
        rank0 = os.path.join(a.dir, f"start-{att}-0.json")  # node 1's worker of the new round
        waited = os.path.getmtime(rank0) - started
        print(f"node 2 started -> node 1's next-round worker started {waited:.2f}s later "
              f"(node 2's fork server delayed {delay:g}s)")
        assert waited >= delay, f"node 1's round ended {waited:.2f}s after node 2 started"
        a.release()
        for proc in (n1, n2):
            assert a.wait(proc, 60) == 0, a.output(proc)


def _joined(port: int, round_: int = 1) -> bool:
    """Whether a node waits in round ``round_`` of run ``job`` (its join key is there)."""
    from elasticstore import Store, StoreNetworkError

    try:
        with Store("127.0.0.2", port, timeout=timedelta(seconds=5)) as store:
            return bool(store.list_keys(f"rdzv/job/join/{round_}/"))
    except StoreNetworkError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_while_waiting_for_a_second_node_exits_at_once(tmp_path: object, sig: int) -> None:
    """An agent waiting in the rendezvous for a node that never comes (its own join timeout far
    off) stops within seconds of SIGINT/SIGTERM, with no traceback."""
    port = free_port()
    with agents(str(tmp_path)) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "2", 1, "--rdzv-conf", "join_timeout=120"),
                     name="n1")
        until(lambda: _joined(port), 120, "the agent waiting in round 1")
        sent = time.monotonic()
        n1.send_signal(sig)
        code = a.wait(n1, 60)
        took = time.monotonic() - sent
        out = a.output(n1)
        print(f"{signal.Signals(sig).name} in the rendezvous -> agent exited in {took:.2f}s")
        assert code == 128 + sig, out
        assert "Traceback" not in out and "Error" not in out.split("in the rendezvous", 1)[-1], out
        assert took < 5.0, out
