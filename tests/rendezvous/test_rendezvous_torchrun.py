"""torch's own agent with our rendezvous as a plugin: ``torchrun --rdzv-backend=elasticstore``
runs a 2-node x 2-worker gloo job; each node is a torchrun process on its own loopback address,
in its own process group (killed as a group, by pgid, at the end). torch's agent starts each
worker in a session of its own: a node lost whole is its group and its agent's children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agent_nodes import free_port
from paths import program

pytestmark = pytest.mark.slow

TRAIN = program("rdzv_train.py")



def torchrun(addr: str, endpoint: str, nnodes: str, outdir: Path, steps: int, step_s: float,
             backend: str = "elasticstore", conf: str = "") -> subprocess.Popen[bytes]:
    log = open(outdir / f"torchrun-{addr}.log", "wb")
    args = [
        sys.executable, "-m", "torch.distributed.run", f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}", "--rdzv-id=job", f"--nnodes={nnodes}",
        "--nproc-per-node=2", f"--local-addr={addr}", "--max-restarts=3",
        "--monitor-interval=0.1",
        f"--rdzv-conf=last_call_timeout=0.5,join_timeout=60{conf}",
        TRAIN, str(outdir), str(steps), str(step_s),
    ]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    finally:
        log.close()


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # workers left in the group, if any
        except ProcessLookupError:
            pass


def logs(outdir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                     for p in sorted(outdir.glob("torchrun-*.log")))


def wait_files(outdir: Path, pattern: str, count: int, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(p.name for p in outdir.glob(pattern))
        if len(found) >= count:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {count} x {pattern} in {timeout}s\n{logs(outdir)}")


def test_two_nodes_run_to_completion(tmp_path: Path) -> None:
    endpoint = f"127.0.0.2:{free_port('127.0.0.2')}"
    procs = [torchrun(a, endpoint, "2", tmp_path, 3, 0.0) for a in ("127.0.0.2", "127.0.0.3")]
    try:
        for proc in procs:
            assert proc.wait(timeout=120) == 0, logs(tmp_path)
        assert sorted(p.name for p in tmp_path.glob("done-*")) == [f"done-{r}-4" for r in range(4)]
    finally:
        stop(procs)


def test_two_nodes_on_etcd(tmp_path: Path) -> None:
    import etcd_cluster

    with etcd_cluster.running(1) as cluster:
        endpoint = cluster.endpoints[0]
        procs = [torchrun(a, endpoint, "2", tmp_path, 3, 0.0, backend="elasticstore-etcd",
                          conf=",lease_ttl=2") for a in ("127.0.0.2", "127.0.0.3")]
        try:
            for proc in procs:
                assert proc.wait(timeout=120) == 0, logs(tmp_path)
            assert sorted(p.name for p in tmp_path.glob("done-*")) == [
                f"done-{r}-4" for r in range(4)
            ]
        finally:
            stop(procs)


def test_survivor_finishes_at_the_smaller_size(tmp_path: Path) -> None:
    endpoint = f"127.0.0.2:{free_port('127.0.0.2')}"
    procs = [torchrun(a, endpoint, "1:2", tmp_path, 40, 0.25) for a in ("127.0.0.2", "127.0.0.3")]
    try:
        wait_files(tmp_path, "started-*-4", 4, 120)
        killed = time.monotonic()
        os.killpg(procs[1].pid, signal.SIGKILL)  # the agent and its workers
        procs[1].wait(timeout=30)
        started = wait_files(tmp_path, "started-*-2", 2, 60)
        print(f"node SIGKILLed -> survivor's workers running at world size 2: "
              f"{time.monotonic() - killed:.2f}s")
        assert started == ["started-0-2", "started-1-2"]
        assert procs[0].wait(timeout=120) == 0, logs(tmp_path)
        assert sorted(p.name for p in tmp_path.glob("done-*")) == ["done-0-2", "done-1-2"]
    finally:
        stop(procs)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torch's workers of an agent)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def kill_groups(pgids: list[int]) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def gone(pids: list[int], timeout: float) -> list[int]:
    """Those of ``pids`` still running (zombies count as gone) after up to ``timeout`` s."""
    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_store_host_lost_survivors_go_on(tmp_path: Path) -> None:
    """The node whose agent hosts the rendezvous store (the first endpoint) is lost with its
    workers: torch's agents on the two survivors (every node given all three endpoints) learn it
    from ``num_nodes_waiting`` or, when their workers failed first, spend a restart; either way
    ``next_rendezvous`` moves the store to a survivor, and a round of 4 workers forms and
    finishes."""
    addrs = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
    port = free_port(addrs[0])
    endpoint = ",".join(f"{a}:{port}" for a in addrs)
    procs = [torchrun(a, endpoint, "2:3", tmp_path, 40, 0.25) for a in addrs]
    workers: list[int] = []
    try:
        wait_files(tmp_path, "started-*-6", 6, 180)
        for stale in tmp_path.glob("started-*-4"):  # of a round of two that formed first, if any
            stale.unlink()
        workers = children(procs[0].pid)
        assert len(workers) == 2, (workers, logs(tmp_path))
        killed = time.monotonic()
        kill_groups([procs[0].pid, *workers])  # the host: its agent's group and its workers
        procs[0].wait(timeout=30)
        assert gone(workers, 10) == []
        started = wait_files(tmp_path, "started-*-4", 4, 90)
        print(f"store host SIGKILLed -> survivors' workers running at world size 4: "
              f"{time.monotonic() - killed:.2f}s")
        assert started == [f"started-{r}-4" for r in range(4)]
        for proc in procs[1:]:
            assert proc.wait(timeout=120) == 0, logs(tmp_path)
        assert sorted(p.name for p in tmp_path.glob("done-*")) == [f"done-{r}-4" for r in range(4)]
        moved = f"the store moved from {addrs[0]}:{port} to "
        for a in addrs[1:]:
            log = (tmp_path / f"torchrun-{a}.log").read_text(errors="replace")
            assert moved in log, logs(tmp_path)
    finally:
        workers += [c for proc in procs if proc.poll() is None for c in children(proc.pid)]
        stop(procs)
        kill_groups(workers)
