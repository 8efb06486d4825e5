"""What platforms read from the launcher, as from torchrun: the workers' file timer
(``filetimer.py``) and the launcher's own ``TORCHELASTIC_ERROR_FILE``; :class:`PlatformHooks` is
the agent's one handle on both (docs/agent.md, "Exit codes and what platforms read").

A platform that starts the launcher (TorchX, Kubeflow's training operator) sets
``TORCHELASTIC_ERROR_FILE`` for it and reads the file when it fails. torchrun's ``main`` is
decorated with torch's ``@record``: when the workers failed, the root cause's error file (the first
failure by time) is copied there with ``errorCode`` set to its exit code; when the root cause left
no error file (no ``@record`` in the script, or a worker killed by a signal), nothing is written;
when the launcher itself raised, its exception is written (a signal that ended it included:
torchrun's agent raises ``SignalException``). All go through torch's own
``ErrorHandler``, so the file is byte for byte what torchrun writes.
"""

from __future__ import annotations

import os
import signal

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

from .failures import Failure
from .filetimer import FileTimerSettings, WorkerTimers
from .logs import say

__all__ = ["PlatformHooks", "copy_root_cause", "record_launcher_error", "record_signal"]

VAR = "TORCHELASTIC_ERROR_FILE"


def copy_root_cause(failures: list[Failure]) -> None:
    """The root cause's error file to the launcher's, as torchrun's ``@record`` main."""
    if not os.environ.get(VAR) or not failures:
        return
    root = min(failures, key=lambda f: f.when)
    if root.error_file is None or not os.path.isfile(root.error_file):
        return
    try:
        ErrorHandler().dump_error_file(root.error_file, root.exit_code)
    except (OSError, ValueError) as exc:  # unreadable JSON, an unwritable path
        say(f"[elasticstore-run] could not write {VAR}={os.environ[VAR]}: {exc}")


def record_launcher_error(exc: BaseException) -> None:
    """The launcher's own exception (call it inside the ``except`` block: the traceback is the
    one being handled), as torchrun's ``@record`` main."""
    if not os.environ.get(VAR):
        return
    try:
        ErrorHandler().record_exception(exc)
    except OSError as err:
        say(f"[elasticstore-run] could not write {VAR}={os.environ[VAR]}: {err}")


def record_signal(signum: int) -> None:
    """The launcher ended by a signal: torchrun's ``@record`` main records the ``SignalException``
    its agent raised (``Process <pid> got signal: <n>``); the same here."""
    try:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}",
                              sigval=signal.Signals(signum))
    except SignalException as exc:
        record_launcher_error(exc)


class PlatformHooks:
    """Settings read once from the launcher's environment; ``start()`` serves the file timer
    (when enabled) until ``close()``. ``error_file=False``: the launcher's error file is left to
    the caller (``elasticstore.launcher``, in the caller's process as torch's ``elastic_launch``:
    there the caller's ``@record`` writes it from the ``ChildFailedError``)."""

    def __init__(self, error_file: bool = True) -> None:
        self._timer_settings = FileTimerSettings.from_env(os.environ)
        self._timers: WorkerTimers | None = None
        self._error_file = error_file

    def start(self) -> None:
        self._timers = WorkerTimers(self._timer_settings, say)

    def worker_env(self) -> dict[str, str]:
        return self._timers.env() if self._timers is not None else {}

    def ended(self, code: int) -> int:
        """The launcher's exit code, passed through; one over 128 ended by a signal is recorded."""
        if code > 128 and self._error_file:
            record_signal(code - 128)
        return code

    def failed(self, failures: list[Failure]) -> None:
        if self._error_file:
            copy_root_cause(failures)

    def launcher_failed(self, exc: BaseException) -> None:
        if self._error_file:
            record_launcher_error(exc)

    def close(self) -> None:
        if self._timers is not None:
            self._timers.close()
            self._timers = None
