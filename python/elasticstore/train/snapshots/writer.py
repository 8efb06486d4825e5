"""In-memory snapshots of the training state: a failure costs about one step, not a checkpoint
interval.

Every step (or every ``every`` steps) a worker hands its state to ``Snapshots.snapshot``: the
call copies the tensors into memory that outlives the worker, a file in the directory that the
agent (``elasticstore-run``) names in ``ELASTICSTORE_SNAPSHOT_DIR`` (under ``/dev/shm``: RAM, one
per job and node, kept across worker restarts and rounds, removed when the agent ends). The step
is blocked for that copy only. At most ``KEEP_PER_RANK`` complete snapshots exist per local rank:
the older one's memory is reused for the next. With ``checkpoint_dir``, every
``checkpoint_every``-th step's snapshot is also written to disk by a background thread
(``save_checkpoint``: atomic, durable), by the ranks given ``write_checkpoints``.

``Snapshots.restore`` (a collective) returns the newest step that every rank can get: from this
node's memory, else from another node's (the lowest rank holding it broadcasts it: DDP replicas
are identical, one copy is enough), else from disk (``load_checkpoint_from_any_rank``), and says
which.

Without ``ELASTICSTORE_SNAPSHOT_DIR`` (plain ``python``, ``torchrun``) snapshots live in the
process's own memory: nothing survives the process, ``restore`` reads disk checkpoints only, and
the disk checkpoints are written as with the agent. See ``docs/training.md``.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import list_checkpoints, load_checkpoint_from_any_rank, save_checkpoint
from .snapshot_file import (
    Buffer,
    decode,
    encode,
    list_snapshots,
    read_snapshot,
    snapshot_name,
    stale_tmp_files,
    tmp_name,
)

__all__ = ["KEEP_PER_RANK", "SNAPSHOT_DIR_ENV", "Restored", "SnapshotSettings", "Snapshots"]

SNAPSHOT_DIR_ENV = "ELASTICSTORE_SNAPSHOT_DIR"
KEEP_PER_RANK = 2  # complete snapshots kept per local rank (older ones are reused or freed)

State = Mapping[str, Any]


@dataclass(frozen=True)
class SnapshotSettings:
    """Where snapshots go: the agent's directory (None: the process's own memory) and the local
    rank whose files this process writes."""

    directory: str | None
    local_rank: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SnapshotSettings:
        env = os.environ if env is None else env
        directory = env.get(SNAPSHOT_DIR_ENV) or None
        if directory is not None and not os.path.isdir(directory):
            warnings.warn(f"{SNAPSHOT_DIR_ENV}={directory} is not a directory: snapshots stay in "
                          "this process's memory", RuntimeWarning, stacklevel=3)
            directory = None
        try:
            local_rank = int(env.get("LOCAL_RANK", "0"))
        except ValueError as err:
            raise ValueError(f"LOCAL_RANK={env.get('LOCAL_RANK')!r} is not an integer") from err
        return cls(directory, local_rank)


@dataclass(frozen=True)
class Restored:
    """What ``Snapshots.restore`` found: the step, the state given to ``snapshot`` (tensors on
    the CPU), and where it came from: ``"memory"`` (this node's), ``"peer"`` (another rank's
    memory, sent by ``detail``: ``rank N``) or ``"disk"`` (``detail``: the checkpoint file)."""

    step: int
    state: Any
    source: str
    detail: str


class Snapshots:
    """Snapshots of one worker's training state; see the module's documentation.

    ``every``: snapshot every ``every``-th step (0: only the steps of disk checkpoints).
    ``checkpoint_dir``/``checkpoint_every``/``keep_checkpoints``: disk checkpoints, written in the
    background from the snapshots of every ``checkpoint_every``-th step by the ranks where
    ``write_checkpoints`` is true (default: global rank 0). ``settings``: default from the
    environment. Use as a context manager, or call ``close`` (it waits for the disk checkpoint
    being written)."""

    def __init__(self, *, every: int = 1, checkpoint_dir: str | os.PathLike[str] | None = None,
                 checkpoint_every: int = 0, keep_checkpoints: int = 2,
                 write_checkpoints: bool | None = None,
                 settings: SnapshotSettings | None = None) -> None:
        if every < 0 or checkpoint_every < 0:
            raise ValueError(f"every ({every}) and checkpoint_every ({checkpoint_every}) must be >= 0")
        if checkpoint_dir is not None and checkpoint_every < 1:
            raise ValueError("checkpoint_dir needs checkpoint_every >= 1")
        self.settings = settings or SnapshotSettings.from_env()
        self.every = every
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        if write_checkpoints is None:
            write_checkpoints = (dist.get_rank() if dist.is_initialized()
                                 else int(os.environ.get("RANK", "0"))) == 0
        self.write_checkpoints = write_checkpoints and self.checkpoint_dir is not None
        self.last_copy_s = 0.0  # how long the latest snapshot blocked its step
        self.last_bytes = 0
        self._published: list[Buffer] | None = None  # oldest first (None: not listed yet)
        self._lock = threading.Lock()  # the buffers' pinned state, with the disk thread
        self._pinned: set[int] = set()  # ids of buffers a pending disk checkpoint reads
        self._disk: queue.Queue[tuple[int, Buffer] | None] = queue.Queue()
        self._disk_thread: threading.Thread | None = None
        self._disk_error: BaseException | None = None
        self._closed = False

    # -- taking snapshots ---------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether ``snapshot`` at ``step`` takes one (a multiple of ``every`` or of
        ``checkpoint_every``)."""
        return ((self.every > 0 and step % self.every == 0)
                or (self.checkpoint_dir is not None and step % self.checkpoint_every == 0))

    def snapshot(self, state: State | Callable[[], State], step: int) -> bool:
        """Copies ``state`` (a dict of tensors and plain, picklable Python objects; or a function
        returning it, called only when due) as the snapshot of ``step`` when ``due(step)``;
        returns whether it did. Blocks for the copy; the disk checkpoint of the step, when one
        is due, is written in the background."""
        if self._closed:
            raise RuntimeError("Snapshots is closed")
        if self._disk_error is not None:
            err, self._disk_error = self._disk_error, None
            raise RuntimeError(f"the background disk checkpoint failed: {err}") from err
        if not self.due(step):
            return False
        started = time.perf_counter()
        value = state() if callable(state) else state
        buf = self._take_buffer(step)
        try:
            self.last_bytes = encode(value, step, buf)
            buf.rename(self._path(snapshot_name(step, self.settings.local_rank)))
        except BaseException:
            buf.free()
            raise
        assert self._published is not None
        with self._lock:
            self._published.append(buf)
        self.last_copy_s = time.perf_counter() - started
        if self.write_checkpoints and step % self.checkpoint_every == 0:
            with self._lock:
                self._pinned.add(id(buf))
            self._start_disk_thread()
            self._disk.put((step, buf))
        return True

    def _path(self, name: str) -> str | None:
        d = self.settings.directory
        return None if d is None else os.path.join(d, name)

    def _adopt(self, step: int) -> list[Buffer]:
        """This local rank's complete snapshots from an earlier process, older than ``step``
        (those of ``step`` or later belong to a run that went further, then back: removed)."""
        d, local = self.settings.directory, self.settings.local_rank
        if d is None:
            return []
        for path in stale_tmp_files(d, local):
            os.unlink(path)
        mine = [(s, p) for s, lr, p in list_snapshots(d) if lr == local]
        for s, p in mine:
            if s >= step:
                os.unlink(p)
        return [Buffer.adopt(p, s) for s, p in mine if s < step]

    def _take_buffer(self, step: int) -> Buffer:
        """Memory for the next snapshot, taken out of view first (renamed to a temporary name):
        the oldest complete one when ``KEEP_PER_RANK`` exist, else new memory."""
        if self._published is None:
            self._published = self._adopt(step)
        while self._published and self._published[-1].step >= step:  # a step taken again
            self._retire(self._published[-1])
        tmp = self._path(tmp_name(self.settings.local_rank))
        while len(self._published) > KEEP_PER_RANK - 1:
            old = self._published[0]
            if self._retire(old, reuse=True):
                old.rename(tmp)
                return old
        return Buffer(tmp)

    def _retire(self, buf: Buffer, reuse: bool = False) -> bool:
        """Takes ``buf`` off the list. A pending disk checkpoint still reads it: out of view
        (renamed), the disk thread frees it after; else freed, or (``reuse``) returns True."""
        assert self._published is not None
        with self._lock:  # with the disk thread's check whether a buffer is still listed
            self._published.remove(buf)
            if id(buf) in self._pinned:
                buf.rename(self._path(tmp_name(self.settings.local_rank)))
                return False
        if not reuse:
            buf.free()
        return reuse

    # -- disk checkpoints in the background ---------------------------------------------------

    def _start_disk_thread(self) -> None:
        if self._disk_thread is None:
            self._disk_thread = threading.Thread(target=self._disk_loop, name="snapshot-disk",
                                                 daemon=True)
            self._disk_thread.start()
            atexit.register(self._flush_at_exit)  # a script that ends without close()

    def _flush_at_exit(self) -> None:
        try:
            self.flush()
        except RuntimeError as err:
            warnings.warn(str(err), RuntimeWarning, stacklevel=1)

    def _disk_loop(self) -> None:
        assert self.checkpoint_dir is not None
        for item in iter(self._disk.get, None):
            step, buf = item
            try:
                _, state = decode(buf)
                with self._lock:
                    self._pinned.discard(id(buf))
                    orphan = self._published is not None and buf not in self._published
                if orphan:
                    buf.free()
                save_checkpoint(self.checkpoint_dir, state, step, keep=self.keep_checkpoints)
            except BaseException as err:  # noqa: BLE001 - reported by the next snapshot call
                self._disk_error = err

    def flush(self) -> None:
        """Waits until the disk checkpoints due so far are written."""
        if self._disk_thread is not None:
            self._disk.put(None)
            self._disk_thread.join()
            self._disk_thread = None
            atexit.unregister(self._flush_at_exit)
        if self._disk_error is not None:
            err, self._disk_error = self._disk_error, None
            raise RuntimeError(f"the background disk checkpoint failed: {err}") from err

    def close(self) -> None:
        """Waits for the disk checkpoint being written; unmaps the snapshots (their files stay
        for the next worker: the agent removes them when the job ends)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            for buf in self._published or []:
                if buf.path is not None:
                    buf.close()
                else:
                    buf.free()
            self._published = []

    def __enter__(self) -> Snapshots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restoring ----------------------------------------------------------------------------

    def restore(self, group: dist.ProcessGroup | None = None) -> Restored | None:
        """The newest step every rank of ``group`` can get (a collective when a process group is
        initialised; ``group`` must take CPU tensors, e.g. gloo). None when there is none."""
        from .snapshot_restore import restore

        return restore(self, group)

    def local_candidates(self) -> tuple[list[tuple[int, int, str]], int]:
        """(this node's complete snapshots, the newest step of the local checkpoint directory or
        -1)."""
        d = self.settings.directory
        mem = list_snapshots(d) if d is not None else []
        disk = list_checkpoints(self.checkpoint_dir) if self.checkpoint_dir else []
        return mem, (disk[-1][0] if disk else -1)


def read_local(candidates: list[tuple[int, int, str]], step: int,
               local_rank: int) -> tuple[Any, str] | None:
    """The state of ``step`` from this node's snapshots (this local rank's file first, then the
    others'); None when none of them reads."""
    paths = sorted((lr != local_rank, p) for s, lr, p in candidates if s == step)
    for _, path in paths:
        try:
            got, state = read_snapshot(path)
        except (OSError, ValueError, EOFError, RuntimeError) as err:
            warnings.warn(f"skipping snapshot {path}: {type(err).__name__}: {err}",
                          RuntimeWarning, stacklevel=3)
            continue
        if got == step:
            return state, path
    return None


def _checkpoint_load(directory: str, group: dist.ProcessGroup | None) -> Restored | None:
    ckpt = load_checkpoint_from_any_rank(directory, group)
    return None if ckpt is None else Restored(ckpt.step, ckpt.state, "disk", ckpt.path)


def newest(values: list[int], group: dist.ProcessGroup | None, op: Any) -> list[int]:
    """``values`` reduced over ``group`` with ``op`` (as they are without a process group)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=op, group=group)
    return [int(v) for v in t.tolist()]
