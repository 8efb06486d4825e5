"""Worker output: per-rank files and the agent's console, whole lines only.

Each worker's stdout and stderr are pipes read by a thread of the agent (``LogRelay``). A line goes
to ``<attempt dir>/<rank>/{stdout,stderr}.log`` when there is a log directory and to the agent's
console prefixed ``[host:rank]`` unless redirected (``-r``) without ``--tee``, or filtered out by
``--local-ranks-filter``. Console writes take one lock per line, so lines of different workers
never interleave mid-line.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import BinaryIO

__all__ = ["LogRelay", "Std", "console_for", "parse_std", "say"]

_CONSOLE_LOCK = threading.Lock()
_MAX_LINE = 1 << 16  # a longer line is written in pieces of this size


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
        self._file: BinaryIO | None = open(file_path, "ab") if file_path else None
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
                    self._write(line)
        except (OSError, ValueError):
            pass
        finally:
            if self._file is not None:
                self._file.close()

    def _write(self, line: bytes) -> None:
        if self._file is not None:
            self._file.write(line)
            self._file.flush()
        if self._console is not None:
            if not line.endswith(b"\n"):
                line += b"\n"
            with _CONSOLE_LOCK:
                self._console.write(self._prefix + line)
                self._console.flush()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def console_for(stream: str) -> BinaryIO:
    return sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer


def say(text: str) -> None:
    """An agent's own line on its console (stderr), never inside a worker's line."""
    with _CONSOLE_LOCK:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
