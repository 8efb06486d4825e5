"""Snapshots and agents in containers, with real agents and workers
(``helpers/programs/container_train.py``):

- a second agent in another PID namespace (``unshare --pid``, as ``docker --ipc=host`` gives two
  containers one ``/dev/shm``) leaves a live agent's area alone: staleness is a lock its owner
  holds, not a pid;
- without ``/dev/shm`` the per-agent files (the heartbeat board) go to an area under the
  temporary directory that the reaper removes after an agent SIGKILL;
- two agents in two PID namespaces (both pid 1) on one address are two nodes;
- a ``/dev/shm`` smaller than a snapshot (a real 8 MiB tmpfs): no bus error, a warning that names
  the bytes and the fix, nothing left behind, the job goes on with its disk checkpoints;
- disk checkpoints slower than the steps: the snapshot memory stays bounded and the writer says
  it skipped steps.

The namespace and mount tests need root (``unshare``, ``mount``); they are skipped otherwise.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_nodes import agents, free_port, until
from paths import program

from elasticstore.agent.snapshots import PREFIX, ROOT_ENV
from elasticstore.train import KEEP_PER_RANK

TRAIN = program("container_train.py")
ROOT = os.geteuid() == 0 and shutil.which("unshare") is not None
needs_root = pytest.mark.skipif(not ROOT, reason="needs root and unshare")


def results(workdir: str) -> dict[int, Any]:
    found = {}
    for path in glob.glob(os.path.join(workdir, "result-*.json")):
        with open(path) as f:
            r = json.load(f)
        found[r["rank"]] = r
    return found


def in_pid_namespace(workdir: str, name: str, flags: list[str], script_args: list[str],
                     env: dict[str, str]) -> subprocess.Popen[bytes]:
    """An agent as pid 1 of a new PID namespace (its own /proc), in a session of its own."""
    with open(os.path.join(workdir, f"{name}.out"), "wb") as out:
        return subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m",
             "elasticstore.run", *flags, TRAIN, *script_args],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir,
            env=dict(os.environ, **env))


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def output(workdir: str, name: str) -> str:
    with open(os.path.join(workdir, f"{name}.out"), errors="replace") as f:
        return f.read()


@pytest.mark.slow  # ~20 s on 2 shared cores
@needs_root
@pytest.mark.timeout(180)
def test_agent_in_another_pid_namespace_leaves_a_live_area_alone(tmp_path: Path,
                                                                 shm_root: str) -> None:
    """Agent A trains (snapshots in its area); agent B starts in a PID namespace of its own on
    the same root, where A's pid does not exist, and finishes; A's area (snapshots, heartbeat
    board) is still there and A finishes with exit 0."""
    workdir = str(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    release = str(tmp_path / "release")
    env = {ROOT_ENV: shm_root}
    with agents(workdir) as a:
        first = a.start(["--standalone", "--nproc-per-node", "1", "--heartbeat-timeout", "60"],
                        ["--dir", workdir, "--until-file", release, "--step-time", "0.05"],
                        env=env, script=TRAIN)
        [area] = until(lambda: glob.glob(os.path.join(shm_root, PREFIX + "*")), 60, "A's area")
        until(lambda: glob.glob(os.path.join(area, "step-*.snap")), 60, "A's snapshots")
        board = until(lambda: glob.glob(os.path.join(area, "heartbeats.*")), 60, "A's board")
        second = in_pid_namespace(str(other), "second",
                                  ["--standalone", "--nproc-per-node", "1"],
                                  ["--dir", str(other), "--steps", "3"], env)
        try:
            assert second.wait(120) == 0, output(str(other), "second")[-3000:]
        finally:
            stop_group(second)
        assert os.path.isdir(area) and all(os.path.exists(b) for b in board), \
            output(str(other), "second")[-3000:]
        Path(release).touch()
        assert a.wait(first, 120) == 0, a.output(first)[-3000:]
    assert results(workdir)[0]["steps"] > 0


@pytest.mark.slow  # ~15 s on 2 shared cores
@pytest.mark.timeout(120)
def test_heartbeat_board_without_dev_shm_is_removed_after_agent_sigkill(tmp_path: Path) -> None:
    """No snapshot root (as on a machine without /dev/shm): the heartbeat board lives in an area
    under the temporary directory; a SIGKILL of the agent leaves nothing there."""
    workdir = str(tmp_path / "work")
    tmp = tmp_path / "tmp"
    os.mkdir(workdir)
    tmp.mkdir()
    release = str(tmp_path / "release")
    env = {ROOT_ENV: str(tmp_path / "no-such-root"), "TMPDIR": str(tmp)}
    with agents(workdir) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "1", "--heartbeat-timeout", "60"],
                        ["--dir", workdir, "--until-file", release, "--step-time", "0.05"],
                        env=env, script=TRAIN)
        until(lambda: glob.glob(str(tmp / "**" / "heartbeats.*"), recursive=True), 60,
              "the heartbeat board")
        os.kill(agent.pid, signal.SIGKILL)
        assert a.wait(agent, 10) == -signal.SIGKILL

        def nothing_left() -> bool:
            return not [p for p in glob.glob(str(tmp / "**"), recursive=True)
                        if "heartbeats." in p or PREFIX in p]

        until(nothing_left, 30, f"the board removed: {os.listdir(tmp)}")


@pytest.mark.slow  # ~25 s on 2 shared cores
@needs_root
@pytest.mark.timeout(180)
def test_two_agents_as_pid_1_on_one_address_are_two_nodes(tmp_path: Path) -> None:
    """Two agents, each pid 1 of its own PID namespace, with host networking on one address
    (127.0.0.2) and --nnodes 2: two nodes, one round of world size 2, both exit 0."""
    workdir = str(tmp_path)
    port = free_port()
    flags = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.2:{port}",
             "--local-addr", "127.0.0.2", "--rdzv-id", "job", "--rdzv-conf", "join_timeout=40"]
    procs = []
    try:
        for name in ("one", "two"):
            procs.append(in_pid_namespace(workdir, name, flags, ["--dir", workdir, "--steps", "3"],
                                          {}))
        for proc, name in zip(procs, ("one", "two")):
            assert proc.wait(120) == 0, output(workdir, name)[-3000:]
    finally:
        for proc in procs:
            stop_group(proc)
    found = results(workdir)
    assert sorted(found) == [0, 1] and {r["world"] for r in found.values()} == {2}, found


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[str]:
    """A real 8 MiB tmpfs (a container's small /dev/shm), unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        yield str(mnt)
        assert os.listdir(mnt) == [], f"left in the tmpfs: {os.listdir(mnt)}"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow  # ~20 s on 2 shared cores
@pytest.mark.timeout(120)
def test_snapshot_larger_than_shm_goes_on_with_disk_checkpoints(tmp_path: Path,
                                                                small_tmpfs: str) -> None:
    """A 12 MiB state in an 8 MiB tmpfs: no bus error; one warning that names the bytes needed
    and free and the fix; nothing of the rank's left in the area; the job finishes (exit 0) with
    its disk checkpoints."""
    workdir = str(tmp_path / "work")
    os.mkdir(workdir)
    ckpt = str(tmp_path / "ckpt")
    with agents(workdir) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "1"],
                        ["--dir", workdir, "--steps", "4", "--state-mib", "12",
                         "--checkpoint-dir", ckpt, "--checkpoint-every", "2"],
                        env={ROOT_ENV: small_tmpfs}, script=TRAIN)
        code = a.wait(agent, 90)
        out = a.output(agent)
    assert code == 0, out[-4000:]
    assert out.count("no room for a snapshot") == 1, out[-4000:]
    warning = next(line for line in out.splitlines() if "no room for a snapshot" in line)
    for words in ("bytes are free", "--shm-size", "emptyDir", ROOT_ENV, "disk checkpoints"):
        assert words in warning, warning
    r = results(workdir)[0]
    assert r["names"] == [] and r["checkpoint"] == 4, r


@pytest.mark.slow  # ~22 s on 2 shared cores
@pytest.mark.timeout(120)
def test_lagging_disk_checkpoints_keep_snapshot_memory_bounded(tmp_path: Path,
                                                               shm_root: str) -> None:
    """1 MiB state, a disk checkpoint due every step, each save taking 0.3 s: the snapshot area
    never holds more than KEEP_PER_RANK + 1 files (bytes likewise) for the rank; the writer says
    it skips to the newest (a log line, and the agent's counter on --metrics-port); the last
    step's checkpoint is written."""
    workdir = str(tmp_path)
    ckpt = str(tmp_path / "ckpt")
    release = str(tmp_path / "release")
    mport = free_port("127.0.0.1")

    def skipped() -> float:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return 0.0
        for line in text.splitlines():
            if line.startswith('elasticstore_snapshot_checkpoints_skipped_total{local_rank="0"}'):
                return float(line.split()[-1])
        return 0.0

    with agents(workdir) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "1", "--metrics-port", str(mport)],
                        ["--dir", workdir, "--until-file", release, "--state-mib", "1",
                         "--step-time", "0.02", "--checkpoint-dir", ckpt,
                         "--checkpoint-every", "1", "--slow-disk", "0.3"],
                        env={ROOT_ENV: shm_root}, script=TRAIN)
        until(lambda: skipped() >= 5 or agent.poll() is not None, 60, "5 skipped checkpoints")
        Path(release).touch()
        code = a.wait(agent, 90)
        out = a.output(agent)
    assert code == 0, out[-4000:]
    r = results(workdir)[0]
    print(f"most files {r['most_files']}, most bytes {r['most_bytes']}, steps {r['steps']}")
    assert r["most_files"] <= KEEP_PER_RANK + 1, r
    assert r["most_bytes"] <= (KEEP_PER_RANK + 1) * 1.25 * (1 << 20), r
    assert "skipped: the writer is still on step" in out, out[-3000:]
    assert r["checkpoint"] == r["steps"], r
