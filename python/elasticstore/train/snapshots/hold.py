"""The replica hold: a small file in the snapshot area (``HOLD_NAME``) by which the node's agent
asks its workers to keep the memory of some steps (``elasticstore.replicas.schedule`` writes it;
``writer.py`` honours it). Standard library only: the agent writes it.

It holds ``{"committed": c, "floor": t}`` (either may be null): the writer never reuses the
buffer of step ``c`` (the newest step every node's replica holds), nor its oldest buffer of a
step ``>= t`` (the step the agents are sending), and takes new memory instead. Written under a
temporary name and renamed into place, so a reader sees one whole version. A worker reads it once
per snapshot: one ``os.access`` (and ``os.stat`` when it exists), and the file itself only when it
changed (its inode, mtime, size).
No file (``torchrun``, replicated state, a round of one node): nothing is held.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
from dataclasses import dataclass

__all__ = ["HOLD_NAME", "Hold", "HoldReader", "remove_hold", "write_hold"]

HOLD_NAME = ".replica-hold"
_MAX_BYTES = 4096


@dataclass(frozen=True)
class Hold:
    committed: int | None
    floor: int | None

    def held(self, steps: list[int]) -> set[int]:
        """Which of ``steps`` (a local rank's complete snapshots) must not be reused."""
        out = {self.committed} if self.committed is not None else set()
        if self.floor is not None:
            ge = [s for s in steps if s >= self.floor]
            if ge:
                out.add(min(ge))
        return out


def write_hold(area: str, hold: Hold) -> None:
    """Replaces ``area``'s hold file (atomically: a temporary file renamed into place)."""
    tmp = os.path.join(area, f"{HOLD_NAME}.tmp.{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        json.dump({"committed": hold.committed, "floor": hold.floor}, f)
    os.rename(tmp, os.path.join(area, HOLD_NAME))


def remove_hold(area: str) -> None:
    try:
        os.unlink(os.path.join(area, HOLD_NAME))
    except FileNotFoundError:
        pass


def _parse(data: bytes) -> Hold:
    if len(data) > _MAX_BYTES:
        raise ValueError(f"{len(data)} bytes")
    record = json.loads(data)
    if not isinstance(record, dict):
        raise ValueError(f"not an object: {data[:80]!r}")
    values = [record.get("committed"), record.get("floor")]
    if not all(v is None or (type(v) is int and v >= 0) for v in values):
        raise ValueError(f"steps that are not integers >= 0 or null: {data[:80]!r}")
    return Hold(values[0], values[1])


class HoldReader:
    """A worker's view of its area's hold file, read again only when the file changed."""

    def __init__(self) -> None:
        self._key: tuple[int, int, int] | None = None
        self._hold: Hold | None = None
        self._said = False

    def read(self, directory: str | None) -> Hold | None:
        if directory is None:
            return None
        path = os.path.join(directory, HOLD_NAME)
        if not os.access(path, os.F_OK):  # no file, the usual case: cheaper than a failed stat
            self._key = self._hold = None
            return None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._key = self._hold = None
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._key:
            self._key, self._hold = key, None
            try:
                with open(path, "rb") as f:
                    self._hold = _parse(f.read(_MAX_BYTES + 1))
            except FileNotFoundError:
                self._key = None  # replaced meanwhile: read again next time
            except (OSError, ValueError) as err:  # not the agent's writing: nothing is held
                if not self._said:
                    self._said = True
                    warnings.warn(f"ignoring the replica hold file {path}: {err}",
                                  RuntimeWarning, stacklevel=4)
        return self._hold
