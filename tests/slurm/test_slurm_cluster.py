"""``elasticstore-run`` under a real Slurm cluster (slurmctld and three slurmd, each node in a
network namespace of its own: ``tests/helpers/slurm_cluster.py``), as users run it: ``sbatch``
scripts (and an ``salloc``) whose ``srun`` starts one ``elasticstore-run`` a node with no
rendezvous flags. The
workers (gloo) record their rank, world size, node rank and step (``programs/slurm_train.py``);
the tests read those facts and the job's state as Slurm reports it.

The cluster is started once for the module and always torn down (checked: no daemon, namespace
or cgroup left). Skipped, saying why, without root or Slurm's packages (scripts/setup-system).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
import slurm_cluster
from paths import PROGRAMS

pytestmark = pytest.mark.skipif(slurm_cluster.missing() is not None,
                                reason=str(slurm_cluster.missing()))

RUN = os.path.join(os.path.dirname(sys.executable), "elasticstore-run")
TRAIN = os.path.join(PROGRAMS, "slurm_train.py")


@pytest.fixture(scope="module")
def cluster() -> Iterator[slurm_cluster.Cluster]:
    # a requeued job starts 5 s later; SIGKILL 30 s after a requeue's SIGTERM (Slurm's default)
    with slurm_cluster.running(3, CRED_EXPIRE="5", KILL_WAIT="30") as c:
        yield c


@pytest.fixture
def jobdir(cluster: slurm_cluster.Cluster) -> Iterator[str]:
    """A directory all nodes share for one test's job; every job over and every node idle after."""
    path = tempfile.mkdtemp(prefix="es-slurm-job-")
    try:
        yield path
    finally:
        try:
            cluster.cancel_all()
        finally:
            shutil.rmtree(path, ignore_errors=True)


def records(directory: str) -> list[dict[str, object]]:
    out = []
    for name in glob.glob(os.path.join(directory, "rec-*.jsonl")):
        with open(name) as f:
            out += [json.loads(line) for line in f if line.endswith("\n")]
    return sorted(out, key=lambda r: float(r["t"]))  # type: ignore[arg-type]


def output(directory: str, job: str) -> str:
    with open(os.path.join(directory, f"out-{job}.txt")) as f:
        return f.read()


def wait_for(what: str, pred: object, timeout: float, directory: str | None = None) -> None:
    """Waits for ``pred()``; on timeout the error shows the end of the jobs' output in ``directory``."""
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            tail = ""
            for name in sorted(glob.glob(os.path.join(directory or "/nonexistent", "out-*.txt"))):
                with open(name) as f:
                    tail += f"\n--- {name}:\n" + "".join(f.readlines()[-40:])
            raise TimeoutError(f"{what}: not within {timeout} s{tail}")
        time.sleep(0.2)


def script(directory: str, run_flags: str, steps: int, srun_flags: str = "", pause: float = 0.1,
           nproc: int = 2) -> str:
    return (f"#!/bin/sh\nsrun --ntasks-per-node=1 {srun_flags} {RUN} --nproc-per-node {nproc} {run_flags} "
            f"{TRAIN} --dir {directory} --steps {steps} --sleep {pause}\n")


@pytest.mark.slow  # ~50 s: a 2-node job of 4 gloo workers, preempted once while training
def test_zero_config_srun_runs_one_job_across_the_allocation_and_resumes_after_a_preemption(
        cluster: slurm_cluster.Cluster, jobdir: str) -> None:
    job = cluster.sbatch(script(jobdir, "", steps=12, pause=0.2), "-N", "2", "--requeue",
                         "--open-mode=append", cwd=jobdir)
    started(jobdir, 4, 3)
    requeued = time.time()
    # a job of the higher priority partition that needs every node: Slurm preempts ours (REQUEUE
    # mode, GraceTime 10 s: SIGTERM now, requeued if still running at the end of the grace time)
    cluster.sbatch("#!/bin/sh\nsleep 1\n", "-p", "urgent", "-N", "3", "--exclusive", cwd=jobdir)
    info = cluster.wait_job(job, timeout=120)
    out = output(jobdir, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, out)
    assert f"Slurm: job {job} is being preempted" in out, out
    recs = records(jobdir)
    for run in (0, 1):  # each run: one job across both nodes
        mine = [r for r in recs if r["slurm_restart"] == run]
        assert {r["world"] for r in mine} == {4}, recs
        assert {r["rank"] for r in mine} == {0, 1, 2, 3}
        assert {(r["host"], r["node_rank"]) for r in mine} in ({("n1", 0), ("n2", 1)},
                                                               {("n1", 1), ("n2", 0)})
    # the workers got the SIGTERM while training; the requeued run resumed from that step
    terms = []
    for name in glob.glob(os.path.join(jobdir, "term-*.json")):
        with open(name) as f:
            terms.append(json.load(f))
    assert terms and all(float(t["t"]) >= requeued - 1 for t in terms), terms
    at_signal = max(int(t["step"]) for t in terms)
    first = min(int(r["step"]) for r in recs if r["slurm_restart"] == 1)  # type: ignore[call-overload]
    assert at_signal - 1 <= first <= at_signal + 1, (at_signal, first)
    assert max(int(r["step"]) for r in recs) == 12  # type: ignore[call-overload]
    # the banner says what it took from Slurm, on each node
    for node, addr in (("n1", "10.77.0.11"), ("n2", "10.77.0.12")):
        assert (f"from Slurm (step {job}.0 on 2 node(s), {node}): --rdzv-id {job} --nnodes 2 "
                f"--rdzv-endpoint n1:{29400 + int(job)},n2:{29400 + int(job)} --local-addr {addr}") in out, out
    back = min(float(r["t"]) for r in recs if r["slurm_restart"] == 1) - requeued  # type: ignore[arg-type]
    print(f"from the preemption to training again: {back:.1f} s")


@pytest.mark.slow  # ~60 s: a 2-node job of 4 workers, signalled (requeued) once while training
def test_the_newest_snapshot_goes_to_disk_at_the_signal_and_the_requeued_job_resumes_from_it(
        cluster: slurm_cluster.Cluster, jobdir: str) -> None:
    # disk checkpoints every 1000 steps: none is due in this run, only the write at the signal
    # can give the requeued run a step to resume from. The time-limit pattern of docs/slurm.md:
    # USR1 to the batch shell requeues the job; Slurm then sends SIGTERM to the step.
    ckpt = os.path.join(jobdir, "ckpt")
    body = (f"trap 'scontrol requeue \"$SLURM_JOB_ID\"' USR1\n"
            f"srun --ntasks-per-node=1 {RUN} --nproc-per-node 2 --shutdown-timeout 25 {TRAIN} "
            f"--dir {jobdir} --steps 30 --sleep 0.3 --snapshots {ckpt} --checkpoint-every 1000 &\n"
            "until wait; do :; done\n")
    job = cluster.sbatch(f"#!/bin/bash\n{body}", "-N", "2", "--requeue", "--open-mode=append",
                         cwd=jobdir)
    started(jobdir, 4, 3)
    signalled = time.time()
    cluster.call("scancel", "--signal=USR1", "--batch", job)
    info = cluster.wait_job(job, timeout=180)
    out = output(jobdir, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, out)
    terms = []
    for name in glob.glob(os.path.join(jobdir, "term-*.json")):
        with open(name) as f:
            terms.append(json.load(f))
    assert terms and all(float(t["t"]) >= signalled - 1 for t in terms), (terms, out)
    at_signal = max(int(t["step"]) for t in terms)
    recs = records(jobdir)
    second = [r for r in recs if r["slurm_restart"] == 1]
    assert {r["source"] for r in second} == {"disk"}, (second[:4], out)
    first = min(int(r["step"]) for r in second)  # type: ignore[call-overload]
    assert at_signal <= first <= at_signal + 1, (at_signal, first, out)  # restored >= at_signal - 1
    assert max(int(r["step"]) for r in recs) == 30  # type: ignore[call-overload]
    assert f"at the signal: the snapshot of step {first - 1} written to {ckpt}/ckpt-" in out, out
    back = min(float(r["t"]) for r in second) - signalled  # type: ignore[arg-type]
    print(f"signalled at step {at_signal}, resumed from disk at step {first}; "
          f"from the signal to training again: {back:.1f} s")


@pytest.mark.slow  # ~30 s: salloc for 2 nodes, one srun of 4 gloo workers
def test_zero_config_srun_inside_an_salloc_allocation(cluster: slurm_cluster.Cluster,
                                                      jobdir: str) -> None:
    # salloc runs its command where it is called (the cluster's head, as a login node); srun
    # starts one elasticstore-run a node, with no rendezvous flags
    done = subprocess.run(
        [cluster.bin("salloc"), "-N", "2", "srun", "--ntasks-per-node=1", RUN, "--nproc-per-node", "2",
         TRAIN, "--dir", jobdir, "--steps", "3", "--sleep", "0.1"],
        env=cluster.env, cwd=jobdir, capture_output=True, text=True, timeout=240, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    recs = records(jobdir)
    assert recs and {r["world"] for r in recs} == {4}, (recs, out)
    assert {r["rank"] for r in recs} == {0, 1, 2, 3}
    assert {(r["host"], r["node_rank"]) for r in recs} in ({("n1", 0), ("n2", 1)},
                                                           {("n1", 1), ("n2", 0)}), recs
    assert max(int(r["step"]) for r in recs) == 3  # type: ignore[call-overload]
    assert "from Slurm (step " in out and " on 2 node(s), n1): --rdzv-id " in out, out


def started(directory: str, world: int, step: int) -> dict[str, object]:
    """The first record of ``step`` at ``world`` (waits for it)."""
    found: list[dict[str, object]] = []

    def seen() -> bool:
        found[:] = [r for r in records(directory) if r["world"] == world and int(r["step"]) >= step]  # type: ignore[call-overload]
        return bool(found)

    wait_for(f"a step >= {step} at world size {world}", seen, 60, directory)
    return found[0]


NO_KILL = "--no-kill --kill-on-bad-exit=0"  # srun: the step goes on without a lost node


@pytest.mark.slow  # ~30 s: 3 nodes, one killed
def test_a_lost_node_leaves_the_others_training_at_the_smaller_size(
        cluster: slurm_cluster.Cluster, jobdir: str) -> None:
    job = cluster.sbatch(script(jobdir, "--nnodes 2:3 --max-restarts 3", steps=20, srun_flags=NO_KILL,
                                pause=0.15, nproc=1), "-N", "3", "--no-kill", cwd=jobdir)
    started(jobdir, 3, 3)
    killed = time.time()
    cluster.node_kill("n3")
    info = cluster.wait_job(job, timeout=120)
    out = output(jobdir, job)
    assert info["JobState"] == "COMPLETED", out
    after = [r for r in records(jobdir) if float(r["t"]) > killed + 0.5]  # type: ignore[arg-type]
    assert after and {r["world"] for r in after} == {2}, out
    assert {r["host"] for r in after} == {"n1", "n2"}
    assert max(int(r["step"]) for r in after) == 20  # type: ignore[call-overload]
    back = min(float(r["t"]) for r in after) - killed  # type: ignore[arg-type]
    print(f"from the kill to training again at world size 2: {back:.2f} s")


@pytest.mark.slow  # ~50 s: 3 nodes for 2, a participant killed, then another (join_timeout 20 s: the
# first round waits for the slowest agent to start, up to 12 s on a loaded 2-core machine)
def test_a_spare_node_replaces_a_lost_participant_and_a_job_below_its_minimum_ends_with_a_reason(
        cluster: slurm_cluster.Cluster, jobdir: str) -> None:
    body = (f"{RUN} --nproc-per-node 2 --nnodes 2:2 --max-restarts 3 --rdzv-conf join_timeout=20 "
            f"{TRAIN} --dir {jobdir} --steps 100000 --sleep 0.15; echo $? > {jobdir}/rc-$(hostname)")
    job = cluster.sbatch(f"#!/bin/sh\nsrun --ntasks-per-node=1 {NO_KILL} sh -c '{body}'\n",
                         "-N", "3", "--no-kill", cwd=jobdir)
    first = started(jobdir, 4, 3)
    hosts = {str(r["host"]) for r in records(jobdir)}
    assert len(hosts) == 2, hosts  # two participants, the third node stands by
    (spare,) = set(cluster.nodes) - hosts
    victim = str(first["host"]) if first["host"] != "n1" else sorted(hosts - {"n1"})[0]
    killed = time.time()
    cluster.node_kill(victim)
    now = hosts - {victim} | {spare}

    def replaced() -> bool:
        return {r["host"] for r in records(jobdir) if float(r["t"]) > killed + 0.5} == now  # type: ignore[arg-type]

    wait_for(f"{spare} training in {victim}'s place", replaced, 60, jobdir)
    after = [r for r in records(jobdir) if float(r["t"]) > killed + 0.5]  # type: ignore[arg-type]
    assert {r["world"] for r in after} == {4}, after  # the same world size
    back = min(float(r["t"]) for r in after) - killed  # type: ignore[arg-type]
    # no spare left: a second loss leaves one node of the two needed; it stops in bounded time
    second = sorted(now - {"n1"})[0]
    (survivor,) = now - {second}
    lost = time.monotonic()
    cluster.node_kill(second)
    rc = os.path.join(jobdir, f"rc-{survivor}")
    wait_for("the survivor exited", lambda: os.path.exists(rc), 60, jobdir)
    waited = time.monotonic() - lost
    with open(rc) as f:
        assert f.read().strip() not in ("", "0")
    cluster.wait_job(job, timeout=60)
    out = output(jobdir, job)
    assert "did not form within join_timeout=20s (nnodes 2:2)" in out, out
    print(f"from the kill to training again with the spare: {back:.2f} s; "
          f"one node left: it exited {waited:.1f} s after the second kill")
