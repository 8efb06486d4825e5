"""What makes a worker forked from the fork server look like a fresh ``python -u script.py``:
its ``sys.path``, its random seeds, its signal dispositions, its process title, and its end (exit
code, threads joined, atexit handlers, stdio flushed).

Standard library only: the fork server (run as a script) loads this file by its path.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

__all__ = ["exit_code", "finalize", "fresh_path", "reseed", "set_title", "worker_signals"]


def exit_code(exc: SystemExit) -> int:
    """The exit status the interpreter gives an uncaught ``SystemExit``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    try:
        print(exc.code, file=sys.stderr)
    except Exception:
        pass
    return 1


def finalize(code: int) -> None:
    """The interpreter's shutdown up to freeing objects: join non-daemon threads, run the atexit
    handlers, flush stdio; then exit without freeing ``__main__``'s objects (a fresh process
    frees them at interpreter teardown, where their destructors cannot block on other threads)."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            if code == 0:
                code = 120  # as the interpreter does when flushing stdout fails
    if code == -signal.SIGINT:  # an uncaught KeyboardInterrupt: die of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    os._exit(code & 0xFF)


def worker_signals(launcher: dict[str, str]) -> dict[int, Any]:
    """The dispositions a worker starts with, as a torchrun worker inherits them from the
    launcher through ``exec``: ignored where the launcher started with the signal ignored (SIGHUP
    under nohup; SIGINT and SIGQUIT in a shell's background job), else the default (SIGINT:
    ``KeyboardInterrupt``, as the interpreter sets it). ``launcher``: signal name -> ``ignore``
    or ``default`` (``forkclient.LAUNCHER_SIGNALS``); a signal it does not name: as this process
    has it now."""
    found: dict[int, Any] = {}
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT):
        given = launcher.get(sig.name)
        ignored = given == "ignore" if given is not None else signal.getsignal(sig) == signal.SIG_IGN
        found[sig] = (signal.SIG_IGN if ignored else signal.default_int_handler
                      if sig == signal.SIGINT else signal.SIG_DFL)
    return found


def reseed(torch: Any) -> None:
    """Fresh entropy for the generators a fresh interpreter seeds at import (``random`` reseeds
    itself after fork): every worker and every round draws different numbers."""
    if torch is not None:
        torch.default_generator.seed()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()
    rnd = sys.modules.get("random")
    if rnd is not None:
        rnd.seed()


def pythonpath(value: str | None) -> list[str]:
    """The entries a fresh interpreter puts on ``sys.path`` for ``PYTHONPATH`` (made absolute)."""
    if not value:
        return []
    return [os.path.abspath(p) for p in value.split(os.pathsep)]


def fresh_path(startup: list[str], server_pythonpath: str | None, first: str) -> list[str]:
    """``sys.path`` of a fresh interpreter: ``first`` (unless PYTHONSAFEPATH), the worker's
    PYTHONPATH, then the rest of this process's startup path, without duplicates."""
    mine = list(dict.fromkeys(pythonpath(server_pythonpath)))
    rest = startup[len(mine):] if startup[: len(mine)] == mine else startup
    entries = list(dict.fromkeys([*pythonpath(os.environ.get("PYTHONPATH")), *rest]))
    return entries if os.environ.get("PYTHONSAFEPATH") else [first, *entries]


def set_title(argv: list[str]) -> None:
    """What ``ps`` and /proc/PID/cmdline show for this process."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join(argv))
