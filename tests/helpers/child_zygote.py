"""A process that has imported torch and ``child_tasks`` once, and forks each test child from
there (``spawned.spawn``): a child starts in milliseconds instead of paying torch's import (1.5-5 s
of CPU on a small machine) every time.

Protocol, one JSON line each way on stdin/stdout: a request ``{"task", "args", "out", "err",
"rc", "env", "cwd"}`` is answered with the child's pid. The child writes its stdout and stderr to
the files ``out`` and ``err`` and, when it ends by itself, its exit code to ``rc``. Children are
reaped by the kernel (SIGCHLD ignored here); the test process follows them by pidfd. The zygote
ends when its stdin closes (the test process is gone)."""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import child_tasks  # noqa: E402  (imports torch.distributed, and with it torch)


def _child(req: dict[str, Any]) -> None:
    """In the forked child: runs the task as ``python child_tasks.py TASK ARGS`` would. Never
    returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the task may start and wait for its own
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, key in ((1, "out"), (2, "err")):
            target = os.open(str(req[key]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(str(req["cwd"]))
        sys.argv = [child_tasks.__file__, str(req["task"]), json.dumps(req["args"])]
        child_tasks.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported as python would: traceback, exit 1
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            with open(str(req["rc"]), "w") as f:
                f.write(str(code))
        finally:
            os._exit(code)


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped as they end
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
