"""The node's memory for its workers' snapshots (``elasticstore.train.Snapshots``).

The agent creates one directory per job and node, ``<root>/elasticstore-snapshots.<run id>.<agent
pid>.<its start time>.<random>`` (root: ``/dev/shm``, or ``ELASTICSTORE_SNAPSHOT_ROOT``), mode 0700, and gives its
path to every worker in ``ELASTICSTORE_SNAPSHOT_DIR``. It keeps it across worker restarts and
rounds, and removes it when it ends, whatever the outcome (success, failure, signal, operator stop).

An agent killed with SIGKILL runs no code, so a reaper removes the directory then: a small process
(this file run as a script, standard library only) started in a session of its own, blocked
reading a pipe whose only writer is the agent. The kernel closes the pipe when the agent dies, for
any reason; the read returns and the reaper removes the directory (again until no worker left in
the middle of a write recreates a file in it) and exits. A pipe is used, not PR_SET_PDEATHSIG:
the death signal follows the thread that started the child, not the process, and a signal can be
lost before the reaper installs its handler; the end of a pipe cannot. Should the reaper itself be
killed too (a SIGKILL of every process of the machine's user, the OOM killer), the next agent's
start removes directories whose agent no longer runs (``remove_stale``: the pid and its start
time are in the name, so a reused pid is not taken for the agent).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping

__all__ = ["ROOT_ENV", "SNAPSHOT_DIR_ENV", "SnapshotArea", "remove_stale"]

SNAPSHOT_DIR_ENV = "ELASTICSTORE_SNAPSHOT_DIR"  # what workers read (train/snapshot.py)
ROOT_ENV = "ELASTICSTORE_SNAPSHOT_ROOT"  # where the agent creates its directory
DEFAULT_ROOT = "/dev/shm"
PREFIX = "elasticstore-snapshots."
REMOVE_FOR_S = 30.0  # how long removal retries while workers still write (they die with the agent)


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def remove_tree(path: str, within: float = REMOVE_FOR_S) -> bool:
    """Removes ``path`` and what is in it; retries while files appear in it (a worker finishing a
    write). Whether it is gone."""
    deadline = time.monotonic() + within
    while True:
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path) or time.monotonic() > deadline:
            return not os.path.lexists(path)
        time.sleep(0.05)


def remove_stale(root: str) -> list[str]:
    """Removes this user's snapshot directories under ``root`` whose agent no longer runs;
    returns them."""
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return []
    for name in names:
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            _, pid_s, started, _ = name.rsplit(".", 3)
            alive = _start_time(int(pid_s)) == started
        except (OSError, ValueError):
            continue
        if not alive and remove_tree(path, within=1.0):
            removed.append(path)
    return removed


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64]


class SnapshotArea:
    """The agent's snapshot directory and its reaper; ``close`` removes both."""

    def __init__(self, run_id: str, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        root = env.get(ROOT_ENV) or DEFAULT_ROOT
        self.path: str | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        if not os.path.isdir(root):
            return  # no /dev/shm: workers keep snapshots in their own memory
        remove_stale(root)
        pid = os.getpid()
        path = os.path.join(
            root, f"{PREFIX}{_safe(run_id)}.{pid}.{_start_time(pid)}.{uuid.uuid4().hex[:8]}")
        os.mkdir(path, 0o700)
        try:
            self._reaper = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), path], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        except BaseException:
            self.close()
            shutil.rmtree(path, ignore_errors=True)
            raise
        self.path = path

    def env(self) -> dict[str, str]:
        """What the workers get."""
        return {SNAPSHOT_DIR_ENV: self.path} if self.path is not None else {}

    def close(self) -> None:
        """Removes the directory (the workers are stopped), then lets the reaper go."""
        if self.path is not None:
            remove_tree(self.path)
            self.path = None
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            assert reaper.stdin is not None
            reaper.stdin.close()  # the reaper finds nothing left to remove and exits
            try:
                reaper.wait(10)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait()


def _reap(path: str) -> int:
    """The reaper: waits for the end of standard input (the agent closed it, or died)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a signal to the agent's terminal is not for it
    while os.read(0, 4096):
        pass
    remove_tree(path)
    return 0


if __name__ == "__main__":
    sys.exit(_reap(sys.argv[1]))
