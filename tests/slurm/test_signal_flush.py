"""The newest snapshot written to the checkpoint directory when the agent is signalled to stop
(``agent/preempt_flush.py``, ``train/snapshots/flush.py``), without a Slurm cluster: the agent
gets SIGTERM as Slurm sends it (preemption, requeue, time limit, ``scancel``). Checked through
what users see: the exit code, the agent's line, the checkpoint files that ``load_checkpoint``
and ``Snapshots.restore`` read. On a real Slurm cluster, with a requeue:
``test_slurm_cluster.py``."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import PROGRAMS

from elasticstore.agent.preempt_flush import flush_newest
from elasticstore.train import SnapshotSettings, Snapshots
from elasticstore.train.checkpoint import list_checkpoints, load_checkpoint

RUN = os.path.join(os.path.dirname(sys.executable), "elasticstore-run")
TRAIN = os.path.join(PROGRAMS, "slurm_train.py")


def _steps(directory: str) -> list[int]:
    out = []
    for name in glob.glob(os.path.join(directory, "rec-*.jsonl")):
        with open(name) as f:
            out += [int(json.loads(line)["step"]) for line in f if line.endswith("\n")]
    return out


def _run(tmp: str, shutdown: int, pause: float) -> tuple[int, str]:
    """``elasticstore-run`` of 2 workers snapshotting every step (disk checkpoints every 1000
    steps: only step 0's is due), SIGTERMed once past step 2; its exit code and output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    with open(os.path.join(tmp, "out.txt"), "w+") as out:
        proc = subprocess.Popen(
            [RUN, "--standalone", "--nproc-per-node", "2", "--shutdown-timeout", str(shutdown), TRAIN,
             "--dir", tmp, "--steps", "100000", "--sleep", str(pause), "--snapshots",
             os.path.join(tmp, "ckpt"), "--checkpoint-every", "1000"],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while max(_steps(tmp), default=-1) < 2 and proc.poll() is None:
                assert time.monotonic() < deadline, "no step 2 within 240 s"
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        return rc, out.read()


def _term_step(tmp: str) -> int:
    steps = []
    for name in glob.glob(os.path.join(tmp, "term-*.json")):
        with open(name) as f:
            steps.append(int(json.load(f)["step"]))
    assert steps, "no worker recorded the SIGTERM"
    return max(steps)


@pytest.mark.slow  # ~15-45 s (torch imported by the workers and by the flush; a loaded machine)
def test_sigterm_writes_the_newest_snapshot_to_the_checkpoint_directory(tmp_path: str) -> None:
    tmp = str(tmp_path)
    rc, out = _run(tmp, shutdown=120, pause=0.2)
    assert rc == 143, out
    step = _term_step(tmp)  # the workers' last step: its snapshot taken before they exited
    ckpt = os.path.join(tmp, "ckpt")
    assert f"at the signal: the snapshot of step {step} written to {ckpt}/ckpt-{step:012d}.pt" in out, out
    assert [s for s, _ in list_checkpoints(ckpt)] == [0, step]  # step 0: the periodic one
    loaded = load_checkpoint(ckpt)
    assert loaded is not None and loaded.step == step and loaded.state["step"] == step
    assert loaded.meta["step"] == step and loaded.meta["replicated"] is True
    assert sorted(os.listdir(ckpt)) == [f"ckpt-{0:012d}.pt", f"ckpt-{step:012d}.pt"]  # no tmp left


@pytest.mark.slow  # ~15-35 s
def test_no_time_left_of_the_grace_period_writes_nothing(tmp_path: str) -> None:
    # a worker finishes its step (3 s) before it exits: SIGKILLed at --shutdown-timeout 1, which
    # leaves nothing of the grace period for the write
    tmp = str(tmp_path)
    rc, out = _run(tmp, shutdown=1, pause=3.0)
    assert rc == 143, out
    assert "no time left of --shutdown-timeout to write the newest snapshot" in out, out
    assert [s for s, _ in list_checkpoints(os.path.join(tmp, "ckpt"))] == [0]


@pytest.mark.slow  # ~12 s on a loaded 2-core machine (the flush process imports torch)
def test_a_write_that_cannot_finish_in_the_grace_period_is_abandoned(tmp_path: Path) -> None:
    # a node's snapshot area as a worker leaves it (steps 0-5, a disk checkpoint of step 0):
    # 0.2 s is less than the flush process needs to start (it imports torch): killed, the
    # checkpoint of step 0 alone and no temporary file; with time enough, the newest is written
    area, ckpt = str(tmp_path / "area"), str(tmp_path / "ckpt")
    os.mkdir(area)
    import torch

    with Snapshots(every=1, checkpoint_dir=ckpt, checkpoint_every=1000,
                   settings=SnapshotSettings(area, 0)) as snaps:
        for step in range(6):
            snaps.snapshot({"step": step, "w": torch.full((64,), float(step))}, step)
    assert [s for s, _ in list_checkpoints(ckpt)] == [0]
    started = time.monotonic()
    assert flush_newest(area, 0.2) is False
    assert time.monotonic() - started < 10
    assert os.listdir(ckpt) == [f"ckpt-{0:012d}.pt"]
    # local rank 1 (not the one writing checkpoints) went a step further: its copy of the
    # replicated state is written, to the writing rank's directory
    with Snapshots(every=1, checkpoint_dir=ckpt, checkpoint_every=1000, write_checkpoints=False,
                   settings=SnapshotSettings(area, 1)) as other:
        for step in range(7):
            other.snapshot({"step": step, "w": torch.full((64,), float(step))}, step)
    assert flush_newest(area, 120) is True
    assert [s for s, _ in list_checkpoints(ckpt)] == [0, 6]
    loaded = load_checkpoint(ckpt)
    assert loaded is not None and loaded.step == 6 and torch.equal(loaded.state["w"], torch.full((64,), 6.0))


FSDP = os.path.join(PROGRAMS, "fsdp_snapshots.py")


@pytest.mark.slow  # ~100 s on a loaded 2-core machine: 2 nodes x 2 FSDP2 workers, then 1 node x 2
@pytest.mark.timeout(400)
def test_two_nodes_shards_at_the_signal_complete_one_checkpoint_that_a_smaller_job_resumes(
        tmp_path: Path) -> None:
    # each node's agent writes its own ranks' shards; the checkpoint completes with the last one
    from agent_nodes import agents, free_port, node_flags

    from elasticstore.agent.snapshots import ROOT_ENV

    tmp, root = str(tmp_path), str(tmp_path / "shm")
    os.mkdir(root)
    ckpt, port = os.path.join(tmp, "ckpt"), free_port()
    args = ["--dir", tmp, "--steps", "100000", "--step-time", "0.3", "--ckpt", ckpt,
            "--ckpt-every", "1000"]
    flags = ["--shutdown-timeout", "120", "--rdzv-conf", "last_call_timeout=1"]
    with agents(tmp) as a:
        nodes = [a.start(node_flags(addr, port, "2", 2, *flags), args, name=name,
                         env={ROOT_ENV: root}, script=FSDP)
                 for name, addr in (("n1", "127.0.0.2"), ("n2", "127.0.0.3"))]
        deadline = time.monotonic() + 240
        while not os.path.exists(os.path.join(tmp, "full-3.pt")):
            assert all(p.poll() is None for p in nodes) and time.monotonic() < deadline, \
                "\n".join(a.output(p)[-3000:] for p in nodes)
            time.sleep(0.2)
        for proc in nodes:
            proc.send_signal(signal.SIGTERM)
        for proc in nodes:
            assert a.wait(proc, 240) == 143, a.output(proc)[-4000:]
        outs = "\n".join(a.output(p) for p in nodes)
    last = max(int(n[5:-3]) for n in os.listdir(tmp) if n.startswith("full-"))
    done = sorted(n for n in os.listdir(ckpt) if n.startswith("dcp-step-"))
    assert done and int(done[-1][9:]) >= last - 1, (done, last, outs[-4000:])
    step = int(done[-1][9:])
    assert f"at the signal: the snapshot of step {step} written to {ckpt}/{done[-1]}" in outs, outs
    assert os.listdir(root) == []  # each agent removed its area after the write
    # one node of 2 workers: the 4 ranks' checkpoint resharded to 2, from disk
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    again = subprocess.run(
        [RUN, "--standalone", "--nproc-per-node", "2", FSDP, "--dir", tmp, "--steps", str(step),
         "--ckpt", ckpt, "--ckpt-every", "1000"], capture_output=True, cwd=tmp, env=env,
        timeout=240, check=False)
    assert again.returncode == 0, again.stdout.decode()[-3000:] + again.stderr.decode()[-3000:]
    with open(os.path.join(tmp, "restored-0-2.json")) as f:
        got = json.load(f)
    assert got["step"] == step and set(got["sources"]) == {"disk"}, got
    _assert_full_state(tmp, step, last)


def _assert_full_state(tmp: str, step: int, last: int) -> None:
    """The full state resumed (``restored-0-2.pt``) is the one recorded at ``step``."""
    import torch

    have = torch.load(os.path.join(tmp, "restored-0-2.pt"))
    # rank 0 renames full-<step>.pt into place before the step's snapshot: a step written at
    # the signal always has it, whole
    assert step <= last, (step, last)
    want = torch.load(os.path.join(tmp, f"full-{step}.pt"))
    assert want.keys() == have.keys() and all(
        torch.equal(want[k], have[k]) if isinstance(want[k], torch.Tensor) else want[k] == have[k]
        for k in want), "the state resumed from the checkpoint differs from the one at its step"
