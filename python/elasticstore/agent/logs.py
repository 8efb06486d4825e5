"""Worker output: per-rank files and the agent's console.

Each worker's stdout and stderr are read by a thread of the agent (``LogRelay``). What it reads
goes to ``<attempt dir>/<rank>/{stdout,stderr}.log`` when there is a log directory and to the
agent's console unless redirected (``-r``) without ``--tee``, or filtered out by
``--local-ranks-filter``: through a pipe as whole prefixed lines, or through a pseudo-terminal
when the launcher's stream is a terminal (``console.py``). The prefix: ``[host:rank] ``;
torchrun's ``[<role><local rank>]:`` for a teed stream; ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``
when set.

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
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from string import Template
from typing import Any

from .console import LOCK, ConsoleWriter, Sink, end_partial, open_pty

__all__ = ["LogRelay", "RankDest", "Std", "UnsafeLogPath", "console_for", "console_prefix", "open_log",
           "open_rank_log", "parse_std", "rank_output", "run_log_dir", "say"]

_MAX_LINE = 1 << 16  # a longer line is written in pieces of this size
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class RankDest:
    """One worker's files from a ``--logs-specs`` ``LogsDest`` (``logspecs.py``): a stream's path
    (``""``: the console only), the streams also shown on the console, the filtered files."""

    stdout: str
    stderr: str
    tee: frozenset[str] = frozenset()
    filtered: dict[str, str] = field(default_factory=dict)


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
    """Copies one worker stream to its file and/or the console until EOF, in a thread of its own:
    whole lines from a pipe, or (``terminal``) what comes, as it comes, from a pseudo-terminal.

    ``file_fd`` (owned by the relay from here on) is written with ``os.write``; ``label`` names
    it in the one line that reports a failed write."""

    def __init__(self, fd: int, console: ConsoleWriter | None, file_fd: int | None,
                 label: str = "log file", terminal: bool = False,
                 filtered: Filtered | None = None) -> None:
        self._fd = fd
        self._file = file_fd
        self._filtered = filtered
        self._label = label
        self._console = console
        self._terminal = terminal
        self._thread = threading.Thread(target=self._run, name=f"log {label}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._terminal:
                self._chunks()
            else:
                self._lines()
        finally:
            self._close_file()
            if self._filtered is not None:
                self._filtered.close()
            if self._console is not None:
                self._console.close()

    def _lines(self) -> None:
        try:
            with os.fdopen(self._fd, "rb", buffering=1 << 16) as pipe:
                for _ in range(1 << 62):
                    line = pipe.readline(_MAX_LINE)
                    if not line:
                        return
                    self._to_file(line)
                    self._to_console(line)
                    if self._filtered is not None:
                        self._filtered.line(line)
        except (OSError, ValueError):  # the pipe itself failed: nothing left to drain
            pass

    def _chunks(self) -> None:
        try:
            for _ in range(1 << 62):
                try:
                    data = os.read(self._fd, _MAX_LINE)
                except InterruptedError:
                    continue
                except OSError:  # EIO: every process holding the terminal's other end is gone
                    return
                if not data:
                    return
                self._to_file(data)
                self._to_console(data)
        finally:
            os.close(self._fd)

    def _to_file(self, data: bytes) -> None:
        if self._file is None:
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._file, view):]
        except OSError as exc:
            self._close_file()
            say(f"[elasticstore-run] {self._label}: {exc.strerror or exc}: the rest of this "
                "stream is not written to it (the worker runs on)")

    def _to_console(self, data: bytes) -> None:
        if self._console is None:
            return
        try:
            if self._terminal:
                self._console.chunk(data)
            else:
                self._console.line(data)
        except (OSError, ValueError):  # the console is gone: keep draining
            self._console = None

    def _close_file(self) -> None:
        fd, self._file = self._file, None
        if fd is not None:
            os.close(fd)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class Filtered:
    """torchrun's ``--duplicate-std{out,err}-filters``: a teed worker stream's lines that contain
    any of ``needles`` also go, prefixed as on the console, to the attempt's
    ``filtered_<stream>.log`` (one file for all the ranks of this node; each relay appends whole
    lines through a descriptor of its own)."""

    def __init__(self, fd: int, needles: Sequence[str], prefix: str) -> None:
        self._fd: int | None = fd
        self._needles = [n.encode() for n in needles]
        self._prefix = prefix.encode()

    def line(self, data: bytes) -> None:
        if self._fd is not None and any(n in data for n in self._needles):
            try:
                os.write(self._fd, self._prefix + data)
            except OSError:
                self.close()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def console_for(stream: str) -> Sink:
    """The launcher's ``stream`` as it is now (a caller may have put a ``StringIO`` there)."""
    return Sink(sys.stdout if stream == "stdout" else sys.stderr)


def say(text: str) -> None:
    """An agent's own line on its console (stderr), never inside a worker's line."""
    with LOCK:
        end_partial(None)
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def run_log_dir(root: str, run_id: str, layout: str) -> str:
    """The run's directory below ``root``: ``<run_id>``, or for torchrun's layout a fresh
    ``<run_id>_<random>`` (as torch's ``DefaultLogsSpecs``: one per launcher)."""
    if layout != "torchrun":
        return run_id
    os.makedirs(root, exist_ok=True)
    return os.path.basename(tempfile.mkdtemp(prefix=f"{run_id}_", dir=root))


def open_rank_log(log_root: str, rank_dir: str, name: str) -> int:
    """``<rank_dir>/<name>`` below ``log_root`` (a worker's attempt directory), no symbolic link
    followed."""
    parts = os.path.relpath(rank_dir, log_root).split(os.sep)
    return open_log(log_root, parts, name)


def console_prefix(s: Any, spec: Any, teed: bool) -> str:
    """``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` (``${role_name}``, ``${rank}``, ``${local_rank}``)
    when set; else torchrun's ``[<role><local rank>]:`` for a teed stream (``-t``), else
    ``[host:rank] ``."""
    if s.log_line_prefix_template:
        return Template(s.log_line_prefix_template).safe_substitute(
            role_name=s.role, rank=spec.rank, local_rank=spec.local_rank)
    if teed:
        return f"[{s.role}{spec.local_rank}]:"
    return f"[{s.host}:{spec.rank}] "


def rank_output(s: Any, log_root: str | None, spec: Any, stream: str) -> tuple[int, LogRelay]:
    """One worker stream: (the descriptor the worker writes to, the relay reading it). To its log
    file, and (unless redirected without tee, or filtered out by --local-ranks-filter) to the
    launcher's console: through a pseudo-terminal when that is a terminal and the stream is
    neither redirected nor teed (the worker then sees a terminal, as under torchrun), else through
    a pipe, whole lines (``console.py``)."""
    local, rank_dir, dest = spec.local_rank, spec.log_dir, spec.dest
    redirected = Std.has(s.redirects.get(local, 0), stream)
    teed = Std.has(s.tee.get(local, 0), stream)
    shown = s.local_ranks_filter is None or local in s.local_ranks_filter
    label = os.path.join(rank_dir or ".", f"{stream}.log")
    file_fd = open_rank_log(log_root, rank_dir, f"{stream}.log") if rank_dir and log_root else None
    if dest is not None:  # --logs-specs: the paths its LogsDest gave (logspecs.py)
        path = dest.stdout if stream == "stdout" else dest.stderr
        redirected, teed, shown, label = path != "", stream in dest.tee, True, path or label
        if redirected and path != os.devnull:  # torch's: opened "w"
            file_fd = os.open(path, _FILE_FLAGS & ~os.O_NOFOLLOW | os.O_TRUNC, 0o644)
    filtered = None
    try:
        needles = s.duplicate_filters.get(stream, ())
        if needles and teed and dest is not None and stream in dest.filtered:
            filtered = Filtered(os.open(dest.filtered[stream], _FILE_FLAGS & ~os.O_NOFOLLOW),
                                needles, console_prefix(s, spec, teed))
        elif needles and teed and rank_dir and log_root:  # torchrun's: the teed ranks' lines
            fd = open_rank_log(log_root, os.path.dirname(rank_dir), f"filtered_{stream}.log")
            filtered = Filtered(fd, needles, console_prefix(s, spec, teed))
        sink = console_for(stream) if shown and (teed or not redirected) else None
        writer = None if sink is None else ConsoleWriter(sink, console_prefix(s, spec, teed))
        terminal = sink is not None and sink.tty and not teed and not redirected
        if terminal:
            assert writer is not None
            try:
                reader, theirs = open_pty(sink.fileno if sink else None, len(writer.prefix))
            except OSError as exc:  # no pseudo-terminal left: whole lines through a pipe
                say(f"[elasticstore-run] {label}: no pseudo-terminal ({exc.strerror or exc}): "
                    "the worker writes to a pipe")
                terminal = False
        if not terminal:
            reader, theirs = os.pipe()
    except BaseException:
        if file_fd is not None:
            os.close(file_fd)
        if filtered is not None:
            filtered.close()
        raise
    return theirs, LogRelay(reader, writer, file_fd, label, terminal, filtered)
