"""Worker output: per-rank files and the agent's console, whole lines only.

Each worker's stdout and stderr are pipes read by a thread of the agent (``LogRelay``). A line goes
to ``<attempt dir>/<rank>/{stdout,stderr}.log`` when there is a log directory and to the agent's
console prefixed ``[host:rank]`` unless redirected (``-r``) without ``--tee``, or filtered out by
``--local-ranks-filter``. Console writes take one lock per line, so lines of different workers
never interleave mid-line.

A write that fails (a full disk) is reported once and ends the writes to that file; the relay keeps
draining the pipe, so the worker never notices.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import BinaryIO

__all__ = ["LogRelay", "Std", "console_for", "parse_std", "say"]

_CONSOLE_LOCK = threading.Lock()
_MAX_LINE = 1 << 16  # a longer line is written in pieces of this size
_FILE_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC


class Std:
    NONE, OUT, ERR, ALL = 0, 1, 2, 3

    @staticmethod
    def has(value: int, stream: str) -> bool:
        bit = Std.OUT if stream == "stdout" else Std.ERR
        return bool(value & bit)


def parse_std(flag: str, text: str, nproc: int) -> dict[int, int]:
    """torchrun's ``-r``/``-t`` value: ``3`` (every local rank) or ``0:1,1:3`` (per local rank)."""
    text = text.strip()

    def one(v: str) -> int:
        if not v.strip().isdigit() or int(v) > 3:
            raise ValueError(f"{flag} {text!r}: {v!r} is not 0 (none), 1 (stdout), 2 (stderr) or 3 (both)")
        return int(v)

    if ":" not in text:
        value = one(text or "0")
        return {r: value for r in range(nproc)}
    result = {r: Std.NONE for r in range(nproc)}
    for item in text.split(","):
        local, _, bits = item.partition(":")
        if not local.strip().isdigit():
            raise ValueError(f"{flag} {text!r}: {local!r} is not a local rank")
        result[int(local)] = one(bits)
    return result


class LogRelay:
    """Copies one pipe to a file and/or the console until EOF, in a thread of its own."""

    def __init__(self, fd: int, prefix: str, file_path: str | None, console: BinaryIO | None) -> None:
        self._fd = fd
        self._prefix = prefix.encode()
        self._file = os.open(file_path, _FILE_FLAGS, 0o644) if file_path else None
        self._label = file_path or "log file"
        self._console = console
        self._thread = threading.Thread(target=self._run, name=f"log {prefix}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with os.fdopen(self._fd, "rb", buffering=1 << 16) as pipe:
                for _ in range(1 << 62):
                    line = pipe.readline(_MAX_LINE)
                    if not line:
                        return
                    self._to_file(line)
                    self._to_console(line)
        except (OSError, ValueError):  # the pipe itself failed: nothing left to drain
            pass
        finally:
            self._close_file()

    def _to_file(self, line: bytes) -> None:
        if self._file is None:
            return
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._file, view):]
        except OSError as exc:
            self._close_file()
            say(f"[elasticstore-run] {self._label}: {exc.strerror or exc}: the rest of this "
                "stream is not written to it (the worker runs on)")

    def _to_console(self, line: bytes) -> None:
        if self._console is None:
            return
        if not line.endswith(b"\n"):
            line += b"\n"
        try:
            with _CONSOLE_LOCK:
                self._console.write(self._prefix + line)
                self._console.flush()
        except (OSError, ValueError):  # the console is gone: keep draining the pipe
            self._console = None

    def _close_file(self) -> None:
        fd, self._file = self._file, None
        if fd is not None:
            os.close(fd)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def console_for(stream: str) -> BinaryIO:
    return sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer


def say(text: str) -> None:
    """An agent's own line on its console (stderr), never inside a worker's line."""
    with _CONSOLE_LOCK:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
