"""In-memory snapshots (``elasticstore.train.Snapshots``) with real agents and workers
(``helpers/programs/snapshot_train.py``): a killed worker's group resumes from the newest step,
with a state whose size changes and that holds tensors and plain objects; never more than
``KEEP_PER_RANK`` snapshots per local rank; a node lost at world size 4 resumes at world size 2
from the surviving node's memory with the sampler's exact position; the agent's memory is gone
after it ends, also after a SIGKILL; a new job, or memory with nothing newer that reads, restores
the disk checkpoint (source "disk"). Every test runs its agents with their own snapshot root under
/dev/shm and checks it is empty at the end."""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from agent_nodes import Agents, agents, alive, assert_gone, free_port, node_flags, until
from paths import program

from elasticstore.agent.snapshots import (CREATING, CREATING_GRACE_S, OWNER, PREFIX, ROOT_ENV,
                                          remove_stale)

TRAIN = program("snapshot_train.py")
CONF = ["--rdzv-conf", "last_call_timeout=1"]


def records(workdir: str, kind: str, attempt: int | None = None) -> dict[int, Any]:
    """rank -> the newest attempt's (or ``attempt``'s) ``<kind>-<attempt>-<rank>.json``."""
    found: dict[int, tuple[int, Any]] = {}
    for path in glob.glob(os.path.join(workdir, f"{kind}-*-*.json")):
        _, att_s, rank_s = os.path.basename(path)[:-5].split("-")
        att, rank = int(att_s), int(rank_s)
        if (attempt is None or att == attempt) and att >= found.get(rank, (-1, None))[0]:
            with open(path) as f:
                found[rank] = (att, json.load(f))
    return {rank: value for rank, (_, value) in found.items()}


def done_step(workdir: str, attempt: int, rank: int) -> int:
    try:
        with open(os.path.join(workdir, f"done-{attempt}-{rank}")) as f:
            return int(f.read() or 0)
    except FileNotFoundError:
        return 0


def snapshot_dirs(root: str) -> list[str]:
    return glob.glob(os.path.join(root, PREFIX + "*"))


def processes_naming(text: str) -> list[int]:
    """Pids of processes whose command line holds ``text`` (e.g. a snapshot directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return [pid for pid in found if alive(pid)]


def round_at_world_size_4(workdir: str) -> int | None:
    """1 + the attempt whose 4 workers restored (1 + : attempt 0 must read as found)."""
    return next((att + 1 for att in range(4) if len(records(workdir, "restore", att)) == 4), None)


def finish(a: Agents, procs: list[subprocess.Popen[bytes]], timeout: float = 150) -> None:
    for proc in procs:
        assert a.wait(proc, timeout) == 0, a.output(proc)[-4000:]


@pytest.mark.timeout(240)
def test_worker_killed_resumes_from_the_newest_step(tmp_path: Path, shm_root: str) -> None:
    """One node, 2 workers; rank 1 exits before step 7: the restarted group restores step 6 from
    this node's memory, exactly (a payload whose size changes every step, plain objects), and
    trains every sample once per epoch; no local rank ever had more than 2 snapshots."""
    workdir = str(tmp_path)
    with agents(workdir) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"],
                        ["--dir", workdir, "--fail-at-step", "7", "--fail-rank", "1"],
                        env={ROOT_ENV: shm_root}, script=TRAIN)
        finish(a, [agent])
        out = a.output(agent)
    first, second = records(workdir, "restore", 0), records(workdir, "restore", 1)
    assert all(r["step"] is None for r in first.values()) and len(first) == 2, out[-4000:]
    assert {rank: (r["step"], r["source"], r["exact"]) for rank, r in second.items()} == {
        0: (6, "memory", True), 1: (6, "memory", True)}, out[-4000:]
    results = records(workdir, "result")
    assert len(results) == 2
    for r in results.values():
        assert r["counts_ok"] and r["steps"] == 2 * 256 // 16
        assert 1 <= r["most_files"] <= r["keep"] == 2


@pytest.mark.timeout(300)
def test_node_lost_resumes_from_the_surviving_nodes_memory_at_another_world_size(
        tmp_path: Path, shm_root: str) -> None:
    """2 nodes x 2 workers (--nnodes 1:2); the agent of 127.0.0.3 is SIGKILLed mid-run: the
    other node resumes at world size 2 from the newest step its memory holds, and the sampler's
    position makes every sample of each epoch trained on exactly once."""
    workdir, port = str(tmp_path), free_port()
    args = ["--dir", workdir, "--dataset-size", "512", "--step-time", "0.1"]
    env = {ROOT_ENV: shm_root}
    with agents(workdir) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "1:2", 2, *CONF, "--max-restarts", "1"), args,
                     name="n1", env=env, script=TRAIN)
        n2 = a.start(node_flags("127.0.0.3", port, "1:2", 2, *CONF, "--max-restarts", "1"), args,
                     name="n2", env=env, script=TRAIN)
        at4 = until(lambda: round_at_world_size_4(workdir), 120, "a round at world size 4") - 1
        until(lambda: min(done_step(workdir, at4, r) for r in range(4)) >= 3, 60,
              "3 steps at world size 4")
        os.kill(n2.pid, signal.SIGKILL)
        assert a.wait(n2, 10) == -signal.SIGKILL
        finish(a, [n1])
        out = a.output(n1)
    held = max(done_step(workdir, at4, r) for r in (0, 1))  # node 1's ranks at world size 4
    after = records(workdir, "restore")
    assert set(after) >= {0, 1} and all(after[r]["world"] == 2 for r in (0, 1)), out[-4000:]
    steps = {after[r]["step"] for r in (0, 1)}
    assert len(steps) == 1 and held <= steps.pop() <= held + 1, (held, after)
    assert all(after[r]["source"] == "memory" and after[r]["exact"] for r in (0, 1)), after
    results = records(workdir, "result")
    assert all(results[r]["counts_ok"] for r in (0, 1)), results


@pytest.mark.timeout(300)
def test_node_joining_gets_the_newest_step_from_a_peer(tmp_path: Path, shm_root: str) -> None:
    """One node trains alone (--nnodes 1:2, 1 worker); a second node joins mid-run: in the new
    round at world size 2 the joining rank, with no memory of its own, gets the newest step by
    broadcast from rank 0, which reads it from its node's memory."""
    workdir, port = str(tmp_path), free_port()
    args = ["--dir", workdir, "--dataset-size", "512", "--step-time", "0.1"]
    env = {ROOT_ENV: shm_root}
    with agents(workdir) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "1:2", 1, *CONF), args, name="n1", env=env,
                     script=TRAIN)
        until(lambda: done_step(workdir, 0, 0) >= 3, 120, "3 steps at world size 1")
        n2 = a.start(node_flags("127.0.0.3", port, "1:2", 1, *CONF), args, name="n2", env=env,
                     script=TRAIN)
        finish(a, [n1, n2])
        out = a.output(n1) + a.output(n2)
    after = records(workdir, "restore")
    assert set(after) == {0, 1} and after[1]["world"] == 2, out[-4000:]
    assert after[0]["step"] == after[1]["step"] >= 3, after
    assert (after[0]["source"], after[1]["source"], after[1]["detail"]) == (
        "memory", "peer", "rank 0"), after
    assert after[0]["exact"] and after[1]["exact"], after
    results = records(workdir, "result")
    assert all(results[r]["counts_ok"] for r in (0, 1)), results


@pytest.mark.timeout(180)
def test_agent_sigkilled_leaves_nothing_in_shared_memory(tmp_path: Path, shm_root: str) -> None:
    """The agent's snapshot directory holds snapshots; a SIGKILL of the agent alone: its
    workers die with it, and the reaper removes the directory, then exits."""
    workdir = str(tmp_path)
    with agents(workdir) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "2"],
                        ["--dir", workdir, "--epochs", "1000", "--step-time", "0.05"],
                        env={ROOT_ENV: shm_root}, script=TRAIN)
        until(lambda: len(records(workdir, "restore")) == 2, 120, "both workers restored")
        [directory] = snapshot_dirs(shm_root)
        until(lambda: len(glob.glob(os.path.join(directory, "step-*.snap"))) >= 2, 60,
              "snapshots in shared memory")
        reapers = processes_naming(directory)
        assert reapers, "no process watches the snapshot directory"
        os.kill(agent.pid, signal.SIGKILL)
        assert a.wait(agent, 10) == -signal.SIGKILL
        t0 = time.monotonic()
        until(lambda: not os.path.lexists(directory), 30, "the snapshot directory removed")
        took = time.monotonic() - t0
        assert_gone(reapers, 10.0)
        assert processes_naming(directory) == []
    print(f"agent SIGKILL -> snapshot directory removed in {took:.3f}s")


def test_stale_directories_of_dead_agents_are_removed(shm_root: str) -> None:
    """What the next agent's start does when a reaper was killed too: an area whose owner lock
    nobody holds (its owner is gone) is removed, also one left half made; one whose lock a running
    process holds is kept, and so is a directory with no owner file (not judged), and one being
    made now whose owner file is not locked yet (another agent starting at the same moment: it
    was once locked here, and that agent failed its start, "cannot lock")."""
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); "
            "sys.stdin.read() if sys.argv[2] == 'wait' else None")
    dead, live, legacy = (os.path.join(shm_root, f"{PREFIX}job.{n}") for n in ("a", "b", "c"))
    half_made = os.path.join(shm_root, f"{CREATING}d")  # its agent died before renaming it
    being_made = os.path.join(shm_root, f"{CREATING}e")  # its agent has not locked it yet
    for d in (dead, live, legacy, half_made, being_made):
        os.mkdir(d)
        Path(d, "step-000000000001.local-0.snap").write_bytes(b"x")
    Path(being_made, OWNER).touch()
    owners = [subprocess.Popen([sys.executable, "-c", hold, os.path.join(d, OWNER), how],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
              for d, how in ((dead, "exit"), (live, "wait"), (half_made, "exit"))]
    try:
        for proc in owners:
            assert proc.stdout is not None and proc.stdout.readline() == b"locked\n"
        assert owners[0].wait(10) == 0 and owners[2].wait(10) == 0
        made_at = time.time() - CREATING_GRACE_S - 10
        os.utime(half_made, (made_at, made_at))  # died a while ago
        assert sorted(remove_stale(shm_root)) == sorted([dead, half_made])
        assert not os.path.exists(dead) and os.path.exists(live) and os.path.exists(legacy)
        fd = os.open(os.path.join(being_made, OWNER), os.O_RDWR)
        try:  # untouched: its agent takes the lock
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        for proc in owners:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.close()  # the holder's read ends: it exits
            proc.wait(10)
            proc.stdout.close()
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(legacy, ignore_errors=True)
        shutil.rmtree(being_made, ignore_errors=True)


def test_tensors_of_every_kind_and_plain_objects_round_trip(shm_root: str) -> None:
    """In one process, into a real directory under /dev/shm: strided tensors of several dtypes
    (non-contiguous, 0-d, empty), a sparse tensor and a model's state_dict (pickled as they are),
    plain objects; a state that grows past the buffer's spare room and shrinks to under half of it;
    never more than KEEP_PER_RANK files, and the newest step comes back exactly."""
    import torch
    from torch import nn

    from elasticstore.train import KEEP_PER_RANK, SnapshotSettings, Snapshots
    from elasticstore.train.snapshots.fileformat import list_snapshots, read_snapshot

    model = nn.Linear(3, 2)

    def state(step: int) -> dict[str, Any]:
        big = 1 + (step % 3) * 40_000  # 4 B, 160 kB, 320 kB: remapped up and down
        return {"step": step, "t": torch.arange(12.0).reshape(3, 4).t() + step,
                "bf16": torch.full((5,), step, dtype=torch.bfloat16),
                "flags": torch.tensor([True, False]), "scalar": torch.tensor(step),
                "empty": torch.empty(0, 7), "big": torch.full((big,), float(step)),
                "sparse": torch.eye(3).to_sparse() * step, "model": model.state_dict(),
                "plain": {"name": "x" * step, "list": [step, (1, None), 2.5]}}

    directory = os.path.join(shm_root, "node")
    os.mkdir(directory)
    snaps = Snapshots(settings=SnapshotSettings(directory, 0))
    try:
        for step in range(1, 10):
            assert snaps.snapshot(lambda: state(step), step)
            assert len(list_snapshots(directory)) <= KEEP_PER_RANK
        assert [s for s, _, _ in list_snapshots(directory)] == [8, 9]
        restored = snaps.restore()
        assert restored is not None and (restored.step, restored.source) == (9, "memory")
        _, _, again = read_snapshot(os.path.join(directory, "step-000000000009.local-0.snap"))
        for got in (restored.state, again):
            want = state(9)
            assert got.keys() == want.keys()
            for key, value in want.items():
                if isinstance(value, torch.Tensor):
                    assert got[key].dtype == value.dtype and torch.equal(
                        got[key].to_dense(), value.to_dense()), key
                elif key == "model":
                    assert all(torch.equal(got[key][k], v) for k, v in value.items())
                else:
                    assert got[key] == value, key
    finally:
        snaps.close()
        shutil.rmtree(directory)


def test_disk_checkpoints_written_in_the_background_hold_their_own_step(
        tmp_path: Path, shm_root: str) -> None:
    """A disk checkpoint every step of a 16 MB state: the background writer lags behind the
    snapshots, whose memory it still reads is set aside, not reused; every checkpoint holds the
    state of its own step, and the snapshot directory never holds more than KEEP_PER_RANK
    snapshots nor keeps a temporary file."""
    import torch

    from elasticstore.train import KEEP_PER_RANK, SnapshotSettings, Snapshots, load_checkpoint
    from elasticstore.train.snapshots.fileformat import list_snapshots

    directory = os.path.join(shm_root, "node")
    os.mkdir(directory)
    ckpt = tmp_path / "ckpt"
    seen: list[int] = []
    with Snapshots(settings=SnapshotSettings(directory, 0), checkpoint_dir=ckpt,
                   checkpoint_every=1, keep_checkpoints=8, write_checkpoints=True) as snaps:
        for step in range(1, 7):
            snaps.snapshot({"w": torch.full((4 << 20,), float(step)), "step": step}, step)
            seen.append(len(list_snapshots(directory)))
    assert max(seen) <= KEEP_PER_RANK
    # (dot files are the area's records, not snapshots: ".skipped.local-0", the agent's metric,
    # when the writer lagged; ".checkpoint.local-0", where the agent writes at a signal)
    assert sorted(n for n in os.listdir(directory) if not n.startswith(".")) == [
        "step-000000000005.local-0.snap", "step-000000000006.local-0.snap"]
    loaded = load_checkpoint(ckpt)
    assert loaded is not None and loaded.step == 6
    for name in sorted(os.listdir(ckpt)):
        state = torch.load(ckpt / name, weights_only=True)["state"]
        assert bool((state["w"] == state["step"]).all()), name
    shutil.rmtree(directory)


@pytest.mark.timeout(300)
def test_fresh_job_restores_the_previous_jobs_disk_checkpoint(tmp_path: Path,
                                                              shm_root: str) -> None:
    """A job of 1 worker writes a disk checkpoint every 4 steps and stops after step 10; its agent
    ends and removes its shared memory (the snapshots of steps 9 and 10 with it). A new job of 2
    workers on the same checkpoint directory has no snapshot at all: both ranks restore step 8
    from disk, exactly, and train every sample once per epoch from there."""
    from elasticstore.train.checkpoint import list_checkpoints

    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    disk = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"]
    env = {ROOT_ENV: shm_root}
    with agents(str(tmp_path)) as a:
        job1 = a.start(["--standalone", "--nproc-per-node", "1"],
                       ["--dir", str(first), *disk, "--stop-at-step", "10"], name="job1", env=env,
                       script=TRAIN)
        finish(a, [job1])
        out1 = a.output(job1)
        assert records(str(first), "restore") == {0: {"world": 1, "step": None}}, out1[-4000:]
        assert done_step(str(first), 0, 0) == 10, out1[-4000:]
        assert [step for step, _ in list_checkpoints(ckpt)] == [4, 8], out1[-4000:]
        assert snapshot_dirs(shm_root) == []  # the memory snapshots went with the agent
        job2 = a.start(["--standalone", "--nproc-per-node", "2"], ["--dir", str(second), *disk],
                       name="job2", env=env, script=TRAIN)
        finish(a, [job2])
        out2 = a.output(job2)
    restored = records(str(second), "restore", 0)
    path = str(ckpt / "ckpt-000000000008.pt")
    assert {rank: (r["world"], r["step"], r["source"], r["detail"], r["exact"])
            for rank, r in restored.items()} == {0: (2, 8, "disk", path, True),
                                                 1: (2, 8, "disk", path, True)}, out2[-4000:]
    results = records(str(second), "result", 0)
    assert len(results) == 2 and all(r["counts_ok"] and r["steps"] > 8 for r in results.values())


def test_restore_reads_disk_when_memory_holds_nothing_newer(tmp_path: Path,
                                                            shm_root: str) -> None:
    """In one process (no process group): steps 1 to 10 snapshotted, checkpoints at 4 and 8. The
    memory's step 10 wins while it is there; with no snapshot area, an empty one, one whose
    snapshots do not read (overwritten), or one holding only an older step, ``restore`` returns
    the disk checkpoint of step 8, its state exactly."""
    import torch

    from elasticstore.train import SnapshotSettings, Snapshots

    def state(step: int) -> dict[str, Any]:
        return {"step": step, "w": torch.full((1000,), float(step)),
                "objects": {"name": "s" * step, "nested": [step, {"k": step * 0.5}]}}

    def restore(directory: str | None) -> Any:
        with Snapshots(settings=SnapshotSettings(directory, 0), checkpoint_dir=ckpt,
                       checkpoint_every=4, write_checkpoints=False) as snaps:
            return snaps.restore()

    def assert_disk_8(got: Any) -> None:
        assert got is not None and (got.step, got.source, got.detail) == (
            8, "disk", str(ckpt / "ckpt-000000000008.pt")), got
        want = state(8)
        assert got.state["step"] == 8 and got.state["objects"] == want["objects"]
        assert torch.equal(got.state["w"], want["w"])

    ckpt = tmp_path / "ckpt"
    node, empty = os.path.join(shm_root, "node"), os.path.join(shm_root, "empty")
    os.mkdir(node)
    os.mkdir(empty)
    try:
        with Snapshots(settings=SnapshotSettings(node, 0), checkpoint_dir=ckpt, checkpoint_every=4,
                       write_checkpoints=True) as snaps:
            for step in range(1, 11):
                snaps.snapshot(lambda: state(step), step)
        snap_files = sorted(glob.glob(os.path.join(node, "step-*.snap")))
        assert [os.path.basename(p)[:17] for p in snap_files] == ["step-000000000009",
                                                                 "step-000000000010"]
        memory = restore(node)
        assert memory is not None and (memory.step, memory.source) == (10, "memory"), memory

        assert_disk_8(restore(None))  # no snapshot area: the process's own memory, empty
        assert_disk_8(restore(empty))  # a fresh agent's area

        for path in snap_files:  # the area's snapshots are there but do not read
            Path(path).write_bytes(b"not a snapshot" * 10)
        with pytest.warns(RuntimeWarning, match="skipping snapshot"):
            assert_disk_8(restore(node))

        for path in snap_files:
            os.unlink(path)
        with Snapshots(settings=SnapshotSettings(node, 0)) as older:  # memory behind the disk
            older.snapshot(state(5), 5)
        assert_disk_8(restore(node))
    finally:
        shutil.rmtree(node, ignore_errors=True)
        shutil.rmtree(empty, ignore_errors=True)
