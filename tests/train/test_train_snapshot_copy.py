"""The copy of a large snapshot (``train/snapshots/copying.py``: a few threads, ranges of one
tensor each) keeps a snapshot atomic: a writer SIGKILLed in the middle of its copies leaves only
complete snapshots, each exactly its step's state, and the next process of the same local rank
removes what the killed one left and resumes from the newest complete step. The ranges cover
every element once, whatever the sizes and the number of threads."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from paths import program

WRITER = program("snapshot_writer.py")


def check_complete(directory: str) -> int:
    """Every complete snapshot in ``directory`` holds its own step's state; the newest step."""
    import torch

    from elasticstore.train import KEEP_PER_RANK
    from elasticstore.train.snapshots.fileformat import list_snapshots, read_snapshot

    found = list_snapshots(directory)
    assert 1 <= len(found) <= KEEP_PER_RANK, found
    for step, local, path in found:
        got, ident, state = read_snapshot(path)
        assert (got, local, ident["step"], state["step"]) == (step, 0, step, step)
        for key in "abci":
            assert bool(torch.all(state[key] == step)), f"{path}: {key} is not step {step}'s"
    return found[-1][0]


@pytest.mark.slow  # 5-30 s: a torch process per kill, on a loaded 2-core machine
def test_writer_killed_mid_copy_leaves_only_complete_snapshots(shm_root: str) -> None:
    """A 32 MB state, snapshots in a loop (the copy is nearly all of the writer's time): killed
    as soon as a snapshot's temporary file is seen (a copy in progress), until one kill lands in a
    copy (the file is left), at most 4 writers; then a new ``Snapshots`` restores the newest
    complete step and removes the file."""
    from elasticstore.train import SnapshotSettings, Snapshots
    from elasticstore.train.snapshots.fileformat import stale_tmp_files

    directory = os.path.join(shm_root, "node")
    os.mkdir(directory)
    proc: subprocess.Popen[str] | None = None
    try:
        mid_copy = False
        for _ in range(4):
            proc = subprocess.Popen([sys.executable, WRITER, directory, "32", "100000"],
                                    stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            deadline = time.monotonic() + 60
            while int(proc.stdout.readline() or -1) < 4:  # past the first buffers' creation
                assert proc.poll() is None and time.monotonic() < deadline, "no snapshots"
            seen = time.monotonic() + 10  # a copy starts every step: tens of ms apart
            while not stale_tmp_files(directory, 0) and time.monotonic() < seen:
                pass
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            proc = None
            check_complete(directory)
            if stale_tmp_files(directory, 0):
                mid_copy = True
                break
        assert mid_copy, "no kill landed in a copy"
        newest = check_complete(directory)
        snaps = Snapshots(settings=SnapshotSettings(directory, 0))
        try:
            restored = snaps.restore()
            assert restored is not None and (restored.step, restored.source) == (newest, "memory")
            state = restored.state
            for key in "abci":
                state[key].fill_(newest + 1)
            state["step"] = newest + 1
            assert snaps.snapshot(state, newest + 1)
            assert stale_tmp_files(directory, 0) == []
        finally:
            snaps.close()
        assert check_complete(directory) == newest + 1
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def test_copy_ranges_cover_every_element_once() -> None:
    """``_split`` over random sizes (empty, odd, non-contiguous) and 2-4 threads: copying the
    parts reproduces every tensor, and the parts hold every byte once."""
    import torch

    from elasticstore.train.snapshots.copying import _split, copy_into

    rng = random.Random(1)
    for trial in range(200):
        src = [torch.randn(rng.randint(0, 3000)) if rng.random() < 0.8 else
               torch.randn(30, 40).t() for _ in range(rng.randint(1, 6))]
        dst = [torch.zeros(t.shape) for t in src]
        nbytes = sum(t.nbytes for t in src)
        parts = _split(dst, src, nbytes, rng.randint(2, 4))
        assert sum(t.nbytes for p in parts for t in p[0]) == nbytes, trial
        for views, tensors in parts:
            for view, tensor in zip(views, tensors):
                view.copy_(tensor)
        assert all(torch.equal(d, s) for d, s in zip(dst, src)), trial
    # the threads' path itself, on a state over PARALLEL_BYTES
    src = [torch.randn(3_000_001), torch.randn(1000, 1000).t(), torch.arange(10**6)]
    dst = [torch.empty(t.shape, dtype=t.dtype) for t in src]
    copy_into(dst, src, sum(t.nbytes for t in src), True)
    assert all(torch.equal(d, s) for d, s in zip(dst, src))


@pytest.mark.slow  # 5-25 s: a torch process and up to 15 s of reads, on a loaded 2-core machine
def test_a_snapshot_reused_while_read_is_refused_never_torn(shm_root: str) -> None:
    """A reader (the agent's flush at preemption, a replica sender) opens a complete snapshot, and
    the writer takes that file's memory for a newer step while it reads: ``read_snapshot`` raises
    ``ValueError`` (the header changed under it), never a mix of two steps. The reader reads the
    oldest complete file (the next to be reused) and the newest in turn, over and over, while a
    writer takes snapshots of a 32 MB state in a loop. (Before the check, a read of the
    oldest returned step 3's tensors part overwritten with step 5's.)"""
    import torch

    from elasticstore.train.snapshots.fileformat import list_snapshots, read_snapshot

    directory = os.path.join(shm_root, "node")
    os.mkdir(directory)
    # a pause after each snapshot: a read of the newest (0.01-0.5 s, with the machine's load)
    # has time to finish before its memory is taken, two snapshots later
    proc = subprocess.Popen([sys.executable, WRITER, directory, "32", "100000", "0.3"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while int(proc.stdout.readline() or -1) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, "no snapshots"
        whole = refused = reads = 0
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (refused < 3 or whole < 5):
            found = list_snapshots(directory)
            if not found:
                continue
            reads += 1
            step, _, path = found[0 if reads % 2 else -1]  # the oldest, the newest in turn
            try:
                got, _, state = read_snapshot(path)
            except (ValueError, FileNotFoundError):
                refused += 1
                continue
            assert got == state["step"] == step, (got, state["step"], step)
            for key in "abci":
                assert bool(torch.all(state[key] == step)), f"{key}: torn read of step {step}"
            whole += 1
        assert proc.poll() is None, "the writer stopped"
        assert whole > 0, f"no read got a whole snapshot ({refused} refused)"
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
