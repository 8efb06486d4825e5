"""Heartbeats and sections: how a worker tells its agent it is making progress.

``heartbeat()`` once per training step: a few stores into the agent's shared memory (no store
round trip, no system call after the first beat; about a microsecond). The agent
(``elasticstore-run --heartbeat-timeout``) takes a worker that stops beating for a hang: it dumps
the worker's Python stacks, ends the round for every node and restarts the group.

``section(name, timeout=None)``: a stretch of work with its own time limit (a checkpoint save, an
evaluation), during which the steady heartbeat timeout does not apply; ``timeout=None``: no limit.
While any rank of the job is inside a section that has not expired, the agent judges no rank (the
others may wait for it in a collective: rank 0 evaluates, the rest wait in a barrier).
A rank may also never beat (a rank-0-only callback): once another rank beat in the round, it is
covered by the ranks that do.
The time spent in sections is also what the straggler view compares across ranks (a rank whose
own work takes longer than the others'), so wrapping a step's compute in ``section("compute")``
shows which rank holds the others up; without sections the step time (beat to beat) is compared.

Without ``elasticstore-run`` (plain ``python``, ``torchrun``) both are no-ops: the script stays
runnable anywhere. The first beat also registers ``faulthandler`` on ``STACK_SIGNAL`` (when no
handler is installed for it), writing to the file the agent named, so the agent can show where a
silent worker is stuck even when it is blocked in C++ (a collective).
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from .heartbeat_layout import (
    BOARD_ENV,
    FLAG_STACKS,
    NO_DEADLINE,
    OFF_BEATS,
    OFF_FLAGS,
    OFF_FROM,
    OFF_LAST,
    OFF_NAME,
    OFF_PID,
    OFF_SAMPLES,
    OFF_STEPS,
    OFF_UNTIL,
    OFF_WORK,
    RING,
    SLOT_BYTES,
    SLOT_ENV,
    STACK_SIGNAL,
    STACKS_ENV,
)

__all__ = ["heartbeat", "section"]

_Q = struct.Struct("<q")
_D = struct.Struct("<d")
_NAME_BYTES = OFF_STEPS - OFF_NAME


class _Slot:
    """This process's slot on the board (opened at the first beat)."""

    def __init__(self, path: str, index: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self.map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.base = index * SLOT_BYTES
        if self.base + SLOT_BYTES > len(self.map):
            raise ValueError(f"slot {index} is beyond the board {path}")
        self.pid = os.getpid()
        self.beats = 0
        self.samples = 0
        self.step_from: int | None = None  # monotonic ns of the last beat
        self.work_ns = 0  # time in sections since the last beat
        self.sections: list[tuple[str, int, int]] = []  # open ones: (name, deadline, started)
        self.stacks: IO[str] | None = None
        self.put(OFF_PID, self.pid)
        self._register_stacks()

    def put(self, offset: int, value: int) -> None:
        _Q.pack_into(self.map, self.base + offset, value)

    def _register_stacks(self) -> None:
        path = os.environ.get(STACKS_ENV)
        if not path or signal.getsignal(STACK_SIGNAL) not in (signal.SIG_DFL, None):
            return
        try:
            self.stacks = open(path, "w")  # noqa: SIM115 - kept open for faulthandler
            faulthandler.register(STACK_SIGNAL, file=self.stacks, all_threads=True, chain=False)
        except (OSError, RuntimeError, ValueError):
            return
        self.put(OFF_FLAGS, FLAG_STACKS)

    def beat(self, now: int) -> None:
        self.beats += 1
        if self.step_from is not None:
            i = self.samples % RING
            _D.pack_into(self.map, self.base + OFF_STEPS + 8 * i, (now - self.step_from) / 1e9)
            _D.pack_into(self.map, self.base + OFF_WORK + 8 * i, self.work_ns / 1e9)
            self.samples += 1
            self.put(OFF_SAMPLES, self.samples)
        self.step_from, self.work_ns = now, 0
        self.put(OFF_LAST, now)
        self.put(OFF_BEATS, self.beats)

    def show_section(self) -> None:
        name, until, started = self.sections[-1] if self.sections else ("", 0, 0)
        raw = name.encode("utf-8", "replace")[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
        self.map[self.base + OFF_NAME:self.base + OFF_NAME + _NAME_BYTES] = raw
        self.put(OFF_FROM, started)
        self.put(OFF_UNTIL, until)


_slot: _Slot | None = None
_off_pid: int | None = None  # the process for which the board is known to be absent


def _open() -> _Slot | None:
    global _slot, _off_pid
    pid = os.getpid()
    if _slot is not None and _slot.pid == pid:
        return _slot
    if _off_pid == pid or _slot is not None:  # _slot: a child forked by a beating worker
        _off_pid = pid
        return None
    path, index = os.environ.get(BOARD_ENV), os.environ.get(SLOT_ENV)
    if path and index is not None:
        try:
            _slot = _Slot(path, int(index))
            return _slot
        except (OSError, ValueError) as exc:
            print(f"[elasticstore] heartbeats disabled: {exc}", file=sys.stderr)
    _off_pid = pid
    return None


def heartbeat() -> None:
    """Tells the agent this worker made progress (call once per step)."""
    slot = _slot if _slot is not None and _slot.pid == os.getpid() else _open()
    if slot is not None:
        slot.beat(time.monotonic_ns())


@contextmanager
def section(name: str, timeout: float | None = None) -> Iterator[None]:
    """A stretch of work judged by its own ``timeout`` (seconds; None: never) instead of the
    heartbeat timeout. Nested sections: the innermost one applies."""
    if timeout is not None and not timeout > 0:
        raise ValueError(f"section {name!r}: timeout {timeout!r} must be positive (or None)")
    slot = _open()
    if slot is None:
        yield
        return
    started = time.monotonic_ns()
    until = NO_DEADLINE if timeout is None else started + int(timeout * 1e9)
    slot.sections.append((name, until, started))
    slot.show_section()
    try:
        yield
    finally:
        now = time.monotonic_ns()
        slot.sections.pop()
        if not slot.sections:
            slot.work_ns += now - started
        slot.put(OFF_LAST, now)  # leaving a section counts as a sign of life
        slot.show_section()
