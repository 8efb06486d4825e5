"""The heartbeat board: one file in the agent's memory area (``/dev/shm``), one fixed slot per
local rank, written by the worker (``heartbeats.py``) and read by its agent (``agent/hangs.py``).
Standard library only: both sides import it.

A slot (little-endian, ``SLOT_BYTES``)::

    beats            q   steps beaten so far (0: never)
    last_beat_ns     q   CLOCK_MONOTONIC of the last beat (or of leaving a section)
    pid              q   the beating process
    flags            q   FLAG_STACKS: the worker dumps its stacks on STACK_SIGNAL
    section_until_ns q   0: no section; NO_DEADLINE: in a section without a timeout; else its deadline
    section_from_ns  q   when the open section began
    section          48s its name (UTF-8, NUL-padded)
    steps            8d  the last RING step times (beat to beat), seconds
    work             8d  the time spent in sections during each of those steps, seconds
    samples          q   step times written so far (the ring's index is samples % RING)

Writes are plain stores into a shared mapping: the reader may see a slot half-updated, and
reads each field as one aligned 8-byte value (never torn on the platforms torch supports).
"""

from __future__ import annotations

import mmap
import signal
import struct

__all__ = [
    "BOARD_ENV", "FLAG_STACKS", "NO_DEADLINE", "RING", "SLOT", "SLOT_BYTES", "SLOT_ENV",
    "STACKS_ENV", "STACK_SIGNAL", "SlotView", "read_slot",
]

BOARD_ENV = "ELASTICSTORE_HEARTBEAT_FILE"  # the board's path (set by elasticstore-run only)
SLOT_ENV = "LOCAL_RANK"  # a worker's slot is its local rank
STACKS_ENV = "ELASTICSTORE_STACKS_FILE"  # where the worker writes its stacks when asked
RING = 8  # step times kept per rank: the agent takes their median
SLOT = struct.Struct("<qqqqqq48s8d8dq")
SLOT_BYTES = 256  # SLOT.size rounded up: a slot never shares a cache line with the next
assert SLOT.size <= SLOT_BYTES
NO_DEADLINE = -1
FLAG_STACKS = 1
# Asks a beating worker for its Python stacks (faulthandler). A real-time signal: no library or
# user handler expects it; the worker registers it only when nothing else did.
STACK_SIGNAL = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2

# Offsets of the fields the worker updates one at a time.
OFF_BEATS, OFF_LAST, OFF_PID, OFF_FLAGS, OFF_UNTIL, OFF_FROM, OFF_NAME = 0, 8, 16, 24, 32, 40, 48
OFF_STEPS = 96
OFF_WORK = OFF_STEPS + 8 * RING
OFF_SAMPLES = OFF_WORK + 8 * RING


class SlotView:
    """One slot as read by the agent."""

    __slots__ = ("beats", "last_beat_ns", "pid", "flags", "section_until_ns", "section_from_ns",
                 "section", "steps", "work")

    def __init__(self, raw: tuple[object, ...]) -> None:
        (self.beats, self.last_beat_ns, self.pid, self.flags, self.section_until_ns,
         self.section_from_ns) = (int(x) for x in raw[:6])  # type: ignore[call-overload]
        name = raw[6]
        assert isinstance(name, bytes)
        self.section = name.rstrip(b"\0").decode("utf-8", "replace")
        samples = int(raw[-1])  # type: ignore[call-overload]
        n = min(samples, RING)
        self.steps = [float(x) for x in raw[7:7 + RING]][:n]  # type: ignore[arg-type]
        self.work = [float(x) for x in raw[7 + RING:7 + 2 * RING]][:n]  # type: ignore[arg-type]


def read_slot(buf: bytes | bytearray | memoryview | mmap.mmap, index: int) -> SlotView:
    return SlotView(SLOT.unpack_from(buf, index * SLOT_BYTES))
