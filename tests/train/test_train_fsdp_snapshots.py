"""Sharded (FSDP2) snapshots: restored into the run's own state dict, resharded, never wrong.

- ``restorable_step`` ("which step can every rank restore") as a table; mismatched metadata
  refused (``build_metadata``).
- 4 real ranks on two "nodes" (two snapshot directories) train an FSDP2 model (gloo), snapshot
  every step and write DCP disk checkpoints; then 3 ranks restore from memory (one chunk comes
  from a peer) and 2 ranks that hold only half of the newest step's shards restore the disk
  checkpoint instead; with the other node's files in its ``replicas/``, from memory again: the
  full state (every DTensor's ``full_tensor()``) bit-identical.
- Under elasticstore-run, 2 simulated nodes x 2 workers: a worker SIGKILLed after step 3 comes
  back, the group resumes from step 3 from memory at world size 4, bit-identical.
- ``examples/train_fsdp.py``: resumed from memory after a failure, then by a new job at another
  world size from its DCP checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from agent_nodes import agents, free_port, node_flags
from paths import ROOT, program
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from elasticstore.agent.snapshots import ROOT_ENV
from elasticstore.train import SnapshotMismatchError
from elasticstore.train.snapshots.shards import build_metadata, restorable_step

TRAIN = program("fsdp_snapshots.py")
CONF = ["--rdzv-conf", "last_call_timeout=1"]


@pytest.mark.parametrize("holdings, want", [
    ({}, None),
    ({3: {0: 2, 1: 2}}, 3),
    ({3: {0: 2}, 2: {0: 2, 1: 2}}, 2),  # a shard of step 3 nobody holds: step 2
    ({3: {0: 4, 1: 4, 2: 4}, 2: {0: 4, 1: 4, 2: 4, 3: 4}}, 2),
    ({5: {0: 2, 1: 2, 2: 4, 3: 4}}, None),  # files of two world sizes
    ({5: {1: 1}}, None),  # rank 1 of a world of 1: not one run's
    ({7: {0: 1}, 9: {0: 2, 1: 2}}, 9),
])
def test_which_step_every_rank_can_restore(holdings: dict[int, dict[int, int]],
                                           want: int | None) -> None:
    assert restorable_step(holdings) == want


def _item(fqn: str, offset: int, size: int, total: int,
          dtype: torch.dtype = torch.float32) -> WriteItem:
    return WriteItem(MetadataIndex(fqn, torch.Size([offset])), WriteItemType.SHARD,
                     tensor_data=TensorWriteData(
                         ChunkStorageMetadata(torch.Size([offset]), torch.Size([size])),
                         TensorProperties(dtype=dtype), torch.Size([total])))


def test_mismatched_metadata_is_refused() -> None:
    md = build_metadata(1, {0: [_item("w", 0, 3, 5)], 1: [_item("w", 3, 2, 5)]})
    assert [tuple(c.offsets) for c in md.state_dict_metadata["w"].chunks] == [(0,), (3,)]
    with pytest.raises(SnapshotMismatchError, match="disagree on 'w'"):
        build_metadata(1, {0: [_item("w", 0, 3, 5)], 1: [_item("w", 3, 3, 6)]})
    with pytest.raises(SnapshotMismatchError, match="disagree on 'w'"):
        build_metadata(1, {0: [_item("w", 0, 3, 5)],
                           1: [_item("w", 3, 2, 5, torch.float16)]})
    with pytest.raises(SnapshotMismatchError, match="cover 3 of its 5"):
        build_metadata(1, {0: [_item("w", 0, 3, 5)]})


def run_ranks(out: str, nodes: list[tuple[str, int]], *args: str, timeout: float = 150) -> None:
    """One process per rank (rank i: its node's snapshot directory and local rank)."""
    port = free_port("127.0.0.1")
    os.makedirs(out, exist_ok=True)
    procs = []
    try:
        for rank, (directory, local) in enumerate(nodes):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(nodes)),
                       LOCAL_RANK=str(local), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       ELASTICSTORE_SNAPSHOT_DIR=directory)
            log = open(os.path.join(out, f"log-{rank}"), "wb")
            procs.append(subprocess.Popen([sys.executable, TRAIN, "--dir", out, *args], env=env,
                                          stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
            log.close()
        for rank, proc in enumerate(procs):
            code = proc.wait(timeout)
            with open(os.path.join(out, f"log-{rank}"), errors="replace") as f:
                assert code == 0, f.read()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def restored(out: str, attempt: int, world: int) -> tuple[Any, dict[str, Any]]:
    with open(os.path.join(out, f"restored-{attempt}-{world}.json")) as f:
        got = json.load(f)
    return got, torch.load(os.path.join(out, f"restored-{attempt}-{world}.pt"), weights_only=False)


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.mark.slow  # ~50-90 s on 2 shared cores (3 launches of 2-4 ranks)
@pytest.mark.timeout(400)
def test_resharded_from_memory_and_from_disk(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    os.mkdir(a)
    os.mkdir(b)
    ckpt = str(tmp_path / "ckpt")
    take = str(tmp_path / "take")
    run_ranks(take, [(a, 0), (a, 1), (b, 0), (b, 1)], "--steps", "3", "--ckpt", ckpt,
              "--ckpt-every", "2")
    assert sorted(os.listdir(ckpt)) == ["dcp-step-000000000002"]
    full = {s: torch.load(os.path.join(take, f"full-{s}.pt"), weights_only=False)
            for s in (2, 3)}
    # 3 ranks on both nodes: step 3 from memory, resharded 4 -> 3 (rank 1 gets a chunk of old
    # rank 2's shard from rank 2, on the other node)
    three = str(tmp_path / "three")
    run_ranks(three, [(a, 0), (a, 1), (b, 0)], "--steps", "3")
    got, state = restored(three, 0, 3)
    assert got["step"] == 3 and got["sources"] == ["memory", "peer", "memory"], got
    assert_same(state, full[3])
    # 2 ranks on node a only: nobody holds old ranks 2 and 3's shards of step 3 (nor of 2):
    # the disk checkpoint of step 2, resharded 4 -> 2
    two = str(tmp_path / "two")
    run_ranks(two, [(a, 0), (a, 1)], "--steps", "2", "--ckpt", ckpt, "--ckpt-every", "2")
    got, state = restored(two, 0, 2)
    assert got["step"] == 2 and got["sources"] == ["disk", "disk"], got
    assert_same(state, full[2])
    # node b's step-3 files placed in node a's replicas/ (what a replica on another node gives):
    # node a alone restores step 3 from memory, resharded 4 -> 2
    os.mkdir(os.path.join(a, "replicas"))
    for name in os.listdir(b):
        if name.startswith("step-000000000003"):
            shutil.copy(os.path.join(b, name), os.path.join(a, "replicas", name))
    for name in os.listdir(a):
        if name.startswith("step-") and not name.startswith("step-000000000003"):
            os.unlink(os.path.join(a, name))  # what the run of 2 ranks above took
    alone = str(tmp_path / "alone")
    run_ranks(alone, [(a, 0), (a, 1)], "--steps", "3")
    got, state = restored(alone, 0, 2)
    assert got["step"] == 3 and got["sources"] == ["memory", "memory"], got
    assert_same(state, full[3])


@pytest.mark.slow  # ~20-40 s on 2 shared cores
@pytest.mark.timeout(300)
@pytest.mark.parametrize("hidden,resumed", [(14, 3), (120_000, 2)], ids=["copied", "overlapped"])
def test_worker_killed_resumes_from_memory_bit_identical(tmp_path: Path, hidden: int,
                                                         resumed: int) -> None:
    """Rank 2 of 4 (2 nodes) SIGKILLs itself right after step 3's snapshot: the group resumes from
    memory, bit for bit, from step 3 when the snapshot was copied before ``snapshot`` returned (a
    small state), and from step 2 when its copy overlapped the next step (each rank's shards and
    AdamW's state over 4 MiB: step 3's snapshot is published at the optimizer's next step, which
    the killed rank never reached, so the ranks' newest common step is 2)."""
    workdir, port = str(tmp_path), free_port()
    root = str(tmp_path / "shm")
    os.mkdir(root)
    env = {ROOT_ENV: root}
    args = ["--dir", workdir, "--steps", "5", "--kill-rank", "2", "--kill-at", "3",
            "--hidden", str(hidden)]
    with agents(workdir) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "2", 2, *CONF, "--max-restarts", "1"), args,
                     name="n1", env=env, script=TRAIN)
        n2 = a.start(node_flags("127.0.0.3", port, "2", 2, *CONF, "--max-restarts", "1"), args,
                     name="n2", env=env, script=TRAIN)
        for proc in (n1, n2):
            assert a.wait(proc, 240) == 0, a.output(proc)[-4000:]
    got, state = restored(workdir, 1, 4)
    # from memory: the node's own, or (were the ranks placed on the other node) its peer's
    assert got["step"] == resumed and set(got["sources"]) <= {"memory", "peer"}, got
    full = torch.load(os.path.join(workdir, f"full-{resumed}.pt"), weights_only=False)
    assert_same(state, full)
    assert os.listdir(root) == []


def test_sharded_snapshot_in_one_process(tmp_path: Path) -> None:
    """A DTensor state on a one-rank gloo mesh: restore() without a template refuses on the
    sharded snapshot, saying what to do; with a template it loads into it, from memory."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from elasticstore.train import SnapshotSettings, Snapshots

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
        with Snapshots(settings=SnapshotSettings(str(tmp_path), 0)) as snaps:
            snaps.snapshot({"model": {"w": w}, "note": "n", "steps": torch.tensor(7)}, 4)
            with pytest.raises(SnapshotMismatchError, match=r"restore\(template="):
                snaps.restore()
            template = {"model": {"w": distribute_tensor(torch.zeros(3, 2), mesh, [Shard(0)])},
                        "note": "", "steps": torch.tensor(0)}
            got = snaps.restore(template=template)
        assert got is not None and (got.step, got.source) == (4, "memory")
        assert torch.equal(template["model"]["w"].full_tensor(), w.full_tensor())
        assert template["note"] == "n" and int(template["steps"]) == 7
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # ~30-50 s on 2 shared cores
@pytest.mark.timeout(300)
def test_example_resumes_from_memory_then_a_new_job_from_disk(tmp_path: Path) -> None:
    """examples/train_fsdp.py under elasticstore-run: a rank fails at step 10, the group resumes
    from memory at step 10; then a new job of one process (no launcher) with the same checkpoint
    directory resumes from the DCP checkpoint of step 15, resharded 2 -> 1."""
    example = os.path.join(ROOT, "examples", "train_fsdp.py")
    root = str(tmp_path / "shm")
    os.mkdir(root)
    ckpt = str(tmp_path / "ckpt")
    args = ["--epochs", "1", "--dataset-size", "1024", "--checkpoint-dir", ckpt,
            "--checkpoint-every", "5", "--log-every", "100"]
    events, summary = str(tmp_path / "events.jsonl"), str(tmp_path / "summary.json")
    with agents(str(tmp_path)) as a:
        job = a.start(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"],
                      [*args, "--fail-at-step", "10", "--fail-rank", "1", "--events", events,
                       "--summary", summary], env={ROOT_ENV: root}, script=example)
        code = a.wait(job, 200)
        out = a.output(job)
    assert code == 0, out[-4000:]
    assert "resumed from step 10 at world size 2, from memory" in out, out[-4000:]
    with open(events) as f:  # rank 0's starts (with every rank's restore source) and steps
        starts = [(e["step"], e["sources"]) for e in map(json.loads, f) if e["event"] == "start"]
    assert starts == [(0, [None, None]), (10, ["memory", "memory"])], starts
    with open(summary) as f:
        s = json.load(f)
    assert (s["steps"], s["world_size"], s["restart_count"]) == (16, 2, 1), s
    assert len(s["weights_sha256"]) == 64, s
    # the newest 2 complete (step 10's may not be: the rank that failed may not have written it)
    done = sorted(os.listdir(ckpt))
    assert len(done) == 2 and done[-1] == "dcp-step-000000000015", done
    second = subprocess.run([sys.executable, example, *args], capture_output=True, text=True,
                            timeout=120, cwd=str(tmp_path),
                            env={k: v for k, v in os.environ.items()
                                 if k not in ("RANK", "WORLD_SIZE", "ELASTICSTORE_SNAPSHOT_DIR")})
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 15 at world size 1, from disk" in second.stdout, second.stdout
    assert os.listdir(root) == []
