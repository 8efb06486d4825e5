"""``elasticstore-run`` under a real Slurm cluster (slurmctld and three slurmd, each node in a
network namespace of its own: ``tests/helpers/slurm_cluster.py``), as users run it: ``sbatch``
scripts whose ``srun`` starts one ``elasticstore-run`` a node with no rendezvous flags. The
workers (gloo) record their rank, world size, node rank and step (``programs/slurm_train.py``);
the tests read those facts and the job's state as Slurm reports it.

The cluster is started once for the module and always torn down (checked: no daemon, namespace
or cgroup left). Skipped, saying why, without root or Slurm's packages (scripts/setup-system).
"""

from __future__ import annotations

import glob
import json
import os
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
    with slurm_cluster.running(3) as c:
        yield c


@pytest.fixture
def jobdir(cluster: slurm_cluster.Cluster) -> Iterator[str]:
    """A directory all nodes share for one test's job; every job over and every node idle after."""
    path = tempfile.mkdtemp(prefix="es-slurm-job-")
    try:
        yield path
    finally:
        cluster.cancel_all()


def records(directory: str) -> list[dict[str, object]]:
    out = []
    for name in glob.glob(os.path.join(directory, "rec-*.jsonl")):
        with open(name) as f:
            out += [json.loads(line) for line in f if line.endswith("\n")]
    return sorted(out, key=lambda r: float(r["t"]))  # type: ignore[arg-type]


def output(directory: str, job: str) -> str:
    with open(os.path.join(directory, f"out-{job}.txt")) as f:
        return f.read()


def wait_for(what: str, pred: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.2)


def script(directory: str, run_flags: str, steps: int, srun_flags: str = "", pause: float = 0.1) -> str:
    return (f"#!/bin/sh\nsrun --ntasks-per-node=1 {srun_flags} {RUN} --nproc-per-node 2 {run_flags} "
            f"{TRAIN} --dir {directory} --steps {steps} --sleep {pause}\n")


@pytest.mark.slow  # ~10-20 s: a 2-node job of 4 gloo workers
def test_zero_config_srun_runs_one_job_across_the_allocation(cluster: slurm_cluster.Cluster,
                                                             jobdir: str) -> None:
    job = cluster.sbatch(script(jobdir, "", steps=3), "-N", "2", cwd=jobdir)
    info = cluster.wait_job(job, timeout=90)
    out = output(jobdir, job)
    assert info["JobState"] == "COMPLETED", out
    recs = records(jobdir)
    assert {r["world"] for r in recs} == {4}, recs
    assert {r["rank"] for r in recs} == {0, 1, 2, 3}
    assert {(r["host"], r["node_rank"]) for r in recs} in ({("n1", 0), ("n2", 1)}, {("n1", 1), ("n2", 0)})
    assert {r["step"] for r in recs} == {0, 1, 2, 3}
    # the banner says what it took from Slurm, on each node
    for node, addr in (("n1", "10.77.0.11"), ("n2", "10.77.0.12")):
        assert (f"from Slurm (step {job}.0 on 2 node(s), {node}): --rdzv-id {job} --nnodes 2 "
                f"--rdzv-endpoint n1:{29400 + int(job)},n2:{29400 + int(job)} --local-addr {addr}") in out, out
