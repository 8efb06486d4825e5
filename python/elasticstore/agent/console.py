"""The launcher's console as the workers' output reaches it.

Two ways a worker's stream reaches the console (``logs.rank_output`` picks one per stream):

- **Lines** (a pipe): the launcher's stream is a pipe or a file, or the rank is teed (``-t``, as
  torchrun's tee reads a file): whole lines, each prefixed, never two workers' text in one line.
- **Terminal** (a pseudo-terminal per worker stream): the launcher's stream is a terminal and the
  rank's stream is shown and not redirected. The worker sees a terminal (``isatty()``, its size)
  as it would under torchrun, and its output is copied as it comes, not held until a newline, so a
  progress bar's carriage-return updates show live. The prefix is written again after every
  ``\\r`` and ``\\n``, and the terminal the worker sees is narrower by the prefix's width, so an
  updated line never wraps. A line another worker (or the agent) leaves unfinished is ended with
  a newline before anyone else writes: a bar stays whole on its own line.

Every console write holds ``LOCK``.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import termios
import threading
from typing import Any

__all__ = ["LOCK", "ConsoleWriter", "Sink", "end_partial", "open_pty"]

LOCK = threading.Lock()
_PIECES = re.compile(rb"[^\r\n]*[\r\n]|[^\r\n]+")
_MIN_COLUMNS = 20
_partial: list[ConsoleWriter | None] = [None]  # whose unfinished line the console shows


class Sink:
    """One of the launcher's streams: bytes to its binary buffer, or text where it has none (a
    ``StringIO`` in place of ``sys.stdout``, as in-process callers capture output)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._raw = getattr(stream, "buffer", None)
        try:
            self.tty = bool(stream.isatty())
        except (AttributeError, ValueError, OSError):
            self.tty = False
        self.fileno: int | None = None  # the terminal's (its size), when it has one
        if self.tty:
            try:
                self.fileno = stream.fileno()
            except (AttributeError, ValueError, OSError):
                pass

    def write(self, data: bytes) -> None:
        if self._raw is not None:
            self._stream.flush()  # what the launcher printed itself comes first
            self._raw.write(data)
            self._raw.flush()
        else:
            self._stream.write(data.decode(errors="replace"))
            self._stream.flush()


def end_partial(writer: ConsoleWriter | None) -> None:
    """Under ``LOCK``, before ``writer`` (None: the agent) writes: another writer's unfinished
    line is ended first."""
    owner = _partial[0]
    if owner is not None and owner is not writer:
        _partial[0] = None
        owner.end_line()


class ConsoleWriter:
    """One worker stream's console output: ``line`` (whole lines) or ``chunk`` (terminal)."""

    def __init__(self, sink: Sink, prefix: str) -> None:
        self.sink = sink
        self.prefix = prefix.encode()
        self._at_start = True  # the cursor is at the start of a line: the prefix comes next

    def line(self, line: bytes) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        with LOCK:
            if self.sink.tty:
                end_partial(None)  # anyone's unfinished line, this writer's too
            self.sink.write(self.prefix + line)

    def chunk(self, data: bytes) -> None:
        out = bytearray()
        with LOCK:
            end_partial(self)
            for piece in _PIECES.findall(data):
                if self._at_start and piece not in (b"\r", b"\n"):
                    out += self.prefix
                out += piece
                self._at_start = piece.endswith((b"\r", b"\n"))
            self.sink.write(bytes(out))
            _partial[0] = None if out.endswith(b"\n") else self

    def end_line(self) -> None:
        """Another writer comes: this writer's unfinished line (or bar) is left as it stands."""
        try:
            self.sink.write(b"\n")
        except (OSError, ValueError):
            pass
        self._at_start = True

    def close(self) -> None:
        with LOCK:
            if _partial[0] is self:
                _partial[0] = None
                self.end_line()


def open_pty(like: int | None, prefix_width: int) -> tuple[int, int]:
    """(master, slave) of a pseudo-terminal that passes bytes unchanged (no ``\\n`` ->
    ``\\r\\n``), as tall as the terminal ``like`` and narrower by ``prefix_width`` columns."""
    master, slave = os.openpty()
    try:
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        rows, cols = 24, 80
        if like is not None:
            try:
                rows, cols, _, _ = struct.unpack(
                    "HHHH", fcntl.ioctl(like, termios.TIOCGWINSZ, b"\0" * 8))
            except OSError:
                pass
        cols = max(cols - prefix_width, _MIN_COLUMNS) if cols else cols
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    return master, slave
