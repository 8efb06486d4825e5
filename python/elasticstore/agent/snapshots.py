"""The node's memory for its workers' snapshots (``elasticstore.train.Snapshots``) and its other
per-agent files (the heartbeat board, the stacks files).

The agent creates one directory per job and node, ``<root>/elasticstore-snapshots.<run id>.<random>``
(root: ``/dev/shm``, or ``ELASTICSTORE_SNAPSHOT_ROOT``), mode 0700, and gives its path to every
worker in ``ELASTICSTORE_SNAPSHOT_DIR``. It keeps it across worker restarts and rounds, and removes
it when it ends, whatever the outcome (success, failure, signal, operator stop). Without that root
(no ``/dev/shm``) the directory is made under the temporary directory for the agent's own files
only: workers then keep their snapshots in their own memory.

The agent holds an exclusive ``flock`` on the directory's ``.owner`` file for as long as it runs
(the directory is made under a temporary name and renamed once locked, so no area is ever seen
unlocked while alive). The kernel drops the lock when the agent's process ends, however it ends,
and the lock is the same in every PID namespace that shares the file system (containers sharing
``/dev/shm`` with ``--ipc=host``): an area is judged stale by that lock, never by a pid, which
another PID namespace cannot see.

An agent killed with SIGKILL runs no code, so a reaper removes the directory then: a small process
(this file run as a script, standard library only) started in a session of its own, blocked
reading a pipe whose only writer is the agent. The kernel closes the pipe when the agent dies, for
any reason; the read returns and the reaper removes the directory (again until no worker left in
the middle of a write recreates a file in it) and exits. A pipe is used, not PR_SET_PDEATHSIG:
the death signal follows the thread that started the child, not the process, and a signal can be
lost before the reaper installs its handler; the end of a pipe cannot. Should the reaper itself be
killed too (a SIGKILL of every process of the machine's user, the OOM killer), the next agent's
start removes the directories whose lock nobody holds (``remove_stale``).

Each round, ``replicate`` has the node's newest sharded snapshots copied to the next node of the
round (a ring) and takes the previous node's into ``replicas/`` (``elasticstore.replicas``), so
that the loss of a whole node costs at most about one step.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from typing import Any

__all__ = ["ROOT_ENV", "SNAPSHOT_DIR_ENV", "SnapshotArea", "remove_stale", "skipped_checkpoints"]

SNAPSHOT_DIR_ENV = "ELASTICSTORE_SNAPSHOT_DIR"  # what workers read (train/snapshots/writer.py)
ROOT_ENV = "ELASTICSTORE_SNAPSHOT_ROOT"  # where the agent creates its directory
DEFAULT_ROOT = "/dev/shm"
PREFIX = "elasticstore-snapshots."
OWNER = ".owner"  # the file whose flock the owning agent holds
CREATING = ".elasticstore-creating."  # a directory not yet locked (judged after CREATING_GRACE_S)
# An agent takes its lock a moment after making its directory: another agent starting then (the
# nodes of one machine, or containers sharing /dev/shm) must not take the unlocked owner file for
# a dead agent's, lock it, and fail the first agent's start ("cannot lock"); a directory still
# being made is judged once it is older than this.
CREATING_GRACE_S = 60.0
REMOVE_FOR_S = 30.0  # how long removal retries while workers still write (they die with the agent)


def remove_tree(path: str, within: float = REMOVE_FOR_S) -> bool:
    """Removes ``path`` and what is in it; retries while files appear in it (a worker finishing a
    write). Whether it is gone."""
    deadline = time.monotonic() + within
    while True:
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path) or time.monotonic() > deadline:
            return not os.path.lexists(path)
        time.sleep(0.05)


def _lock(path: str, create: bool) -> int | None:
    """An fd holding the exclusive flock of ``path``'s owner file; None when another process holds
    it (or, without ``create``, when there is no owner file: not an area of this version)."""
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(os.path.join(path, OWNER), flags, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_stale(root: str) -> list[str]:
    """Removes this user's areas under ``root`` whose owner lock nobody holds (their agent and
    reaper are gone, in whatever PID namespace they ran; also one an agent was making when it
    died, once older than ``CREATING_GRACE_S``); returns them. A directory without an owner file
    is not judged."""
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith((PREFIX, CREATING))]
    except OSError:
        return []
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != os.getuid():
            continue
        if name.startswith(CREATING) and time.time() - st.st_mtime < CREATING_GRACE_S:
            continue  # being made: its agent may not hold its lock yet
        fd = _lock(path, create=False)
        if fd is None:
            continue  # alive (locked), or no owner file: not judged
        try:
            if remove_tree(path, within=1.0):
                removed.append(path)
        finally:
            os.close(fd)
    return removed


SKIPPED = ".skipped.local-"  # what workers write (train/snapshots/fileformat.py: write_skipped)


def skipped_checkpoints(path: str | None) -> dict[int, int]:
    """Local rank -> the disk checkpoints its workers skipped because the disk lagged (read from
    the files they keep in the area ``path``)."""
    found: dict[int, int] = {}
    try:
        names = [n for n in os.listdir(path) if n.startswith(SKIPPED)] if path else []
    except OSError:
        return found
    for name in names:
        try:
            with open(os.path.join(path or "", name)) as f:
                found[int(name[len(SKIPPED):])] = int(f.read())
        except (OSError, ValueError):
            continue  # a temporary file, or the area removed meanwhile
    return found


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64]


class SnapshotArea:
    """The agent's directory (locked while it runs) and its reaper; ``close`` removes both.
    ``path``: the directory (None only when none could be made); ``snapshots``: whether workers
    keep their snapshots in it (a memory file system was found)."""

    def __init__(self, run_id: str, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        root = env.get(ROOT_ENV) or DEFAULT_ROOT
        self.snapshots = os.path.isdir(root)
        if not self.snapshots:
            root = tempfile.gettempdir()  # the agent's own files only (the heartbeat board)
        self.path: str | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self._lock_fd: int | None = None
        self._replicas: Any = None  # elasticstore.replicas.ReplicaService, from the first round
        remove_stale(root)
        creating = os.path.join(root, f"{CREATING}{uuid.uuid4().hex}")
        path = os.path.join(root, f"{PREFIX}{_safe(run_id)}.{uuid.uuid4().hex[:16]}")
        try:
            os.mkdir(creating, 0o700)
        except OSError:
            self.snapshots = False
            return  # a root we cannot write: workers keep snapshots in their own memory
        try:
            self._lock_fd = _lock(creating, create=True)
            if self._lock_fd is None:
                raise OSError(f"cannot lock {creating}/{OWNER}")
            os.rename(creating, path)
            self._reaper = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), path], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        except BaseException:
            self.path = path
            self.close()
            shutil.rmtree(creating, ignore_errors=True)
            raise
        self.path = path

    def env(self) -> dict[str, str]:
        """What the workers get."""
        return {SNAPSHOT_DIR_ENV: self.path} if self.path is not None and self.snapshots else {}

    def replicate(self, info: Any, attempt: int, settings: Any) -> None:
        """The round's replica ring (``info``: the round's ``RendezvousInfo``: its store, this
        node's rank among its nodes; ``settings``: the agent's). Whatever fails is said, never
        raised: replicas are an addition, the job runs without them."""
        from .logs import say  # here: this file also runs as the reaper

        if not self.snapshots or self.path is None:
            return
        try:
            if self._replicas is None:
                from ..replicas import ReplicaService
                from ..stores.native import read_token_file, resolve_token

                token = (read_token_file(settings.token_file) if settings.token_file
                         else resolve_token(None))
                self._replicas = ReplicaService(self.path, settings.nproc, settings.host, token, say)
            self._replicas.new_round(info.store, attempt, info.rank, info.world_size)
        except Exception as err:
            say(f"[elasticstore-run] no replicas of this node's snapshots: {type(err).__name__}: {err}")

    def close(self, flush_within: float | None = None) -> None:
        """Removes the directory (the workers are stopped), then lets the reaper go.
        ``flush_within``: stopped by a signal, this many seconds are left of the grace period
        for writing the newest snapshot to the checkpoint directory first (``preempt_flush.py``)."""
        replicas, self._replicas = self._replicas, None
        if replicas is not None:
            replicas.close()  # first: nothing arrives in the directory while it is removed
        if flush_within is not None and self.path is not None and self.snapshots:
            from .preempt_flush import flush_newest  # here: this file also runs as the reaper

            flush_newest(self.path, flush_within)
        if self.path is not None:
            remove_tree(self.path)
            self.path = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
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
