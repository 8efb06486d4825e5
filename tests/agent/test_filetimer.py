"""The agent's server for torch's file timer (``agent/filetimer.py``) with torch's own client in a
real process, and the requests it refuses. The launcher side by side with torchrun:
``test_run_platform.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from elasticstore.agent.filetimer import FileTimerSettings, WorkerTimers

CLIENT = """
import os, sys, time
from torch.distributed.elastic import timer
timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
with timer.expires(after=30):
    time.sleep(0.1)  # released in time
print("released", flush=True)
with timer.expires(after=float(sys.argv[1])):
    time.sleep(60)
"""


def _timers(path: str, said: list[str]) -> WorkerTimers:
    return WorkerTimers(FileTimerSettings(enabled=True, path=path), said.append)


def test_torchs_client_is_killed_when_its_scope_expires(tmp_path: object) -> None:
    fifo = os.path.join(str(tmp_path), "timer")
    said: list[str] = []
    timers = _timers(fifo, said)
    child = None
    try:
        env = dict(os.environ, **timers.env())
        start = time.monotonic()
        child = subprocess.Popen([sys.executable, "-c", CLIENT, "1"], env=env,
                                 stdout=subprocess.PIPE, text=True)
        out, _ = child.communicate(timeout=60)
        code = child.returncode
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.communicate(timeout=10)
        timers.close()
    assert code == -signal.SIGKILL, (code, out, said)
    assert out == "released\n"  # the first scope was released before it expired
    assert time.monotonic() - start < 50
    assert len(said) == 1 and f"killing pid {child.pid} with signal 9" in said[0], said
    assert not os.path.exists(fifo)


def test_requests_it_refuses_and_a_path_that_is_not_a_fifo(tmp_path: object) -> None:
    fifo = os.path.join(str(tmp_path), "timer")
    said: list[str] = []
    timers = _timers(fifo, said)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        past = time.time() - 1
        lines: list[str] = [
            "not json",
            json.dumps({"pid": 0, "scope_id": "group", "expiration_time": past, "signal": 9}),
            json.dumps({"pid": -1, "scope_id": "all", "expiration_time": past, "signal": 9}),
            json.dumps({"pid": os.getpid(), "scope_id": "agent", "expiration_time": past,
                        "signal": 9}),
            json.dumps({"pid": sleeper.pid, "scope_id": "nokill", "expiration_time": past,
                        "signal": 0}),
            json.dumps({"pid": sleeper.pid, "scope_id": "x" * 10, "expiration_time": past,
                        "signal": 999}),
        ]
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            for line in lines:
                os.write(fd, line.encode() + b"\n")
        finally:
            os.close(fd)
        deadline = time.monotonic() + 10
        while not any("agent" in s for s in said) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert sleeper.poll() is None, said  # signal 0 (torch's "do not kill"), 999 refused
        assert len(said) == 1 and "scope 'agent' expired for pid" in said[0], said
    finally:
        sleeper.kill()
        sleeper.wait(10)
        timers.close()
    with open(fifo, "w") as f:
        f.write("a regular file")
    with pytest.raises(ValueError, match="exists and is not a FIFO"):
        _timers(fifo, said)
    assert FileTimerSettings.from_env({"TORCHELASTIC_ENABLE_FILE_TIMER": "true"}).warning
    assert not FileTimerSettings.from_env({"TORCHELASTIC_ENABLE_FILE_TIMER": "true"}).enabled
