"""A real Slurm cluster for the tests: ``slurm/up.sh netns`` starts munged, slurmctld (``head``)
and one slurmd per node (``n1``..``nN``), each node in a network namespace of its own with its
own address; ``slurm/down.sh`` stops every process of it (by its tracking cgroup) and removes its
namespaces. Each cluster gets its own directory, namespace prefix and cgroup, so it never meets
another cluster on the machine; :func:`running` checks on the way out that nothing is left.

Needs root and Slurm's packages (``scripts/setup-system`` installs them as root):
:func:`missing` says what is missing, for a skip reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slurm")
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "unshare", "nsenter", "ip")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE")


def missing() -> str | None:
    """Why no cluster can start here, or None."""
    if os.geteuid() != 0:
        return "the Slurm cluster needs root (namespaces, cgroups, slurmd as root)"
    absent = [t for t in TOOLS if shutil.which(t) is None and not os.path.exists(f"/usr/sbin/{t}")]
    if absent:
        return f"{', '.join(absent)} missing: scripts/setup-system installs slurmctld slurmd slurm-client munge"
    if not (os.path.exists("/sys/fs/cgroup/cgroup.controllers")
            or os.path.exists("/sys/fs/cgroup/unified/cgroup.procs")):
        return "no cgroup v2 hierarchy"
    return None


@dataclass
class Cluster:
    base: str
    nodes: tuple[str, ...]
    netns_prefix: str
    cgroup: str
    env: dict[str, str]

    def bin(self, name: str) -> str:
        return os.path.join(self.base, "bin", name)

    def call(self, name: str, *args: str, timeout: float = 30.0) -> str:
        """A client command of this cluster (run in the head's namespace); its stdout."""
        done = subprocess.run([self.bin(name), *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{name} {' '.join(args)}: rc {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, script: str, *args: str, cwd: str) -> str:
        """Submits ``script`` (the text of a batch script); the job id."""
        path = os.path.join(cwd, f"job-{uuid.uuid4().hex[:6]}.sh")
        with open(path, "w") as f:
            f.write(script)
        os.chmod(path, 0o755)
        return self.call("sbatch", "--parsable", "-D", cwd, "-o", os.path.join(cwd, "out-%j.txt"),
                         *args, path).strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``'s fields (JobState, ExitCode, Restarts, NodeList, ...)."""
        text = self.call("scontrol", "show", "job", "-o", job_id)
        return dict(f.split("=", 1) for f in text.split() if "=" in f)

    def wait_job(self, job_id: str, timeout: float, states: tuple[str, ...] = FINAL) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        info = self.job(job_id)
        while info.get("JobState") not in states:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout} s: {info}")
            time.sleep(0.3)
            info = self.job(job_id)
        return info

    def node_kill(self, node: str, mark_down: bool = True) -> None:
        """SIGKILLs the node's slurmd, step daemons and job tasks, as a crash would. ``mark_down``:
        then marks it DOWN at once, as slurmctld does on its own ``SlurmdTimeout`` later (25-27 s
        with the cluster's 10 s): what ends the lost node's part of the job, sooner."""
        subprocess.run([self.bin("node-kill"), node], env=self.env, check=True, timeout=30)
        if mark_down:
            self.call("scontrol", "update", f"nodename={node}", "state=down", "reason=node-kill")

    def node_start(self, node: str, timeout: float = 30.0) -> None:
        """Starts the node's slurmd again and waits until Slurm has it idle."""
        subprocess.run([self.bin("node-start"), node], env=self.env, check=True, timeout=30)
        self.wait_idle((node,), timeout)

    def wait_idle(self, nodes: tuple[str, ...] | None = None, timeout: float = 30.0) -> None:
        want = set(nodes or self.nodes)
        deadline = time.monotonic() + timeout
        for _ in range(int(timeout / 0.2) + 1):
            rows = self.call("sinfo", "-h", "-N", "-p", "batch", "-o", "%N %t").split()
            states = dict(zip(rows[::2], rows[1::2]))
            if all(states.get(n) == "idle" for n in want):
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        raise TimeoutError(f"nodes not idle after {timeout} s: {states}")

    def cancel_all(self, timeout: float = 40.0) -> None:
        """Ends every job (scancel), restarts any node that is down, waits for all idle."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.call("scancel", "--full", "-u", "root")
        for node in self.nodes:
            if not self.slurmd_alive(node):
                subprocess.run([self.bin("node-start"), node], env=self.env, check=True, timeout=30)
        self.wait_idle(timeout=timeout)

    def slurmd_alive(self, node: str) -> bool:
        try:
            with open(os.path.join(self.cgroup_path, node, "cgroup.procs")) as f:
                return bool(f.read().split())
        except OSError:
            return False

    @property
    def cgroup_path(self) -> str:
        with open(os.path.join(self.base, "run", "cgroup")) as f:
            return f.read().strip()


def _leftovers(base: str, prefix: str, cgroup_path: str | None) -> list[str]:
    left = [f"network namespace {n}" for n in os.listdir("/run/netns")
            if n.startswith(prefix + "-")] if os.path.isdir("/run/netns") else []
    if cgroup_path and os.path.exists(cgroup_path):
        left.append(f"cgroup {cgroup_path}")
    with open("/proc/mounts") as f:
        left += [f"mount {line.split()[1]}" for line in f if base in line]
    return left


@contextlib.contextmanager
def running(nodes: int = 3, **knobs: str) -> Iterator[Cluster]:
    """A cluster of ``nodes`` slurmd, torn down (and checked gone) however the block ends."""
    base = tempfile.mkdtemp(prefix="es-slurm-")
    os.chmod(base, 0o755)  # munged refuses a socket under a directory others cannot enter
    tag = uuid.uuid4().hex[:6]
    env = dict(os.environ, SLURM_TEST_DIR=base, NETNS_PREFIX=f"es{tag}", NNODES=str(nodes),
               SLURM_TEST_CGROUP=f"es-slurm-{tag}", **knobs)
    for var in list(env):  # a job's own variables must not reach the cluster's daemons
        if var.startswith("SLURM_") and var not in ("SLURM_TEST_DIR", "SLURM_TEST_CGROUP"):
            del env[var]
    env["SLURM_CONF"] = os.path.join(base, "slurm.conf")
    cgroup_path = None
    try:
        done = subprocess.run(["bash", os.path.join(HERE, "up.sh"), "netns"], env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        with contextlib.suppress(OSError):
            with open(os.path.join(base, "run", "cgroup")) as f:
                cgroup_path = f.read().strip()
        if done.returncode != 0:
            raise RuntimeError(f"up.sh: rc {done.returncode}: {done.stdout}{done.stderr}")
        yield Cluster(base, tuple(f"n{i}" for i in range(1, nodes + 1)), f"es{tag}",
                      f"es-slurm-{tag}", env)
    finally:
        subprocess.run(["bash", os.path.join(HERE, "down.sh")], env=env, capture_output=True,
                       timeout=60, check=False)
        left = _leftovers(base, f"es{tag}", cgroup_path)
        shutil.rmtree(base, ignore_errors=True)
        if left:
            raise RuntimeError(f"the Slurm cluster left {', '.join(left)} behind")
