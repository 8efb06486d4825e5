"""The disk checkpoints of ``Snapshots``, written from the snapshots by a background thread.

At most one snapshot waits for the writer: when a newer checkpoint step comes while one waits (the
disk is slower than ``checkpoint_every`` steps), the waiting one is skipped, the newer one takes
its place, and the skip is logged (``skipped`` counts them). So the snapshot memory stays bounded
however slow the disk: the writer holds a snapshot only while it copies it out, and one waits.

A snapshot the writer holds or waits for is *pinned*: its owner may retire it from its list, but
not free or reuse it; the writer frees such an orphan when it is done with it.
"""

from __future__ import annotations

import logging
import threading
import time

from ..checkpoint import save_checkpoint
from .fileformat import Buffer, decode

__all__ = ["DiskWriter"]

log = logging.getLogger("elasticstore.train.snapshots")
SKIP_LOG_EVERY_S = 60.0  # after the first skip, at most one line per this many seconds


class DiskWriter:
    def __init__(self, directory: str, keep: int) -> None:
        self.directory, self.keep = directory, keep
        self.lock = threading.Lock()  # also the owner's, around its list of snapshots
        self._cv = threading.Condition(self.lock)
        self._waiting: tuple[int, Buffer] | None = None
        self._busy: Buffer | None = None  # being copied out
        self._orphans: set[int] = set()  # ids of pinned buffers their owner retired
        self._writing = -1  # the step being written (-1: none)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._next_log = 0.0
        self.error: BaseException | None = None
        self.skipped = 0  # checkpoint steps skipped because the disk was behind

    def pinned(self, buf: Buffer) -> bool:
        """Whether the writer holds or waits for ``buf`` (call with ``lock`` held)."""
        return buf is self._busy or (self._waiting is not None and self._waiting[1] is buf)

    def orphan(self, buf: Buffer) -> None:
        """``buf`` (pinned) left its owner's list: freed by the writer when done (``lock`` held)."""
        self._orphans.add(id(buf))

    def submit(self, step: int, buf: Buffer) -> None:
        """Writes the snapshot ``buf`` of ``step`` as a checkpoint (skipping the one that waits)."""
        freed: Buffer | None = None
        with self._cv:
            if self._waiting is not None:
                old_step, old = self._waiting
                self.skipped += 1
                if id(old) in self._orphans:
                    self._orphans.discard(id(old))
                    freed = old
                now = time.monotonic()
                if now >= self._next_log:
                    self._next_log = now + SKIP_LOG_EVERY_S
                    log.warning(
                        "disk checkpoint of step %d skipped: the writer is still on step %d (the "
                        "disk is slower than checkpoint_every steps); it writes step %d next, the "
                        "newest (%d skipped so far)", old_step, self._writing, step, self.skipped)
            self._waiting = (step, buf)
            self._cv.notify()
        if freed is not None:
            freed.free()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="snapshot-disk", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._waiting is None and not self._stop:
                    self._cv.wait()
                if self._waiting is None:
                    return
                (step, buf), self._waiting = self._waiting, None
                self._busy, self._writing = buf, step
            try:
                _, ident, state = decode(buf)
            except BaseException as err:  # noqa: BLE001 - reported by the owner's next call
                self.error = err
                continue
            finally:
                with self.lock:
                    self._busy = None
                    orphan = id(buf) in self._orphans
                    self._orphans.discard(id(buf))
                if orphan:
                    buf.free()
            try:
                if isinstance(ident, dict) and ident.get("sharded"):
                    # DCP is imported for sharded state only (about 1 s): see writer.py
                    from .dcp_disk import write_shard

                    write_shard(self.directory, step, ident["rank"], ident["world_size"],
                                state["items"], state["data"], self.keep)
                else:
                    save_checkpoint(self.directory, state, step, keep=self.keep, meta=ident)
            except BaseException as err:  # noqa: BLE001 - reported by the owner's next call
                self.error = err
            finally:
                self._writing = -1

    def flush(self) -> None:
        """Waits until the checkpoint that waits, if any, is written; the thread ends."""
        thread = self._thread
        if thread is None:
            return
        with self._cv:
            self._stop = True
            self._cv.notify()
        thread.join()
        self._thread, self._stop = None, False
