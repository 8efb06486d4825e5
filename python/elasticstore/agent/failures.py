"""Worker failures: torch's ``@record`` error files and the root-cause summary.

A worker decorated with ``torch.distributed.elastic.multiprocessing.errors.record`` writes its
uncaught exception to ``TORCHELASTIC_ERROR_FILE`` as JSON (``{"message": {"message": ...,
"extraInfo": {"py_callstack": ..., "timestamp": ...}}}``). The root cause of an attempt is its
first failure by time; the summary names its rank, host, exit code or signal, message, traceback.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any

from .workers import Worker, signal_name

__all__ = ["Failure", "exits_of", "failure_of", "read_error_file", "summary"]


@dataclass(frozen=True)
class Failure:
    rank: int
    local_rank: int
    host: str
    pid: int
    exit_code: int
    when: float  # wall clock (the error file's timestamp when it has one)
    message: str
    traceback: str
    error_file: str | None

    @property
    def how(self) -> str:
        return signal_name(self.exit_code)


def read_error_file(path: str) -> tuple[str, str, float | None] | None:
    """(message, traceback, timestamp) from a ``@record`` error file; None when there is none."""
    try:
        with open(path) as f:
            data: Any = json.load(f)
    except (OSError, ValueError):
        return None
    msg = data.get("message", data) if isinstance(data, dict) else data
    if isinstance(msg, dict):
        extra = msg.get("extraInfo", {}) if isinstance(msg.get("extraInfo"), dict) else {}
        stamp = extra.get("timestamp")
        try:
            when = float(stamp) if stamp is not None else None
        except (TypeError, ValueError):
            when = None
        return str(msg.get("message", "")), str(extra.get("py_callstack", "")), when
    return str(msg), "", None


def failure_of(worker: Worker, host: str) -> Failure:
    assert worker.exit_code is not None
    spec = worker.spec
    found = read_error_file(spec.error_file)
    wall = worker.exited_wall or time.time()
    if found is None:
        message = f"worker exited with {signal_name(worker.exit_code)}"
        if worker.exit_code != 0:
            message += " (no error file: decorate the entry point with @record for a traceback)"
        return Failure(spec.rank, spec.local_rank, host, worker.pid, worker.exit_code, wall,
                       message, "", None)
    message, tb, stamp = found
    # The error file's stamp has whole seconds: it orders failures only across seconds.
    when = wall if stamp is None or abs(stamp - wall) < 1.0 else stamp
    return Failure(spec.rank, spec.local_rank, host, worker.pid, worker.exit_code, when,
                   message, tb, spec.error_file)


def exits_of(failures: list[Failure], stopped: list[Worker]) -> list[Failure]:
    """``failures`` with the exit code each worker really had once stopped (a hang is reported
    before its rank is stopped: SIGKILLed when hung itself, SIGTERMed with the group when it
    waits on a peer)."""
    codes = {w.pid: w.exit_code for w in stopped if w.exit_code is not None}
    return [replace(f, exit_code=codes[f.pid]) if f.pid in codes else f for f in failures]


def _block(f: Failure, index: int) -> list[str]:
    stamp = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(f.when))
    lines = [
        f"[{index}]:",
        f"  time      : {stamp}",
        f"  host      : {f.host}",
        f"  rank      : {f.rank} (local_rank: {f.local_rank})",
        f"  exitcode  : {f.exit_code} ({f.how}; pid: {f.pid})",
        f"  error_file: {f.error_file or '<N/A>'}",
        f"  message   : {f.message}",
    ]
    if f.traceback:
        lines.append("  traceback :")
        lines.extend("    " + line for line in f.traceback.rstrip().splitlines())
    return lines


def summary(entrypoint: str, failures: list[Failure]) -> str:
    """torchrun-style report: the root cause (first failure by time), then the others."""
    ordered = sorted(failures, key=lambda f: f.when)
    bar = "=" * 72
    lines = [bar, f"{entrypoint} FAILED", "-" * 72, "Root Cause (first observed failure):"]
    lines += _block(ordered[0], 0)
    lines += ["-" * 72, "Other Failures:"]
    if len(ordered) > 1:
        for i, f in enumerate(ordered[1:], 1):
            lines += _block(f, i)
    else:
        lines.append("  <NO_OTHER_FAILURES>")
    lines.append(bar)
    return "\n".join(lines)
