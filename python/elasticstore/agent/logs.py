"""Worker output: per-rank files and the agent's console, whole lines only.

Each worker's stdout and stderr are pipes read by a thread of the agent (``LogRelay``). A line goes
to ``<attempt dir>/<rank>/{stdout,stderr}.log`` when there is a log directory and to the agent's
console prefixed ``[host:rank]`` unless redirected (``-r``) without ``--tee``, or filtered out by
``--local-ranks-filter``. Console writes take one lock per line, so lines of different workers
never interleave mid-line.

The files sit at fixed paths under the log directory, so they are opened without following
symbolic links below it (``open_log``): a link planted at ``<run_id>/attempt_0`` or at a
``stdout.log`` is refused (``UnsafeLogPath``) instead of appending to whatever it points at. A
write that fails (a full disk) is reported once and ends the writes to that file; the relay keeps
draining the pipe, so the worker never notices.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any, BinaryIO

__all__ = ["LogRelay", "Std", "UnsafeLogPath", "console_for", "open_log", "open_rank_log", "parse_std",
           "rank_relay", "say"]

_CONSOLE_LOCK = threading.Lock()
_MAX_LINE = 1 << 16  # a longer line is written in pieces of this size
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeLogPath(OSError):
    """A path below the log directory is a symbolic link (or not a directory where one belongs)."""


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


def _refused(path: str, exc: OSError) -> OSError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR) or os.path.islink(path):
        kind = "a symbolic link" if os.path.islink(path) else "not a directory"
        return UnsafeLogPath(exc.errno or errno.ELOOP,
                             f"--log-dir: {path} is {kind}: refusing to follow it (remove it or "
                             "choose another --log-dir)")
    return exc


def open_log(base: str, parts: Sequence[str], name: str) -> int:
    """An append-only descriptor of ``base/parts.../name``, creating the directories below
    ``base`` one at a time; none of them nor the file may be a symbolic link."""
    os.makedirs(base, exist_ok=True)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    path = base
    try:
        for part in parts:
            path = os.path.join(path, part)
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _refused(path, exc) from None
            os.close(fd)
            fd = sub
        path = os.path.join(path, name)
        try:
            return os.open(name, _FILE_FLAGS, 0o644, dir_fd=fd)
        except OSError as exc:
            raise _refused(path, exc) from None
    finally:
        os.close(fd)


class LogRelay:
    """Copies one pipe to a file and/or the console until EOF, in a thread of its own.

    ``file_fd`` (owned by the relay from here on) is written with ``os.write``; ``label`` names
    it in the one line that reports a failed write."""

    def __init__(self, fd: int, prefix: str, file_fd: int | None, console: BinaryIO | None,
                 label: str = "log file") -> None:
        self._fd = fd
        self._prefix = prefix.encode()
        self._file = file_fd
        self._label = label
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


def open_rank_log(log_root: str, rank_dir: str, name: str) -> int:
    """``<rank_dir>/<name>`` below ``log_root`` (a worker's attempt directory), no symbolic link
    followed."""
    parts = os.path.relpath(rank_dir, log_root).split(os.sep)
    return open_log(log_root, parts, name)


def rank_relay(s: Any, log_root: str | None, spec: Any, stream: str, fd: int) -> LogRelay:
    """The relay of one worker's ``stream``: to its log file and (unless redirected, or filtered
    out by --local-ranks-filter) to the launcher's console, prefixed ``[host:rank]``."""
    local, rank, rank_dir = spec.local_rank, spec.rank, spec.log_dir
    quiet = Std.has(s.redirects.get(local, 0), stream) and not Std.has(s.tee.get(local, 0), stream)
    shown = s.local_ranks_filter is None or local in s.local_ranks_filter
    file_fd = open_rank_log(log_root, rank_dir, f"{stream}.log") if rank_dir and log_root else None
    console = console_for(stream) if shown and not quiet else None
    return LogRelay(fd, f"[{s.host}:{rank}] ", file_fd, console,
                    os.path.join(rank_dir or ".", f"{stream}.log"))
