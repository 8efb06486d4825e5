"""Overlapped snapshots (``train/snapshots/overlap.py``): an optimizer's tensors of a large CPU
state are copied while the next step's forward and backward run, and the optimizer's step waits
for that copy. Every published snapshot is its own step's state, bit for bit, module buffers that
the forward pass updates (batch norm) included; a tensor changed in place outside the optimizer
discards that snapshot, loudly, and ends overlapping; a worker SIGKILLed with a copy pending
leaves the previous step to restore; small states, ``overlap=False`` and loops without a
torch.optim optimizer copy before ``snapshot`` returns; FSDP2's sharded state overlaps too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from paths import program
from torch import nn

from elasticstore.train import SnapshotSettings, Snapshots
from elasticstore.train.snapshots.fileformat import list_snapshots, read_snapshot, stale_tmp_files
from elasticstore.train.snapshots.overlap import OVERLAP_BYTES, watch_optimizers

WRITER = program("overlap_train.py")


def clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone(v) for v in x)
    return x


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.Linear(1024, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def newest(directory: str) -> tuple[int, Any]:
    step, _, path = list_snapshots(directory)[-1]
    got, _, state = read_snapshot(path)
    assert got == step
    return step, state


def assert_newest(directory: str, step: int, want: Any) -> None:
    """The newest snapshot in ``directory`` is ``step``'s, holding exactly ``want``."""
    got_step, got = newest(directory)
    assert got_step == step
    assert_same(got, want)


def empty(directory: str) -> None:
    """Removes what a test's writers left (the fixture checks the directory is empty)."""
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))


def test_each_published_snapshot_is_its_steps_state_while_the_copy_overlaps(
        shm_root: str) -> None:
    """Adam on a 12 MB state with batch norm: from the first snapshot on, the optimizer's
    tensors are left to the background (``last_background_bytes``), the next step's forward
    updates the running statistics meanwhile, and the snapshot published at the optimizer's
    next step equals the state as it was at ``snapshot``, every step."""
    model, optim = model_and_optimizer()
    expected: dict[int, Any] = {}
    with Snapshots(settings=SnapshotSettings(shm_root, 0)) as snaps:
        for step in range(1, 6):
            train_step(model, optim, step)  # its optimizer step publishes step - 1
            if step > 1:
                assert_newest(shm_root, step - 1, expected[step - 1])
            state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}
            expected[step] = clone(state)
            assert snaps.snapshot(state, step)
            params = list(model.parameters())
            # the weights, Adam's two moments and its step counters (float32 scalars)
            assert snaps.last_background_bytes == 3 * sum(p.nbytes for p in params) + 4 * len(params)
            assert snaps._pending is not None
        x = torch.randn(32, 1024)
        model(x)  # a forward pass after the last snapshot: buffers change, weights do not
    # close() published the last one, whose copy had no optimizer step to wait for
    assert_newest(shm_root, 5, expected[5])
    assert stale_tmp_files(shm_root, 0) == []
    empty(shm_root)


def test_a_tensor_changed_outside_the_optimizer_discards_that_snapshot(shm_root: str) -> None:
    """A weight changed in place between ``snapshot`` and the optimizer's next step (not through
    it): that step's snapshot is discarded with a warning that says why, the previous one stays
    the newest, and every later snapshot is copied before ``snapshot`` returns, exactly."""
    model, optim = model_and_optimizer()
    with Snapshots(settings=SnapshotSettings(shm_root, 0)) as snaps:
        train_step(model, optim, 1)
        snaps.snapshot({"model": model.state_dict(), "step": 1}, 1)
        train_step(model, optim, 2)
        snaps.snapshot({"model": model.state_dict(), "step": 2}, 2)
        assert snaps.last_background_bytes > 0
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # e.g. a constraint applied by hand before the next step
        with pytest.warns(RuntimeWarning, match=r"snapshot of step 2 was discarded: 1 optimizer "
                                                r"tensors changed in place outside"):
            train_step(model, optim, 3)
        assert newest(shm_root)[0] == 1 and not snaps.overlap
        want = clone({"model": model.state_dict(), "step": 3})
        snaps.snapshot({"model": model.state_dict(), "step": 3}, 3)
        assert snaps.last_background_bytes == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            train_step(model, optim, 4)
        assert_newest(shm_root, 3, want)
    empty(shm_root)


def test_what_copies_before_snapshot_returns(shm_root: str) -> None:
    """Nothing is left to the background for a state under ``OVERLAP_BYTES``, with
    ``overlap=False``, or for tensors no optimizer that stepped owns: a copy of the weights, half
    of a weight, a buffer larger than the parameter that views it."""
    watch_optimizers()  # as a Snapshots made first does: the steps below are seen
    model, optim = model_and_optimizer()
    train_step(model, optim, 1)
    small = nn.Linear(16, 16)
    assert sum(p.nbytes for p in small.parameters()) < OVERLAP_BYTES
    small_optim = torch.optim.SGD(small.parameters(), lr=0.1)
    small(torch.randn(2, 16)).sum().backward()
    small_optim.step()
    weight = model[0].weight.detach()
    flat = torch.zeros((1 << 20) + 8)  # a parameter views all of it but 8 floats
    part = nn.Parameter(flat[: 1 << 20])
    part.grad = torch.ones_like(part)
    part_optim = torch.optim.SGD([part], lr=0.1)
    part_optim.step()
    for settings, state in [
            ({}, {"model": small.state_dict()}),
            ({"overlap": False}, {"model": model.state_dict()}),
            ({}, {"model": clone(model.state_dict())}),
            ({}, {"half": weight.view(-1)[: weight.numel() // 2], "pad": torch.zeros(2 << 20)}),
            ({}, {"flat": flat})]:
        with Snapshots(settings=SnapshotSettings(shm_root, 0), **settings) as snaps:
            snaps.snapshot(state, 1)
            assert snaps.last_background_bytes == 0 and snaps._pending is None
            assert newest(shm_root)[0] == 1
        empty(shm_root)
    # the control: the same optimizers' own tensors are left to the background
    with Snapshots(settings=SnapshotSettings(shm_root, 0)) as snaps:
        snaps.snapshot({"model": model.state_dict(), "part": part.detach()}, 1)
        params = sum(p.nbytes for p in model.parameters())
        assert snaps.last_background_bytes >= params + part.nbytes
    empty(shm_root)
    del part_optim


@pytest.mark.timeout(120)
def test_worker_killed_with_a_copy_pending_restores_the_previous_step(tmp_path: Path,
                                                                      shm_root: str) -> None:
    """A training process SIGKILLed after ``snapshot(3)`` returned and before its optimizer's next
    step (its copy done or not, unpublished): a new process restores step 2, exactly the state
    the killed one had at step 2, and removes the unpublished file."""
    proc = subprocess.Popen([sys.executable, WRITER, shm_root, str(tmp_path), "3"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.split() == ["pending", "3"], line
        time.sleep(0.2)  # the background copy has finished: published or not is the point
        assert stale_tmp_files(shm_root, 0), os.listdir(shm_root)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
    with Snapshots(settings=SnapshotSettings(shm_root, 0)) as snaps:
        got = snaps.restore()
        assert got is not None and (got.step, got.source) == (2, "memory")
        assert_same(got.state, torch.load(tmp_path / "state-2.pt", weights_only=False))
        snaps.snapshot(got.state, 3)  # the next process's first snapshot takes its place
        assert stale_tmp_files(shm_root, 0) == []
    empty(shm_root)


@pytest.mark.timeout(120)
def test_a_forked_child_neither_waits_for_nor_publishes_its_parents_copy(tmp_path: Path,
                                                                         shm_root: str) -> None:
    """A process forks with a copy pending (as a DataLoader's workers are forked): the child's
    optimizer step returns at once (the parent's copy thread does not exist there) and leaves the
    parent's files alone; the parent's own next step publishes the snapshot."""
    out = subprocess.run([sys.executable, WRITER, shm_root, str(tmp_path), "3", "fork"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["forked", "0", "3"], out.stdout
    assert stale_tmp_files(shm_root, 0) == []
    empty(shm_root)


def test_a_snapshots_dropped_with_a_copy_pending_still_publishes_it(shm_root: str) -> None:
    """``Snapshots`` dropped by the program (no reference, never closed) right after a snapshot:
    its copy is still settled, and the snapshot published, at the optimizer's next step."""
    snaps = Snapshots(settings=SnapshotSettings(shm_root, 0))  # first: the steps are seen
    model, optim = model_and_optimizer()
    train_step(model, optim, 1)
    want = clone({"model": model.state_dict(), "step": 1})
    snaps.snapshot({"model": model.state_dict(), "step": 1}, 1)
    assert snaps.last_background_bytes > 0
    del snaps
    train_step(model, optim, 2)
    assert_newest(shm_root, 1, want)
    empty(shm_root)


def test_fsdp2_sharded_state_overlaps_and_restores_exactly(tmp_path: Path) -> None:
    """FSDP2 (``fully_shard`` on a one-rank gloo mesh) with Adam, the state from
    ``get_state_dict``: its DTensors' shards are left to the background, and the snapshot
    published at the next optimizer step restores (into a template) exactly the state of its
    step."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        optim = torch.optim.Adam(model.parameters(), lr=1e-3)

        def full(state: Any) -> Any:
            if isinstance(state, DTensor):
                return state.full_tensor().clone()
            if isinstance(state, dict):
                return {k: full(v) for k, v in state.items()}
            return clone(state)

        with Snapshots(settings=SnapshotSettings(str(tmp_path), 0)) as snaps:
            train_step(model, optim, 1)
            msd, osd = get_state_dict(model, optim)
            want = full({"model": msd, "optim": osd})
            snaps.snapshot({"model": msd, "optim": osd}, 1)
            assert snaps.last_background_bytes >= 3 * 1024 * 1024 * 4
            train_step(model, optim, 2)  # publishes step 1
            msd, osd = get_state_dict(model, optim)
            template = {"model": msd, "optim": osd}
            got = snaps.restore(template=template)
        assert got is not None and (got.step, got.source) == (1, "memory")
        assert_same(full(template), want)
    finally:
        dist.destroy_process_group()


def test_a_sharded_snapshots_plan_is_made_again_whenever_its_layout_changes() -> None:
    """The DCP write items of a sharded snapshot are reused while the state's layout stays (every
    step of a run) and made again when it changes: a global shape, a placement, a dtype, an entry
    added; each time they equal the plan DCP makes for that state."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import (DefaultSavePlanner,
                                                              create_default_local_save_plan)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from elasticstore.train.snapshots.shards import to_payload

    def planned(state: dict[str, Any]) -> list[Any]:
        planner = DefaultSavePlanner()
        planner.set_up_planner(dict(state), None, True)
        return list(create_default_local_save_plan(planner.state_dict, True).items)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        a = {"w": distribute_tensor(torch.zeros(3, 2), mesh, [Shard(0)]), "n": 1}
        states = [a, dict(a, n=2),
                  dict(a, w=distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])),
                  dict(a, w=distribute_tensor(torch.zeros(3, 2), mesh, [Replicate()])),
                  dict(a, w=distribute_tensor(torch.zeros(3, 2, dtype=torch.float64), mesh,
                                              [Shard(0)])),
                  dict(a, t=torch.ones(5)), a]
        items = []
        for state in states:
            payload = to_payload(state)
            assert payload["items"] == planned(state)
            assert payload["data"][1] == state["n"]  # the object read from this state
            items.append(payload["items"])
        assert items[1] is items[0]  # the same layout: the plan reused
        assert all(items[i] is not items[i - 1] for i in range(2, len(items)))
    finally:
        dist.destroy_process_group()
