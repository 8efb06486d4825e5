"""In-memory snapshots of the training state: a failure costs about one step, not a checkpoint
interval.

Every step (or every ``every`` steps) a worker hands its state to ``Snapshots.snapshot``: the
call copies the tensors into memory that outlives the worker, a file in the directory that the
agent (``elasticstore-run``) names in ``ELASTICSTORE_SNAPSHOT_DIR`` (under ``/dev/shm``: RAM, one
per job and node, kept across worker restarts and rounds, removed when the agent ends). The step
is blocked for that copy only, or less: an optimizer's tensors of a large CPU state are copied
while the next step computes (``overlap.py``). At most ``KEEP_PER_RANK`` complete snapshots exist
per local rank: the older one's memory is reused for the next, except the (at most 2) steps the
agent holds for its replicas of sharded state (``hold.py``): new memory is taken instead, and a
buffer no longer held is freed. With ``checkpoint_dir``, every ``checkpoint_every``-th step's
snapshot is also written to disk by a background thread (``disk.py``: at most one waits; a writer
behind skips to the newest), by the ranks given ``write_checkpoints``. The memory per local rank
is bounded: ``KEEP_PER_RANK`` complete snapshots, plus at most 2 held, plus the one being taken,
plus (when the disk writer lags) the one waiting for it.

The state is *replicated* (the same on every rank, e.g. DDP's; the default) or, with
``replicated=False``, *per-rank*: only the rank that took it gets it back (``identity.py``).
A state holding DTensors (FSDP2's ``fully_shard``, ``get_state_dict``) is *sharded*: each rank
stores its local shards with DCP's metadata (``shards.py``), its disk checkpoints are DCP
checkpoints written by every rank (``dcp_disk.py``), and ``restore(template=...)`` loads it into
the template, resharded (``sharded_restore.py``). ``ShardedTensor`` is refused
(``ShardedStateError``).

The modules of sharded state import ``torch.distributed.checkpoint`` (about 1 s here): they are
imported when a sharded state is first snapshotted or restored, so a replicated or per-rank state
(DDP's) starts its workers without it.

``Snapshots.restore`` (a collective, ``restore.py``) returns the newest step that every rank can
get: from this node's memory, else (replicated state) from another node's, else from disk, and
says which; it never hands a rank state that is not its own.

When the snapshot directory's file system has no room for a snapshot (a small ``/dev/shm``), the
worker warns once (the bytes needed and free, and the fix) and keeps its snapshots in its own
memory from then on. Without ``ELASTICSTORE_SNAPSHOT_DIR`` (plain ``python``, ``torchrun``)
snapshots live in the process's own memory: nothing survives the process, ``restore`` reads disk
checkpoints only, and the disk checkpoints are written as with the agent. See
``docs/training.md``.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from .disk import DiskWriter
from ..sharded import has_sharded_tensor, sharded_path
from .errors import ShardedStateError, SnapshotSpaceError
from .checkpoint_mark import mark
from .hold import HoldReader
from .overlap import PendingCopy, background_part, note_pending, watch_optimizers
from .copying import copy_into
from .fileformat import (Buffer, encode_finish, encode_start, list_snapshots, prepare,
                         read_skipped, snapshot_name, stale_tmp_files, tmp_name, write_skipped)
from .identity import Identity, this_rank
from .restore import Restored, restore
from .settings import SNAPSHOT_DIR_ENV, SnapshotSettings

__all__ = ["KEEP_PER_RANK", "SNAPSHOT_DIR_ENV", "SnapshotSettings", "Snapshots"]

KEEP_PER_RANK = 2  # complete snapshots kept per local rank (older ones are reused or freed)

State = Mapping[str, Any]


class Snapshots:
    """Snapshots of one worker's training state; see the module's documentation.

    ``every``: snapshot every ``every``-th step (0: only the steps of disk checkpoints).
    ``checkpoint_dir``/``checkpoint_every``/``keep_checkpoints``: disk checkpoints, written in the
    background from the snapshots of every ``checkpoint_every``-th step by the ranks where
    ``write_checkpoints`` is true (default: global rank 0). ``replicated``: whether the state is
    the same on every rank (default); per-rank state (False) is restored only to the rank that
    took it, at the same world size, and has no disk checkpoints here. ``settings``: default from
    the environment. Use as a context manager, or call ``close`` (it waits for the disk
    checkpoint being written). ``overlap``: copy an optimizer's tensors of a large CPU state while
    the next step computes (``overlap.py``; False: every copy blocks ``snapshot``)."""

    def __init__(self, *, every: int = 1, checkpoint_dir: str | os.PathLike[str] | None = None,
                 checkpoint_every: int = 0, keep_checkpoints: int = 2,
                 write_checkpoints: bool | None = None, replicated: bool = True,
                 settings: SnapshotSettings | None = None, overlap: bool = True) -> None:
        if every < 0 or checkpoint_every < 0:
            raise ValueError(f"every ({every}) and checkpoint_every ({checkpoint_every}) must be >= 0")
        if checkpoint_dir is not None and checkpoint_every < 1:
            raise ValueError("checkpoint_dir needs checkpoint_every >= 1")
        if checkpoint_dir is not None and not replicated:
            raise ValueError("checkpoint_dir with replicated=False: disk checkpoints here are "
                             "written by one rank for all; save per-rank state with "
                             "torch.distributed.checkpoint")
        self.settings = settings or SnapshotSettings.from_env()
        self.every = every
        self.replicated = replicated
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        if write_checkpoints is None:
            write_checkpoints = this_rank()[0] == 0
        self.write_checkpoints = write_checkpoints and self.checkpoint_dir is not None
        # on every rank: each writes its own shard of a sharded state's checkpoint
        self._disk = (DiskWriter(self.checkpoint_dir, keep_checkpoints)
                      if self.checkpoint_dir is not None else None)
        self._sharded = False  # the state held DTensors (its snapshots are sharded)
        self.last_copy_s = 0.0  # how long the latest snapshot blocked its step
        self.last_wait_s = 0.0  # how long the latest background copy was waited for
        self.last_background_bytes = 0  # what the latest snapshot left to copy in the background
        self.last_bytes = 0
        self.overlap = overlap
        self._pending: PendingCopy | None = None  # a copy running in the background
        self._settling = threading.Lock()
        if overlap:
            watch_optimizers()
        self._published: list[Buffer] | None = None  # oldest first (None: not listed yet)
        self._tmp: tuple[str | None, str | None] = ("", None)  # (directory, temporary path)
        self._rank: tuple[int, int] | None = None  # (global rank, world size), at the first snapshot
        self._flushing_at_exit = False
        self._skipped_before: int | None = None
        self._hold = HoldReader()  # the agent's replica hold in the area
        self._closed = False

    @property
    def skipped_checkpoints(self) -> int:
        """Disk checkpoint steps skipped because the disk writer was behind (it wrote a newer)."""
        return self._disk.skipped if self._disk is not None else 0

    # -- taking snapshots ---------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether ``snapshot`` at ``step`` takes one (a multiple of ``every`` or of
        ``checkpoint_every``)."""
        return ((self.every > 0 and step % self.every == 0)
                or (self.checkpoint_dir is not None and step % self.checkpoint_every == 0))

    def snapshot(self, state: State | Callable[[], State], step: int) -> bool:
        """Copies ``state`` (a dict of tensors and plain, picklable Python objects; or a function
        returning it, called only when due) as the snapshot of ``step`` when ``due(step)``;
        returns whether it did. Blocks for the copy (an optimizer's tensors of a large CPU state:
        until that optimizer's next step, see ``overlap.py``); the disk checkpoint of the step,
        when one is due, is written in the background. DTensors are stored as this rank's shards
        (see the module); ``ShardedStateError`` for a ``ShardedTensor`` (nothing is written)."""
        if self._closed:
            raise RuntimeError("Snapshots is closed")
        self.settle()
        self._raise_disk_error()
        if not self.due(step):
            return False
        started = time.perf_counter()
        value = state() if callable(state) else state
        if self._rank is None:
            self._rank = this_rank()
            if self.settings.directory is not None and self._disk is not None:  # for flush.py
                mark(self.settings.directory, self.settings.local_rank, self._disk.directory,
                     self._disk.keep, self.write_checkpoints)
        rank, world = self._rank
        # the last state held DTensors: look first (a state without them is taken as it is)
        sharded = self._sharded and sharded_path(value) is not None
        if not sharded:
            try:
                enc = prepare(value, Identity(step, rank, world, self.replicated).to_dict())
            except ShardedStateError:
                if has_sharded_tensor(value):
                    raise
                sharded = True
        self._sharded = sharded
        if sharded:
            from .shards import to_payload  # DCP, for sharded state only: see the module

            enc = prepare(to_payload(value), Identity(step, rank, world, False, True).to_dict())
        try:
            buf = self._write(enc, step)
        except SnapshotSpaceError as err:
            self._no_room(err)
            buf = self._write(enc, step)
        self.last_copy_s = time.perf_counter() - started
        if buf is not None:
            self._publish(buf, step)
        return True

    def _write(self, enc: Any, step: int) -> Buffer | None:
        """Copies ``enc`` into a buffer: returns it, complete; None when part of the copy runs
        in the background (``settle`` publishes it)."""
        buf = self._take_buffer(step)
        try:
            views = encode_start(enc, buf)
            part = background_part(enc) if self.overlap else None
            self.last_background_bytes = 0
            if part is None:
                if enc.tensors:
                    copy_into(views, enc.tensors, enc.data_size, enc.on_cpu)
                self.last_bytes = encode_finish(enc, step, buf)
                buf.rename(self._path(snapshot_name(step, self.settings.local_rank)))
                return buf
            self._pending = PendingCopy(buf, enc, step, views, part)  # the other tensors copied
            self.last_background_bytes = self._pending.nbytes
        except BaseException:
            buf.free()
            raise
        note_pending(self, True)
        return None

    def settle(self) -> None:
        """Waits for the background copy of the latest snapshot, if one runs, and publishes that
        snapshot; discards it (and copies everything before returning from then on, warning)
        when a tensor it copied changed meanwhile. Called by the optimizers' step pre-hook,
        ``snapshot``, ``flush``, ``close`` and ``restore``."""
        with self._settling:
            pending, self._pending = self._pending, None
            if pending is None or pending.pid != os.getpid():  # a forked child: the parent's
                return
            note_pending(self, False)
            started = time.perf_counter()
            try:
                pending.wait()
            except BaseException:
                pending.buf.free()
                raise
            finally:
                self.last_wait_s = time.perf_counter() - started
            changed = pending.changed()
            if changed:
                pending.buf.free()
                self.overlap = False
                warnings.warn(f"the snapshot of step {pending.step} was discarded: {changed} "
                              "optimizer tensors changed in place outside the optimizer's step "
                              "while they were copied; from now on snapshot() copies everything "
                              "before it returns (Snapshots(overlap=False) says so)",
                              RuntimeWarning, stacklevel=3)
                return
            self.last_bytes = encode_finish(pending.enc, pending.step, pending.buf)
            pending.buf.rename(self._path(snapshot_name(pending.step, self.settings.local_rank)))
            self._publish(pending.buf, pending.step)

    def _publish(self, buf: Buffer, step: int) -> None:
        """Lists ``buf``, step ``step``'s complete snapshot; submits its disk checkpoint if due."""
        assert self._published is not None
        if self._disk is not None:
            with self._disk.lock:
                self._published.append(buf)
        else:
            self._published.append(buf)
        if self._disk is not None and step % self.checkpoint_every == 0 \
                and (self._sharded or self.write_checkpoints):
            if not self._flushing_at_exit:
                self._flushing_at_exit = True
                atexit.register(self._flush_at_exit)  # a script that ends without close()
            skipped = self._disk.skipped
            self._disk.submit(step, buf)
            d = self.settings.directory
            if self._disk.skipped != skipped and d is not None:  # for the agent's metric
                if self._skipped_before is None:  # by the earlier workers of this local rank
                    self._skipped_before = read_skipped(d, self.settings.local_rank)
                write_skipped(d, self.settings.local_rank, self._skipped_before + self._disk.skipped)

    def _no_room(self, err: SnapshotSpaceError) -> None:
        """The snapshot directory is full: warn once, remove this rank's snapshots from it, and
        keep the next ones in this process's memory."""
        after = ("restore reads the disk checkpoints only" if self.checkpoint_dir is not None else
                 "without checkpoint_dir nothing survives a failure")
        warnings.warn(f"{err}. Local rank {self.settings.local_rank} keeps its snapshots in its "
                      f"own memory from now on: {after}", RuntimeWarning, stacklevel=3)
        for buf in list(self._published or []):
            self._retire(buf)
        self.settings = dataclasses.replace(self.settings, directory=None)

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
        the oldest complete one when ``KEEP_PER_RANK`` exist, else new memory. Buffers the
        agent's replica hold names (``hold.py``) are never taken; the older ones it no longer
        holds are freed."""
        if self._published is None:
            self._published = self._adopt(step)
        while self._published and self._published[-1].step >= step:  # a step taken again
            self._retire(self._published[-1])
        if self._tmp[0] != self.settings.directory:  # one name for the snapshot being written
            self._tmp = (self.settings.directory, self._path(tmp_name(self.settings.local_rank)))
        tmp = self._tmp[1]
        hold = self._hold.read(self.settings.directory)
        held = hold.held([b.step for b in self._published]) if hold is not None else set()
        older = self._published[:max(0, len(self._published) - (KEEP_PER_RANK - 1))]
        reused: Buffer | None = None
        for old in [b for b in older if b.step not in held]:  # oldest first
            if reused is None and self._retire(old, reuse=True):
                reused = old
            elif reused is not None:
                self._retire(old)  # a buffer no longer held
        if reused is not None:
            reused.rename(tmp)
            return reused
        return Buffer(tmp)

    def _retire(self, buf: Buffer, reuse: bool = False) -> bool:
        """Takes ``buf`` off the list. The disk writer still holds it: out of view (renamed), the
        writer frees it after; else freed, or (``reuse``) returns True."""
        assert self._published is not None
        if self._disk is not None:
            with self._disk.lock:  # with the writer's check whether it still holds the buffer
                self._published.remove(buf)
                if self._disk.pinned(buf):
                    buf.rename(self._path(tmp_name(self.settings.local_rank)))
                    self._disk.orphan(buf)
                    return False
        else:
            self._published.remove(buf)
        if not reuse:
            buf.free()
        return reuse

    # -- disk checkpoints in the background ---------------------------------------------------

    def _raise_disk_error(self) -> None:
        if self._disk is not None and self._disk.error is not None:
            err, self._disk.error = self._disk.error, None
            raise RuntimeError(f"the background disk checkpoint failed: {err}") from err

    def _flush_at_exit(self) -> None:
        try:
            self.flush()
        except RuntimeError as err:
            warnings.warn(str(err), RuntimeWarning, stacklevel=1)

    def flush(self) -> None:
        """Waits until the snapshots and disk checkpoints due so far are written."""
        self.settle()
        if self._disk is not None:
            self._disk.flush()
        if self._flushing_at_exit:
            self._flushing_at_exit = False
            atexit.unregister(self._flush_at_exit)
        self._raise_disk_error()

    def close(self) -> None:
        """Waits for the disk checkpoint being written; unmaps the snapshots (their files stay
        for the next worker: the agent removes them when the job ends)."""
        if self._closed:
            return
        try:
            self.flush()  # the background copy's snapshot published first
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

    def restore(self, group: dist.ProcessGroup | None = None, *,
                template: dict[str, Any] | None = None) -> Restored | None:
        """The newest step every rank of ``group`` can get (a collective when a process group is
        initialised; ``group`` must take CPU tensors, e.g. gloo). None when there is none.
        ``SnapshotMismatchError`` when what there is is not this rank's to take (see
        ``restore.py``). Sharded state: pass ``template``, the run's own state dict (e.g.
        ``{"model": msd, "optim": osd}`` from ``get_state_dict``): the step is loaded into it in
        place, resharded to this world size and layout (``sharded_restore.py``); the result's
        ``state`` is the template."""
        self.settle()
        if template is not None:
            if not isinstance(template, dict):
                raise TypeError(f"template must be a dict (the run's state dict), not "
                                f"{type(template).__name__}")
            from .sharded_restore import restore_sharded  # DCP: see the module

            return restore_sharded(self.settings.directory, self.checkpoint_dir, template, group)
        return restore(self.settings.directory, self.settings.local_rank, self.checkpoint_dir,
                       self.replicated, group)

