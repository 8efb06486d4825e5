"""The bytes of one snapshot, and the mapped memory that holds them.

A snapshot is one file (or, without a snapshot directory, anonymous memory of the process)::

    header | pickled skeleton | padding | tensor data (each tensor 64-byte aligned)

The skeleton is the state pickled with every plain strided tensor replaced by a reference
(dtype, shape, offset): plain Python objects are pickled as they are, tensors are copied byte for
byte into the data region (one ``copy_`` each, from any device). Reading maps the file and clones
every tensor out of it, so the returned state shares no memory with the file.

Files are written under a temporary name and renamed to ``step-<step, 12 digits>.local-<local
rank>.snap`` when complete: a reader never sees a half-written snapshot.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import re
import struct
import threading
import uuid
from typing import Any

import torch

__all__ = ["Buffer", "decode", "encode", "list_snapshots", "snapshot_name"]

_MAGIC = b"ESNAP\x00\x01\x00"
_HEADER = struct.Struct("<8sqQQQ")  # magic, step, skeleton bytes, data offset, total bytes
_ALIGN = 64  # every tensor's bytes start at a multiple of this (any dtype's alignment)
_NAME = re.compile(r"^step-(\d{12,})\.local-(\d+)\.snap$")
_TMP = re.compile(r"^\.tmp\.local-(\d+)\.[0-9a-f]+$")


def snapshot_name(step: int, local_rank: int) -> str:
    return f"step-{step:012d}.local-{local_rank}.snap"


def tmp_name(local_rank: int) -> str:
    return f".tmp.local-{local_rank}.{uuid.uuid4().hex}"


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


def _copied(obj: Any) -> bool:
    """Tensors whose bytes go to the data region (others, e.g. sparse or meta, are pickled)."""
    return (type(obj) is torch.Tensor and obj.layout == torch.strided and not obj.is_quantized
            and obj.device.type != "meta")


class _Pickler(pickle.Pickler):
    def __init__(self, f: io.BytesIO) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[tuple[torch.Tensor, int]] = []  # (tensor, offset in the data region)
        self.size = 0

    def persistent_id(self, obj: Any) -> Any:
        if not _copied(obj):
            return None
        offset = _align(self.size)
        nbytes = obj.numel() * obj.element_size()
        self.tensors.append((obj, offset))
        self.size = offset + nbytes
        return ("t", obj.dtype, tuple(obj.shape), offset, nbytes)


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: io.BytesIO, data: torch.Tensor) -> None:
        super().__init__(f)
        self.data = data

    def persistent_load(self, pid: Any) -> Any:
        _, dtype, shape, offset, nbytes = pid
        raw = self.data[offset:offset + nbytes]
        return raw.view(dtype).view(shape).clone() if nbytes else torch.empty(shape, dtype=dtype)


class Buffer:
    """Mapped memory for one snapshot: a file of the snapshot directory (``path``) or, with
    ``path`` None, anonymous memory of this process. ``lock`` guards its contents."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.step = -1
        self.lock = threading.Lock()
        self.size = 0
        self._mm: mmap.mmap | None = None
        self._fd = -1
        if path is not None:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    @classmethod
    def adopt(cls, path: str, step: int) -> Buffer:
        """A complete snapshot file left by an earlier process of the same local rank."""
        buf = cls(path)
        buf.step = step
        buf.size = os.fstat(buf._fd).st_size
        return buf

    def mapped(self, size: int) -> mmap.mmap:
        """The memory, ``size`` bytes long (the file resized when the size changed)."""
        if self._mm is None or size != self.size:
            if self._mm is not None:
                self._mm.close()
                self._mm = None
            if self._fd >= 0:
                os.ftruncate(self._fd, size)
                self._mm = mmap.mmap(self._fd, size)
            else:
                self._mm = mmap.mmap(-1, size)
            self.size = size
        return self._mm

    def rename(self, path: str | None) -> None:
        if self.path is not None and path is not None:
            os.rename(self.path, path)
            self.path = path

    def close(self) -> None:
        """Unmaps the memory; the file stays."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None
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


def encode(state: Any, step: int, buf: Buffer) -> int:
    """Copies ``state`` into ``buf`` as the snapshot of ``step``; returns its size in bytes."""
    out = io.BytesIO()
    pickler = _Pickler(out)
    pickler.dump(state)
    skeleton = out.getbuffer()
    data_offset = _align(_HEADER.size + len(skeleton))
    total = data_offset + pickler.size
    mm = buf.mapped(total)
    mm[:_HEADER.size] = _HEADER.pack(_MAGIC, step, len(skeleton), data_offset, total)
    mm[_HEADER.size:_HEADER.size + len(skeleton)] = skeleton
    if pickler.tensors:
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=data_offset, count=pickler.size)
        with torch.no_grad():
            for tensor, offset in pickler.tensors:
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes:
                    data[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        del data  # the mapping may be closed (resized) only once no tensor views it
    buf.step = step
    return total


def _decode_bytes(mm: mmap.mmap, size: int) -> tuple[int, Any]:
    if size < _HEADER.size:
        raise ValueError("shorter than a snapshot header")
    magic, step, skel_len, data_offset, total = _HEADER.unpack(mm[:_HEADER.size])
    if magic != _MAGIC:
        raise ValueError("not a snapshot")
    if total != size or data_offset > total or _HEADER.size + skel_len > data_offset:
        raise ValueError(f"inconsistent sizes (header says {total} bytes, it has {size})")
    data = torch.frombuffer(mm, dtype=torch.uint8, offset=data_offset, count=total - data_offset) \
        if total > data_offset else torch.empty(0, dtype=torch.uint8)
    try:
        skeleton = io.BytesIO(mm[_HEADER.size:_HEADER.size + skel_len])
        return step, _Unpickler(skeleton, data).load()
    finally:
        del data


def decode(buf: Buffer) -> tuple[int, Any]:
    """(step, state) of the snapshot in ``buf`` (its tensors cloned out of it)."""
    assert buf.size > 0
    return _decode_bytes(buf.mapped(buf.size), buf.size)


def read_snapshot(path: str) -> tuple[int, Any]:
    """(step, state) of the snapshot file ``path``; ``ValueError`` when it is not one."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError("empty")
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            return _decode_bytes(mm, size)
