"""The bytes of one snapshot, and the mapped memory that holds them.

A snapshot is one file (or, without a snapshot directory, anonymous memory of the process)::

    header | tensor data (each tensor 64-byte aligned) | pickled skeleton | spare capacity

The skeleton is ``(identity, state)`` pickled, with every plain strided tensor replaced by a
reference (dtype, shape, offset): plain Python objects are pickled as they are, tensors are
copied byte for byte into the data region (one ``copy_`` each, from any device; the pickling is
``skeleton.py``'s). The identity (``identity.py``) says whose state it is. Sharded tensors are refused while pickling
(``ShardedStateError``), before any memory is touched: ``Snapshots`` turns sharded state into
plain local shards and DCP metadata first (``shards.py``). Reading maps the file and clones every
tensor out of it, so the returned state shares no memory with the file.

The file's blocks are reserved (``posix_fallocate``) before anything is copied into them: a
memory file system (``/dev/shm``) without room then gives ``SnapshotSpaceError``, not a bus error
when the copy touches a page the file system cannot supply.

Writing is the hot path (every step): a buffer is reused for later snapshots, with room to spare
(``_SLACK``) so that a state whose size varies a little is not remapped each time, the tensor
views into it are kept while the layout of the tensors stays the same, and the tensors are copied
in one call, or by a few threads for a large state (``copying.py``).

Files are written under a temporary name and renamed to ``step-<step, 12 digits>.local-<local
rank>.snap`` when complete: a reader never sees a half-written snapshot. A file whose memory is
taken for a newer snapshot while someone reads it (the agent's flush, a replica sender) has its
header's magic cleared before anything else is written and the new header written last:
``read_snapshot`` compares the header after cloning with the one it started from, and raises
``ValueError`` when it changed, never returning a mix of two steps.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import re
import struct
import uuid
from typing import Any

import torch

from .copying import copy_into
from .errors import SnapshotSpaceError
from ..sharded import refuse_sharded, sharded_types
from .skeleton import ShardedFound, SkeletonPickler, SkeletonUnpickler

__all__ = ["Buffer", "Encoded", "decode", "encode", "encode_finish", "encode_start",
           "list_snapshots", "prepare", "read_snapshot", "snapshot_name"]

_MAGIC = b"ESNAP\x00\x02\x00"
_NO_MAGIC = bytes(8)  # a header whose snapshot is being overwritten
_NO_MAGIC_LEN = len(_NO_MAGIC)
_HEADER = struct.Struct("<8sqQQQ")  # magic, step, data bytes, skeleton offset, skeleton bytes
_ALIGN = 64  # every tensor's bytes start at a multiple of this (any dtype's alignment)
_DATA = 64  # where the tensor data starts (after the header)
_PAGE = 4096
_SLACK = 8  # a buffer grows to its need plus 1/_SLACK, and shrinks when under half used
_NAME = re.compile(r"^step-(\d{12,})\.local-(\d+)\.snap$")
_TMP = re.compile(r"^\.tmp\.local-(\d+)\.[0-9a-f]+$")


def snapshot_name(step: int, local_rank: int) -> str:
    return f"step-{step:012d}.local-{local_rank}.snap"


def tmp_name(local_rank: int) -> str:
    return f".tmp.local-{local_rank}.{uuid.uuid4().hex}"


SKIPPED = ".skipped.local-"  # + local rank: the disk checkpoints it skipped (the agent's metric)


def read_skipped(directory: str, local_rank: int) -> int:
    """The disk checkpoints ``local_rank``'s workers skipped so far (0: none recorded)."""
    try:
        with open(os.path.join(directory, f"{SKIPPED}{local_rank}")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def write_skipped(directory: str, local_rank: int, count: int) -> None:
    """Records (atomically) that ``local_rank``'s workers skipped ``count`` disk checkpoints."""
    path = os.path.join(directory, f"{SKIPPED}{local_rank}")
    tmp = f"{path}.{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        f.write(str(count))
    os.replace(tmp, path)


def list_snapshots(directory: str) -> list[tuple[int, int, str]]:
    """The complete snapshots of ``directory`` as ``(step, local rank, path)``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), int(m.group(2)), os.path.join(directory, name))
             for name in names if (m := _NAME.match(name))]
    return sorted(found)


def stale_tmp_files(directory: str, local_rank: int) -> list[str]:
    """Temporary files of ``local_rank`` (a writer killed mid-snapshot left them)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [os.path.join(directory, n) for n in names
            if (m := _TMP.match(n)) and int(m.group(1)) == local_rank]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Buffer:
    """Mapped memory for one snapshot: a file of the snapshot directory (``path``) or, with
    ``path`` None, anonymous memory of this process."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.step = -1
        self.capacity = 0  # bytes mapped (the file's size)
        self._mm: mmap.mmap | None = None
        self._fd = -1
        self._views: tuple[Any, list[torch.Tensor]] | None = None  # (layout, views) kept
        if path is not None:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    @classmethod
    def adopt(cls, path: str, step: int) -> Buffer:
        """A complete snapshot file left by an earlier process of the same local rank."""
        buf = cls(path)
        buf.step = step
        buf.capacity = os.fstat(buf._fd).st_size
        return buf

    def mapped(self, size: int) -> mmap.mmap:
        """The memory, at least ``size`` bytes (remapped when it must grow, or shrink by half).
        A file's blocks are reserved first: ``SnapshotSpaceError`` when its file system lacks
        room (the file keeps its former size)."""
        if self._mm is None or size > self.capacity or size < self.capacity // 2:
            capacity = -(-(size + size // _SLACK) // _PAGE) * _PAGE
            if self._mm is not None and capacity == self.capacity:
                return self._mm
            self._unmap()
            if self._fd >= 0:
                have = os.fstat(self._fd).st_size
                if capacity > have:
                    self._reserve(have, capacity)
                elif capacity < have:
                    os.ftruncate(self._fd, capacity)
                self._mm = mmap.mmap(self._fd, capacity)
            else:
                self._mm = mmap.mmap(-1, capacity)
            self.capacity = capacity
        return self._mm

    def _reserve(self, have: int, capacity: int) -> None:
        try:
            os.posix_fallocate(self._fd, 0, capacity)
        except OSError as err:
            os.ftruncate(self._fd, have)  # give back what a partial reservation took
            self.capacity = have
            assert self.path is not None
            directory = os.path.dirname(self.path)
            try:
                st = os.statvfs(directory)
                free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
            except OSError:
                free = size = -1
            raise SnapshotSpaceError(
                err.errno,
                f"no room for a snapshot in {directory}: it needs {capacity} bytes "
                f"({capacity - have} more), {free} bytes are free of {size} "
                f"({os.strerror(err.errno or 0)}). Give the snapshot memory more room: docker run "
                "--shm-size (Docker's default /dev/shm is 64 MiB), a Kubernetes emptyDir with "
                "medium: Memory mounted on /dev/shm, or ELASTICSTORE_SNAPSHOT_ROOT set to a larger "
                "memory file system for elasticstore-run") from err

    def views(self, layout: list[tuple[torch.dtype, tuple[int, ...], int]], size: int,
              total: int) -> list[torch.Tensor]:
        """A tensor over the data region (``size`` bytes) for each ``(dtype, shape, offset)`` of
        ``layout``, with the memory mapped for ``total`` bytes."""
        mm = self.mapped(total)  # first: a remap drops the views
        if self._views is not None and self._views[0] == layout:
            return self._views[1]
        self._views = None
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=_DATA, count=size)
        views = []
        for dtype, shape, offset in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            views.append(data[offset:offset + nbytes].view(dtype).view(shape))
        self._views = (layout, views)
        return views

    def _unmap(self) -> None:
        self._views = None  # no tensor may view the mapping when it closes
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def rename(self, path: str | None) -> None:
        if self.path is not None and path is not None:
            os.rename(self.path, path)
            self.path = path

    def close(self) -> None:
        """Unmaps the memory; the file stays."""
        self._unmap()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def free(self) -> None:
        self.close()
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class Encoded:
    """A state pickled for a snapshot (``prepare``), not yet copied anywhere: its skeleton, its
    tensors and where each goes, and the bytes the snapshot takes."""

    __slots__ = ("skeleton", "tensors", "layout", "data_size", "skel_offset", "total", "on_cpu")

    def __init__(self, pickler: SkeletonPickler, skeleton: memoryview) -> None:
        self.skeleton, self.on_cpu = skeleton, pickler.on_cpu
        self.tensors, self.layout, self.data_size = pickler.tensors, pickler.layout, pickler.size
        self.skel_offset = _align(_DATA + pickler.size)
        self.total = self.skel_offset + len(skeleton)


def prepare(state: Any, identity: dict[str, Any]) -> Encoded:
    """Pickles ``(identity, state)``; ``ShardedStateError`` for a sharded tensor in ``state``."""
    out = io.BytesIO()
    pickler = SkeletonPickler(out, sharded_types(), _ALIGN)  # those loaded so far
    try:
        pickler.dump((identity, state))
    except ShardedFound:
        refuse_sharded(state, "Snapshots.snapshot()")  # names where it is
        refuse_sharded(state, "Snapshots.snapshot()", where="<inside an object>")
    return Encoded(pickler, out.getbuffer())


def encode(enc: Encoded, step: int, buf: Buffer) -> int:
    """Copies ``enc`` into ``buf`` as the snapshot of ``step``; returns its size in bytes."""
    views = encode_start(enc, buf)
    if enc.tensors:
        copy_into(views, enc.tensors, enc.data_size, enc.on_cpu)
    return encode_finish(enc, step, buf)


def encode_start(enc: Encoded, buf: Buffer) -> list[torch.Tensor]:
    """``encode`` up to the tensors' copy: the memory mapped and marked as holding no snapshot,
    the skeleton in place; returns the views to copy ``enc.tensors`` into, then
    ``encode_finish``."""
    mm = buf.mapped(enc.total)
    mm[:_NO_MAGIC_LEN] = _NO_MAGIC  # first: a reader of the snapshot held here sees it change
    mm[enc.skel_offset:enc.total] = enc.skeleton
    return buf.views(enc.layout, enc.data_size, enc.total) if enc.tensors else []


def encode_finish(enc: Encoded, step: int, buf: Buffer) -> int:
    """The header, once every tensor is copied: the snapshot of ``step`` is complete."""
    mm = buf.mapped(enc.total)
    mm[:_HEADER.size] = _HEADER.pack(_MAGIC, step, enc.data_size, enc.skel_offset,
                                     len(enc.skeleton))
    buf.step = step
    return enc.total


def _decode_bytes(mm: mmap.mmap, size: int, clone: bool = True) -> tuple[int, Any, Any]:
    if size < _DATA:
        raise ValueError("shorter than a snapshot header")
    header = mm[:_HEADER.size]
    magic, step, data_len, skel_offset, skel_len = _HEADER.unpack(header)
    if magic != _MAGIC:
        raise ValueError("not a snapshot")
    if _DATA + data_len > skel_offset or skel_offset + skel_len > size:
        raise ValueError(f"inconsistent sizes (data {data_len}, skeleton {skel_len} bytes at "
                         f"{skel_offset}, in {size})")
    data = torch.frombuffer(mm, dtype=torch.uint8, offset=_DATA, count=data_len) \
        if data_len else torch.empty(0, dtype=torch.uint8)
    try:
        skeleton = io.BytesIO(mm[skel_offset:skel_offset + skel_len])
        loaded = SkeletonUnpickler(skeleton, data, clone).load()
        if not (isinstance(loaded, tuple) and len(loaded) == 2):
            raise ValueError("not an (identity, state) pair")
        if clone and mm[:_HEADER.size] != header:
            raise ValueError(f"changed while it was read: its memory now holds a newer "
                             f"snapshot than step {step}")
        return step, loaded[0], loaded[1]
    finally:
        del data


def decode(buf: Buffer) -> tuple[int, Any, Any]:
    """(step, identity record, state) of the snapshot in ``buf`` (its tensors cloned out)."""
    assert buf.capacity > 0
    return _decode_bytes(buf.mapped(buf.capacity), buf.capacity)


def read_snapshot(path: str, clone: bool = True) -> tuple[int, Any, Any]:
    """(step, identity record, state) of the snapshot file ``path``; ``ValueError`` when it is
    not one, or when its writer took its memory for a newer snapshot while it was read.
    ``clone=False``: the tensors view a private (copy-on-write) mapping of the file, which lives
    as long as they do (nothing copied until written; not checked: they change if the writer
    reuses the file, so take them only from files no writer reuses meanwhile)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError("empty")
        if not clone:
            return _decode_bytes(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY), size, False)
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            return _decode_bytes(mm, size)
