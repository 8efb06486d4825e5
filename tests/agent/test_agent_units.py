"""In-process pieces of the agent: the plain fork server (exit codes, signals, its death), the
failure summary, the -r/-t parser."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
from agent_nodes import alive, assert_gone

from elasticstore.agent.failures import Failure, read_error_file, summary
from elasticstore.agent.forkclient import ForkServer, read_status
from elasticstore.agent.logs import parse_std


def _start(fs: ForkServer, cmd: str) -> tuple[int, socket.socket]:
    r, w = os.pipe()
    try:
        return fs.start(["/bin/sh", "-c", cmd], dict(os.environ), "/", "exec", w, w)
    finally:
        os.close(w)
        os.close(r)


def _status(sock: socket.socket) -> int | None:
    try:
        return read_status(sock)
    finally:
        sock.close()


def test_fork_server_reports_exits_and_kills_every_group_when_closed() -> None:
    fs = ForkServer(preload=False)
    try:
        pid, status = _start(fs, "exit 3")
        assert _status(status) == 3
        pid, status = _start(fs, "sleep 60")
        assert os.getpgid(pid) == pid  # its own process group
        os.killpg(pid, signal.SIGKILL)
        assert _status(status) == -signal.SIGKILL
        # A worker whose child outlives it: the child stays in the worker's group.
        pid, status = _start(fs, "sleep 60 & echo $! > /tmp/.es-unit-$$; wait")
        status.close()
        time.sleep(0.3)
        with open(f"/tmp/.es-unit-{pid}") as f:
            child = int(f.read())
        os.unlink(f"/tmp/.es-unit-{pid}")
        assert alive(child) and os.getpgid(child) == pid
    finally:
        fs.close()
    assert_gone([pid, child], 2.0)  # closing the control socket takes every group with it
    assert not fs.alive()


def test_fork_server_reports_a_missing_command() -> None:
    fs = ForkServer(preload=False)
    try:
        r, w = os.pipe()
        pid, status = fs.start(["/nonexistent/cmd"], {}, "/", "exec", w, w)
        os.close(w)
        assert _status(status) == 127
        assert b"cannot run" in os.read(r, 4096)
        os.close(r)
    finally:
        fs.close()


def test_error_file_and_summary_order(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "error.json")
    with open(path, "w") as f:
        json.dump({"message": {"message": "ValueError: bad", "extraInfo": {
            "py_callstack": "Traceback (most recent call last):\n  x\nValueError: bad",
            "timestamp": "1700000000"}}}, f)
    assert read_error_file(path) == ("ValueError: bad", "Traceback (most recent call last):\n  x\nValueError: bad", 1700000000.0)
    assert read_error_file(path + ".missing") is None
    late = Failure(3, 1, "10.0.0.2", 11, -9, 1700000005.0, "killed", "", None)
    first = Failure(1, 1, "10.0.0.1", 10, 1, 1700000000.0, "ValueError: bad", "Traceback...", path)
    text = summary("train.py", [late, first])
    root, others = text.split("Root Cause (first observed failure):")[1].split("Other Failures:")
    assert "rank      : 1 (local_rank: 1)" in root and "ValueError: bad" in root
    assert "exit code 1" in root and "signal SIGKILL" in others and "10.0.0.2" in others


def test_std_flag_parser() -> None:
    assert parse_std("--tee", "3", 2) == {0: 3, 1: 3}
    assert parse_std("--tee", "1:2", 3) == {0: 0, 1: 2, 2: 0}
    with pytest.raises(ValueError, match="--redirects"):
        parse_std("--redirects", "4", 1)
