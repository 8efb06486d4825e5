"""What a snapshot file says about itself, read without torch and without reading its data: the
names of complete snapshot files and the identity at the head of the file (``fileformat.py``
writes both; ``tests/agent/test_replicas.py`` checks that the two agree). Standard library only:
the agent reads it to replicate its node's sharded snapshots (``elasticstore.replicas``).

A file is ``header | tensor data | pickled (identity, state) | spare``; the identity is a dict of
``step``, ``rank``, ``world_size`` (ints) and ``replicated``, ``sharded`` (bools), pickled first,
so its opcodes are read up to the end of that dict and no further (nothing is unpickled, no
class is looked up). Anything else is ``ValueError``: never guessed.
"""

from __future__ import annotations

import os
import pickletools
import re
import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["HEADER", "MAGIC", "NAME", "Peeked", "list_complete", "peek", "replica_name"]

MAGIC = b"ESNAP\x00\x02\x00"  # fileformat._MAGIC
HEADER = struct.Struct("<8sqQQQ")  # magic, step, data bytes, skeleton offset, skeleton bytes
NAME = re.compile(r"^step-(\d{12,})\.local-(\d+)\.snap$")  # fileformat._NAME: complete files
_HEAD_BYTES = 4096  # the identity is a few dozen bytes at the skeleton's start
_INTS = {"step", "rank", "world_size"}
_BOOLS = {"replicated", "sharded"}


@dataclass(frozen=True)
class Peeked:
    """A snapshot file's identity (``identity.Identity``'s fields), its size in bytes and the
    bytes of it in use (the rest is spare room for the next snapshot of its buffer)."""

    step: int
    rank: int
    world_size: int
    replicated: bool
    sharded: bool
    size: int
    used: int


def replica_name(step: int, rank: int) -> str:
    """A replica's name in ``<area>/replicas/``: the writer's global rank where a worker's own
    file has its local rank (``list_snapshots`` reads both; restore reads the identity)."""
    return f"step-{step:012d}.local-{rank}.snap"


def list_complete(directory: str) -> list[tuple[int, int, str]]:
    """(step, local rank, path) of the complete snapshot files of ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)), int(m.group(2)), os.path.join(directory, n))
                  for n in names if (m := NAME.match(n)))


def _identity(skeleton: bytes) -> dict[str, Any]:
    found: dict[str, Any] = {}
    key: str | None = None
    state = "start"
    try:
        for op, arg, _ in pickletools.genops(skeleton):
            name = op.name
            if name in ("PROTO", "FRAME", "MEMOIZE"):
                continue
            if state == "start" and name == "EMPTY_DICT":
                state = "dict"
            elif state == "dict" and name == "MARK":
                state = "items"
            elif state == "items" and name == "SETITEMS":
                return found
            elif state == "items" and key is None and name in ("SHORT_BINUNICODE",
                                                               "BINUNICODE"):
                key = str(arg)
            elif state == "items" and key in _INTS and isinstance(arg, int) and name in (
                    "BININT", "BININT1", "BININT2", "LONG1"):
                found[key], key = arg, None
            elif state == "items" and key in _BOOLS and name in ("NEWTRUE", "NEWFALSE"):
                found[key], key = name == "NEWTRUE", None
            else:
                break
    except ValueError:
        pass  # the bytes read end inside an opcode
    raise ValueError("no identity record at the head of the snapshot's skeleton")


def peek(path: str | None = None, fd: int | None = None) -> Peeked:
    """The identity of the snapshot file ``path`` (or open ``fd``); ``ValueError`` when it is not
    a complete snapshot of this format, ``OSError`` when it cannot be read."""
    own = fd is None
    if fd is None:
        assert path is not None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEADER.size, 0)
        if len(head) < HEADER.size:
            raise ValueError("shorter than a snapshot header")
        magic, step, data_len, skel_offset, skel_len = HEADER.unpack(head)
        if magic != MAGIC:
            raise ValueError("not a snapshot")
        if skel_offset < 64 + data_len or skel_offset + skel_len > size:
            raise ValueError(f"inconsistent sizes (data {data_len}, skeleton {skel_len} bytes at "
                             f"{skel_offset}, in {size})")
        ident = _identity(os.pread(fd, min(skel_len, _HEAD_BYTES), skel_offset))
    finally:
        if own:
            os.close(fd)
    if set(ident) != _INTS | _BOOLS:
        raise ValueError(f"identity record with fields {sorted(ident)}")
    if ident["step"] != step:
        raise ValueError(f"its header says step {step}, its identity step {ident['step']}")
    if not 0 <= ident["rank"] < ident["world_size"]:
        raise ValueError(f"rank {ident['rank']} of a world of {ident['world_size']}")
    return Peeked(step, ident["rank"], ident["world_size"], ident["replicated"],
                  ident["sharded"], size, skel_offset + skel_len)
