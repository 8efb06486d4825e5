"""Checkpoints: atomic saves (a save killed with SIGKILL leaves the previous one loadable), corrupt
files skipped with a warning, pruning, and node-local resume over a real 2-process gloo group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import elasticstore
from elasticstore.train import (CheckpointConflictError, list_checkpoints, load_checkpoint,
                                save_checkpoint)


def test_save_load_keep_and_order(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path / "missing") is None
    assert load_checkpoint(tmp_path) is None
    for step in (9, 10, 100, 1000):
        save_checkpoint(tmp_path, {"w": torch.full((3,), float(step)), "step": step}, step, keep=3)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [10, 100, 1000]
    ckpt = load_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.step == 1000
    assert torch.equal(ckpt.state["w"], torch.full((3,), 1000.0))
    assert os.path.basename(ckpt.path) == "ckpt-000000001000.pt"
    save_checkpoint(tmp_path, {"x": 1}, 1001)  # keep=2
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1000, 1001]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000001000.pt", "ckpt-000000001001.pt"]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, {}, -1)
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, {}, 1, keep=0)


def test_a_save_older_than_the_directory_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    """A new run reusing a directory that holds later steps: the save would be pruned at once and
    return the path of a deleted file, and a resume would load the old run's step."""
    for step in (20, 30):
        save_checkpoint(tmp_path, {"run": 1, "step": step}, step)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(CheckpointConflictError, match=r"later steps \(20, 30\) than step 10"):
        save_checkpoint(tmp_path, {"run": 2, "step": 10}, 10)
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, nothing pruned
    ckpt = load_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.state == {"run": 1, "step": 30}
    again = save_checkpoint(tmp_path, {"run": 1, "step": 30, "again": True}, 30)  # same step: replaced
    assert os.path.exists(again) and [s for s, _ in list_checkpoints(tmp_path)] == [20, 30]
    new_dir = tmp_path / "run2"
    path = save_checkpoint(new_dir, {"run": 2}, 10)
    assert os.path.exists(path)


def test_truncated_and_corrupt_files_are_skipped_with_a_warning(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"v": torch.arange(1000)}, 1, keep=5)
    good = save_checkpoint(tmp_path, {"v": torch.arange(1000)}, 2, keep=5)
    data = Path(good).read_bytes()
    truncated = tmp_path / "ckpt-000000000003.pt"
    truncated.write_bytes(data[: len(data) // 2])
    # Garbage that reads as neither a zip nor a pickle from its first byte: random bytes that
    # began with a pickle's PROTO opcode (1 in 256) made torch warn of the protocol first.
    (tmp_path / "ckpt-000000000004.pt").write_bytes(b"\x00" + os.urandom(4095))
    with pytest.warns(RuntimeWarning, match="skipping checkpoint") as record:
        ckpt = load_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.step == 2
    assert torch.equal(ckpt.state["v"], torch.arange(1000))
    assert len(record) == 2
    # A file renamed to another step is refused too (its payload names its step).
    truncated.unlink()
    (tmp_path / "ckpt-000000000004.pt").unlink()
    os.replace(good, tmp_path / "ckpt-000000000007.pt")
    with pytest.warns(RuntimeWarning, match="holds step 2"):
        ckpt = load_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.step == 1


SAVER = """
import sys, torch
from elasticstore.train import save_checkpoint
directory = sys.argv[1]
save_checkpoint(directory, {"v": torch.full((4,), 1.0)}, 1)
print("saved 1", flush=True)
step = 2
while True:  # large saves until killed
    save_checkpoint(directory, {"v": torch.full((16 * 1024 * 1024,), float(step))}, step)
    step += 1
"""


@pytest.mark.slow
def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "saved 1"
        deadline = time.monotonic() + 60
        partial = None
        while partial is None and time.monotonic() < deadline:  # a temp file being written
            for name in os.listdir(tmp_path):
                if name.endswith(".tmp"):
                    try:
                        if os.path.getsize(tmp_path / name) > 1024 * 1024:
                            partial = name
                    except FileNotFoundError:
                        pass
            time.sleep(0.005)
        assert partial is not None, "no save in progress was seen"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    writing = int(partial.split(".")[1].split("-")[1])
    steps = [step for step, _ in list_checkpoints(tmp_path)]
    assert steps and max(steps) < writing
    ckpt = load_checkpoint(tmp_path)  # no warning: the partial file is not a checkpoint
    assert ckpt is not None and ckpt.step == max(steps)
    assert torch.all(ckpt.state["v"] == float(ckpt.step))
    save_checkpoint(tmp_path, {"v": 0}, writing + 1)  # the next save removes the leftover
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


NODE_LOCAL_WORKER = """
import json, sys
from datetime import timedelta
import torch, torch.distributed as dist
import elasticstore
from elasticstore.train import load_checkpoint_from_any_rank, save_checkpoint
host, port, rank, directory = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
steps = json.loads(sys.argv[5])
store = elasticstore.Store(host, port, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
results = []
for phase in steps:  # each phase: the steps this rank writes, then a collective load
    for step in phase:
        save_checkpoint(directory, {"w": torch.full((5,), float(step)), "by": rank}, step, keep=5)
    ckpt = load_checkpoint_from_any_rank(directory)
    got = None if ckpt is None else [ckpt.step, ckpt.state["w"].tolist(), ckpt.state["by"]]
    results.append(got)
dist.destroy_process_group()
print(json.dumps(results), flush=True)
"""


@pytest.mark.slow
def test_node_local_resume_over_gloo(tmp_path: Path) -> None:
    """Two ranks with directories of their own: the newest step either holds reaches both."""
    phases = {0: [[], [3, 5], [], []], 1: [[], [], [7], []]}
    with elasticstore.StoreServer("127.0.0.1", 0) as server:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", NODE_LOCAL_WORKER, server.host, str(server.port), str(rank),
                 str(tmp_path / f"node{rank}"), json.dumps(phases[rank])],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for rank in (0, 1)
        ]
        try:
            outputs = [proc.communicate(timeout=180) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate(timeout=30)
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert results[0] == results[1]
    assert results[0] == [
        None,                      # nobody has one
        [5, [5.0] * 5, 0],         # only rank 0 has them: rank 1 (empty) gets step 5
        [7, [7.0] * 5, 1],         # rank 1's newer step reaches rank 0
        [7, [7.0] * 5, 1],
    ]
