"""The round watch (``rendezvous/closing.py``) when another thread ends it because the store's
host is lost: a stop the host sent before it left, already read from the socket but not yet
handled (the agent was frozen, then thawed with all its threads at once), is still reported.
Before, the thread that found the host lost ended the watch first and the stop was dropped: the
thawed node took the job for alive and hosted it again."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import elasticstore
from elasticstore.rendezvous.closing import RoundWatch
from elasticstore.rendezvous.native import NativeBackend

KEY = "rdzv/job/ctl/restart/1"
SETTER = """
import json, sys
import elasticstore
store = elasticstore.Store("127.0.0.1", int(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()
store.set(sys.argv[2], json.dumps({"closed": "stopped by operator"}))
print("set", flush=True)
"""


def test_a_stop_already_received_is_reported_when_another_thread_ends_the_watch() -> None:
    with elasticstore.StoreServer("127.0.0.1", 0) as server:
        seen: list[str] = []
        backend = NativeBackend(elasticstore.Store("127.0.0.1", server.port), server.address)
        watch = RoundWatch(backend, KEY, seen.append)
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(watch.wait(30)))
        setter = subprocess.Popen([sys.executable, "-c", SETTER, str(server.port), KEY],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        interval = sys.getswitchinterval()
        try:
            assert setter.stdin is not None and setter.stdout is not None
            assert setter.stdout.readline().strip() == "ready"
            waiter.start()
            deadline = time.monotonic() + 10
            while server.stats()["waiters"] < 1:  # the watch is waiting at the server
                assert time.monotonic() < deadline, "the watch never waited"
                time.sleep(0.01)
            # From here this thread keeps the interpreter: the watch's thread gets the stop from
            # its socket (no interpreter needed) but cannot handle it, as when a frozen agent's
            # threads all wake at once and another one finds the host gone first.
            sys.setswitchinterval(30.0)
            setter.stdin.write("go\n")
            setter.stdin.flush()
            until = time.monotonic() + 1.5
            while time.monotonic() < until:
                pass
            watch.end(grace=5.0)
            sys.setswitchinterval(interval)
            assert setter.stdout.readline().strip() == "set"
            waiter.join(10)
            assert result == [True]
            assert seen == ["stopped by operator"], "the stop already received was dropped"
        finally:
            sys.setswitchinterval(interval)
            watch.close()
            waiter.join(10)
            setter.kill()
            setter.wait()
            for pipe in (setter.stdin, setter.stdout):
                if pipe is not None:
                    pipe.close()
