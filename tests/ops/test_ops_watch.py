"""``elasticstore status --watch``: a live table on a terminal (``rich``, through a real pty),
plain text to a pipe, a store that goes away mid-watch; and a dead etcd endpoint: one line, exit
1, within the timeout."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from agent_nodes import free_port

from elasticstore import Store, StoreServer

NODES = ["127.0.0.2-10-0", "127.0.0.3-11-0"]


def record_round(server: StoreServer) -> None:
    """A round of 2 members and their status records, as agents write them."""
    with Store(server.host, server.port) as st:
        st.set("rdzv/j/ctl/round", json.dumps({"schema": 1, "round": 2, "participants": NODES,
                                               "standby": []}))
        st.set("rdzv/j/alive/" + NODES[0], "x")
        for rank, node in enumerate(NODES):
            st.set(f"status/j/node/{node}", json.dumps(
                {"node": node, "addr": node[:9], "state": "running", "round": 2,
                 "local_workers": 2, "formed_at": 1.0e9, "rendezvous_seconds": 0.5}))


def watch_cmd(server: StoreServer) -> list[str]:
    return [sys.executable, "-m", "elasticstore.cli", "status", "--addr", server.address,
            "--rdzv-id", "j", "--watch", "--interval", "0.2", "--timeout", "2"]


def read_until(fd: int, done: Any, timeout: float) -> str:
    text, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline and not done(text.decode(errors="replace")):
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the pty closed: the process exited
                break
            if not chunk:
                break
            text += chunk
    return text.decode(errors="replace")


def test_watch_on_a_terminal_draws_a_live_table() -> None:
    pytest.importorskip("rich")
    with StoreServer("127.0.0.2", 0) as server:
        record_round(server)
        master, slave = pty.openpty()
        proc = subprocess.Popen(watch_cmd(server), stdin=slave, stdout=slave, stderr=slave,
                                start_new_session=True, close_fds=True)
        os.close(slave)
        try:
            text = read_until(master, lambda t: t.count("127.0.0.3-11-0") >= 2, 60)
            assert text.count("127.0.0.3-11-0") >= 2, text  # drawn, then redrawn
            assert "round 2: 2 node(s), 4 worker(s)" in text and "(lost)" in text
            assert "RANK" in text and "\x1b[2J" not in text  # rich's live view, not a cleared screen
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
            os.close(master)


def test_watch_goes_on_when_the_store_goes_away() -> None:
    server = StoreServer("127.0.0.2", 0)
    try:
        record_round(server)
        proc = subprocess.Popen(watch_cmd(server), stdout=subprocess.PIPE, start_new_session=True)
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        try:
            text = read_until(fd, lambda t: "127.0.0.3-11-0" in t, 60)
            assert "127.0.0.3-11-0" in text and "\x1b[2J" not in text, text  # plain, to a pipe
            server.close()
            text = read_until(fd, lambda t: "(retrying)" in t, 30)
            assert "the store did not answer" in text and "(retrying)" in text, text
            assert proc.poll() is None
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
            proc.stdout.close()
    finally:
        server.close()


def test_dead_etcd_endpoint_one_line_exit_1() -> None:
    pytest.importorskip("etcd3")
    port = free_port()
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "elasticstore.cli", "status", "--rdzv-backend",
                          "etcd", "--rdzv-endpoint", f"127.0.0.2:{port}", "--rdzv-id", "job",
                          "--timeout", "2"], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("elasticstore: ")
    assert took < 2 + 15  # interpreter and torch import on a loaded machine
