"""Sharded and per-rank state in snapshots: never a silently wrong model.

- FSDP2 state (DTensors, from ``fully_shard`` on a CPU gloo mesh) under elasticstore-run: taken
  by ``snapshot()`` as sharded state (each rank's own file; restored with a template, see
  ``test_train_fsdp_snapshots.py``); the full state dict is snapshotted, restored without a
  template and loaded back exactly.
- Per-rank state (``replicated=False``) taken by 3 real ranks on two "nodes" (two snapshot
  directories), then restored: unchanged, each rank gets its own; with one local rank's files
  missing, with a node replaced by an empty one, and with a node lost (the survivors renumbered
  from 0), every rank refuses with ``SnapshotMismatchError`` instead of taking another rank's.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from agent_nodes import agents, free_port
from paths import program

from elasticstore.agent.snapshots import ROOT_ENV

TRAIN = program("sharded_train.py")


def records(workdir: str, mode: str) -> dict[int, Any]:
    found = {}
    for path in glob.glob(os.path.join(workdir, f"{mode}-*.json")):
        with open(path) as f:
            r = json.load(f)
        found[r["rank"]] = r
    return found


@pytest.mark.slow  # ~10-20 s on 2 shared cores
@pytest.mark.timeout(120)
def test_fsdp2_state_is_snapshotted_and_the_full_state_dict_round_trips(tmp_path: Path,
                                                                        shm_root: str) -> None:
    workdir = str(tmp_path)
    with agents(workdir) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "2"],
                        ["--dir", workdir, "--mode", "fsdp"], env={ROOT_ENV: shm_root},
                        script=TRAIN)
        code = a.wait(agent, 100)
        out = a.output(agent)
    assert code == 0, out[-4000:]
    found = records(workdir, "fsdp")
    assert sorted(found) == [0, 1], out[-4000:]
    for r in found.values():
        assert r["sharded"] == "accepted", r
        assert f"step-000000000001.local-{r['rank']}.snap" in r["area_after_sharded"], r
        assert r["restored"] == [2, "memory"] and r["exact"], r


def run_ranks(workdir: str, mode: str, nodes: dict[int, tuple[str, int]],
              timeout: float = 60) -> dict[int, Any]:
    """Starts one process per rank (rank -> (its node's snapshot directory, local rank)) and
    returns their records."""
    port = free_port("127.0.0.1")
    procs = []
    try:
        for rank, (directory, local) in nodes.items():
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(nodes)),
                       LOCAL_RANK=str(local), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       ELASTICSTORE_SNAPSHOT_DIR=directory)
            procs.append(subprocess.Popen([sys.executable, TRAIN, "--dir", workdir,
                                           "--mode", mode], env=env, start_new_session=True))
        for proc in procs:
            assert proc.wait(timeout) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
    found = records(workdir, mode)
    for path in glob.glob(os.path.join(workdir, f"{mode}-*.json")):
        os.unlink(path)
    return found


@pytest.mark.slow  # ~40 s on 2 shared cores (4 launches of 1-3 ranks)
@pytest.mark.timeout(240)
def test_per_rank_state_is_restored_only_to_its_own_rank(tmp_path: Path) -> None:
    """Per-rank state of 3 ranks on two "nodes" (a: ranks 0 and 1, b: rank 2), each from its own
    snapshot directory; taken and restored unchanged: each rank its own; then every change below
    is refused on every rank."""
    workdir = str(tmp_path)
    node_a, node_b, empty = (str(tmp_path / n) for n in ("a", "b", "empty"))
    for d in (node_a, node_b, empty):
        os.mkdir(d)
    three = {0: (node_a, 0), 1: (node_a, 1), 2: (node_b, 0)}
    same = run_ranks(workdir, "take", three)
    assert {r: v["got"] for r, v in same.items()} == {
        r: {"step": 3, "source": "memory", "rank": r} for r in range(3)}, same

    def refused(found: dict[int, Any], world: int, words: str) -> None:
        assert sorted(found) == list(range(world)), found
        for r in found.values():
            assert "got" not in r and r["error"].startswith("SnapshotMismatchError"), r
            assert words in r["error"], r["error"]

    # Node b replaced by an empty one: rank 2 has nothing of its own (no peer broadcast).
    refused(run_ranks(workdir, "restore", {0: (node_a, 0), 1: (node_a, 1), 2: (empty, 0)}), 3,
            "rank 2 of 3 has no snapshot")
    # Node a lost: b's rank is now rank 0 of 1; its file is rank 2's of 3.
    refused(run_ranks(workdir, "restore", {0: (node_b, 0)}), 1, "rank 0 of 1 has no snapshot")
    # Local rank 1's files of node a missing: not replaced by local rank 0's.
    for path in glob.glob(os.path.join(node_a, "*.local-1.snap")):
        os.unlink(path)
    refused(run_ranks(workdir, "restore", three), 3, "rank 1 of 3 has no snapshot")


def test_refusals_where_one_copy_would_serve_every_rank(tmp_path: Path) -> None:
    """Per-rank state gets no disk checkpoints written by one rank; save_checkpoint refuses
    sharded tensors (a real DTensor on a one-rank gloo mesh)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from elasticstore.train import ShardedStateError, Snapshots, save_checkpoint

    with pytest.raises(ValueError, match="torch.distributed.checkpoint"):
        Snapshots(replicated=False, checkpoint_dir=tmp_path, checkpoint_every=1)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        dt = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Shard(0)])
        with pytest.raises(ShardedStateError, match=r"at 'model\.w'"):
            save_checkpoint(tmp_path, {"model": {"w": dt}}, 1)
        assert os.listdir(tmp_path) == []
    finally:
        dist.destroy_process_group()
