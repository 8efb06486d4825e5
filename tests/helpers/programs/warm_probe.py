"""A worker script that records the process state it starts with, for comparing a warm-started
worker with a fresh ``python -u warm_probe.py`` (or ``python -u -m``) side by side.

Writes ``probe-<attempt>-<rank>.json`` to ``--dir``: sys.path, sys.argv, cwd, environment,
``__main__``'s globals, /proc cmdlines, random draws (unseeded, then seeded), what stdin gave,
the open descriptors, every signal's disposition, the root logger's handlers and level, the
interpreter's ``-X`` options.
``--fail-rank R``: rank R exits 1 in attempt 0 (a restart). ``--handler``: SIGTERM/SIGINT take
about 1 s to write ``saved-<rank>``, then exit 0; the script sleeps until signalled.
``--breakpoint``: calls ``breakpoint()`` (the debugger reads its commands from stdin).
``--raise``: starts a thread (writes ``thread-<rank>`` after 0.5 s), registers an atexit handler
(writes ``atexit-<rank>``), then raises.
"""

import json
import logging
import os
import random
import re
import signal
import sys
import time

import numpy
import torch

_GLOBALS = {k: re.sub(" at 0x[0-9a-f]+", "", repr(v)) if k not in ("__builtins__", "__loader__")
            else type(v).__name__ for k, v in globals().items()}


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


def _fds() -> dict[str, str]:
    """Descriptor -> what it is (the listing's own descriptor left out)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            found[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return found


def _signals() -> dict[str, str]:
    return {sig.name: repr(signal.getsignal(sig)) for sig in signal.Signals
            if sig not in (signal.SIGKILL, signal.SIGSTOP)}


def _draws() -> dict[str, object]:
    return {"torch": torch.rand(2).tolist(), "numpy": numpy.random.rand(2).tolist(),
            "random": random.random()}


def _record(path: str, info: dict[str, object]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    args = sys.argv[1:]
    out = args[args.index("--dir") + 1]
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("ELASTICSTORE_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    info: dict[str, object] = {
        "pid": os.getpid(), "path": sys.path, "argv": sys.argv, "cwd": os.getcwd(),
        "env": dict(os.environ), "globals": _GLOBALS, "cmdline": _cmdline(os.getpid()),
        "parent_cmdline": _cmdline(os.getppid()), "draws": _draws(), "fds": _fds(),
        "signals": _signals(), "root_logger": [logging.root.level, repr(logging.root.handlers)],
        "dev_mode": sys.flags.dev_mode, "xoptions": sys._xoptions,
    }
    torch.manual_seed(1234)
    numpy.random.seed(1234)
    random.seed(1234)
    info["seeded"] = _draws()
    if "--breakpoint" in args:
        breakpoint()
        info["after_breakpoint"] = True
    if "--read-stdin" in args:
        info["stdin"] = sys.stdin.readline()
    if "--handler" in args:
        def save(signum: int, frame: object) -> None:
            time.sleep(1.0)
            with open(os.path.join(out, f"saved-{rank}"), "w") as f:
                f.write(signal.Signals(signum).name)
            sys.exit(0)

        signal.signal(signal.SIGTERM, save)
        signal.signal(signal.SIGINT, save)
    _record(os.path.join(out, f"probe-{attempt}-{rank}.json"), info)
    if "--fail-rank" in args and attempt == 0 and rank == int(args[args.index("--fail-rank") + 1]):
        sys.exit(1)
    if "--raise" in args:  # what a fresh interpreter does at the end: threads, atexit, exit 1
        import atexit
        import threading

        def mark(name: str) -> None:
            with open(os.path.join(out, f"{name}-{rank}"), "w") as f:
                f.write(name)

        threading.Thread(target=lambda: (time.sleep(0.5), mark("thread"))).start()
        atexit.register(lambda: mark("atexit" if os.path.exists(os.path.join(out, f"thread-{rank}"))
                                     else "atexit-before-thread"))
        raise ValueError("the probe fails on purpose")
    if "--handler" in args:
        for _ in range(3000):  # at most ~10 min; the test signals it long before
            time.sleep(0.2)


if __name__ == "__main__":
    main()
