"""Slurm's environment -> the launcher's flags, for the ones the command line leaves out.

Inside a job step (``srun --ntasks-per-node=1 elasticstore-run ...``, from an ``sbatch`` script
or an ``salloc`` shell) one agent runs per node, and Slurm's environment says what torchrun's glue
otherwise passes by hand:

=================== =============================================================================
flag                from
=================== =============================================================================
``--nnodes``        ``SLURM_STEP_NUM_NODES`` (``N``: a fixed count; give ``MIN:MAX`` to go on at
                    a smaller size after a node loss, or a ``MAX`` below ``N`` to keep hot spares)
``--rdzv-id``       ``SLURM_JOB_ID`` (the same after a requeue)
``--rdzv-endpoint`` the step's first ``ENDPOINT_HOSTS`` hosts (``SLURM_STEP_NODELIST``, Slurm's
                    compressed syntax expanded), each at port ``PORT_BASE + job id % PORT_SPAN``
``--local-addr``    ``SLURMD_NODENAME`` looked up forward: the address the other nodes reach this
                    node at (the node's name, as Slurm's own daemons reach it)
=================== =============================================================================

Outside a step (the batch script itself, an ``salloc`` shell) only this node runs: ``--nnodes 1``
and ``--rdzv-id`` from the job, with a notice naming the ``srun`` line that runs on every node.
A step that starts several tasks on a node is refused (each would be taken for a node) unless
``--nnodes`` is given. Nothing here is read below the command layer: it yields flag values only.

At exit (:func:`requeue_if_preempted`): a launcher that stops with a failure (its signal, or a
worker the signal reached first) inside a requeueable job that Slurm is preempting requeues it,
which Slurm itself does only for a job still running when the preemption's ``GraceTime`` ends.
By then the agent has written its node's newest snapshot to the checkpoint directory
(``agent/preempt_flush.py``), so the requeued job resumes from that step.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..runflags import UsageError
from .hostlist import HostListError, expand

__all__ = ["ENDPOINT_HOSTS", "PORT_BASE", "PORT_SPAN", "SlurmError", "SlurmJob", "flag_values",
           "requeue_if_preempted"]

SCONTROL_TIMEOUT = 10.0  # seconds one scontrol call may take at exit
PORT_BASE = 29400  # torch's default rendezvous port
PORT_SPAN = 1000  # jobs sharing a node get different ports (job id modulo this)
ENDPOINT_HOSTS = 16  # the store's host and the nodes that may take it over (failover)


class SlurmError(UsageError):
    """Slurm's environment is not what a job step sets, or does not fit the command line: names
    the variable (``elasticstore-run`` prints one line and exits 2)."""


@dataclass(frozen=True)
class SlurmJob:
    """What the launcher reads of Slurm's environment, parsed once."""

    job_id: str
    step_id: str | None  # None: the batch script or an salloc shell, not a step
    nodes: tuple[str, ...]  # the step's hosts (else the job's), expanded, in Slurm's order
    node_name: str | None  # SLURMD_NODENAME: this node
    tasks: int | None  # SLURM_STEP_NUM_TASKS

    @property
    def port(self) -> int:
        return PORT_BASE + (int(self.job_id) % PORT_SPAN if self.job_id.isdigit() else 0)

    @property
    def where(self) -> str:
        step = f"step {self.job_id}.{self.step_id}" if self.step_id is not None else f"job {self.job_id}"
        return f"{step} on {len(self.nodes)} node(s)"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> SlurmJob | None:
        """None outside a Slurm job; :class:`SlurmError` when its variables do not parse."""
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        if not job_id:
            return None
        step_id = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or None
        var = "SLURM_STEP_NODELIST" if step_id is not None else "SLURM_JOB_NODELIST"
        text = environ.get(var) or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")
        try:
            nodes = tuple(expand(text))
        except HostListError as exc:
            raise SlurmError(var, str(exc)) from None
        count = environ.get("SLURM_STEP_NUM_NODES") if step_id is not None else None
        if count is not None and count.strip() != str(len(nodes)):
            raise SlurmError("SLURM_STEP_NUM_NODES", f"{count!r} but {var}={text!r} names "
                             f"{len(nodes)} host(s)")
        tasks_text = environ.get("SLURM_STEP_NUM_TASKS") if step_id is not None else None
        tasks = int(tasks_text) if tasks_text and tasks_text.strip().isdigit() else None
        return cls(job_id=job_id.strip(), step_id=step_id, nodes=nodes,
                   node_name=environ.get("SLURMD_NODENAME") or None, tasks=tasks)


def _address(name: str) -> str | None:
    """``name`` as a numeric address (forward lookup only), None when it does not resolve."""
    try:
        return str(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return None


def flag_values(job: SlurmJob, given: frozenset[str], backend: str | None,
                ) -> tuple[dict[str, str], list[str]]:
    """The flag values (by argparse dest) Slurm's environment gives for the dests not in
    ``given``, and notices for the banner. ``backend``: ``--rdzv-backend``'s label when given
    (an endpoint is offered only to the native one: etcd's endpoint is not a job's node)."""
    values: dict[str, str] = {}
    notices: list[str] = []
    if {"standalone", "master_addr", "master_port", "node_rank"} & given:
        return values, [f"Slurm ({job.where}): not read (a static or standalone command line "
                        "was given: --master-addr, --master-port, --node-rank or --standalone)"]
    if "rdzv_id" not in given:
        values["rdzv_id"] = job.job_id
    if job.step_id is None:
        if "nnodes" not in given:
            values["nnodes"] = "1"
            if len(job.nodes) > 1:
                notices.append(f"Slurm: not in a job step: this node only (--nnodes 1); to run on "
                               f"all {len(job.nodes)} nodes of job {job.job_id}: srun "
                               "--ntasks-per-node=1 elasticstore-run ...")
        return values, [_banner(job, values), *notices]
    if "nnodes" not in given:
        if job.tasks is not None and job.tasks != len(job.nodes):
            raise SlurmError(
                "SLURM_STEP_NUM_TASKS", f"{job.where} runs {job.tasks} tasks: elasticstore-run starts a node's workers "
                "itself (--nproc-per-node); run one task per node (srun --ntasks-per-node=1), "
                "or give --nnodes")
        values["nnodes"] = str(len(job.nodes))
    native = backend in (None, "elasticstore")
    if native and "rdzv_endpoint" not in given:
        values["rdzv_endpoint"] = ",".join(f"{h}:{job.port}" for h in job.nodes[:ENDPOINT_HOSTS])
    if native and "local_addr" not in given and job.node_name is not None:
        addr = _address(job.node_name)
        if addr is not None:
            values["local_addr"] = addr
        else:
            notices.append(f"Slurm: this node's name {job.node_name!r} does not resolve: "
                           "give --local-addr (the address the other nodes reach it at)")
    return values, [_banner(job, values), *notices]


def _banner(job: SlurmJob, values: Mapping[str, str]) -> str:
    taken = " ".join(f"--{dest.replace('_', '-')} {value}" for dest, value in values.items())
    return f"from Slurm ({job.where}, {job.node_name or 'this node'}): {taken or 'nothing'}"


def _scontrol(*args: str) -> tuple[int, str]:
    exe = shutil.which("scontrol")
    if exe is None:
        return 127, "scontrol not found"
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, str(exc)
    return done.returncode, (done.stdout + done.stderr).strip()


def requeue_if_preempted(rc: int, environ: Mapping[str, str], say: Callable[[str], None]) -> None:
    """After the launcher stopped with a failure (``rc`` not 0: its signal, 128 + N, or a worker
    that Slurm's SIGTERM reached first) inside a requeueable Slurm job that is being preempted:
    requeues the job, saying so through ``say`` *before* it asks (the requeue ends the step, and
    with it the forwarding of this process's output). Slurm requeues a preempted job only when it
    is still running at the end of its ``GraceTime``; a job whose launcher stopped its workers and
    exited within it would end ``FAILED`` (or ``COMPLETED``) instead. Cancelled, timed out or
    already requeued jobs are left alone (their state is not ``RUNNING`` with a ``PreemptTime``)."""
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job or rc == 0:
        return
    code, text = _scontrol("show", "job", "-o", job)
    if code != 0:
        say(f"Slurm: could not read job {job} to see whether it is being preempted: {text}")
        return
    fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
    preempted = fields.get("PreemptTime", "None") not in ("None", "Unknown", "")
    if not (preempted and fields.get("JobState") == "RUNNING" and fields.get("Requeue") == "1"):
        return
    say(f"Slurm: job {job} is being preempted (since {fields['PreemptTime']}) and is requeueable: "
        "requeueing it (Slurm requeues only a job still running when its GraceTime ends)")
    code, text = _scontrol("requeue", job)
    if code != 0:  # another node of the job asked first
        say(f"Slurm: job {job}: requeue: {text or code}")
