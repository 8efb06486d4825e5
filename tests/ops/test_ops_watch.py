"""``elasticstore status --watch``: a live table on a terminal (``rich``, through a real pty),
plain text to a pipe, a store that goes away mid-watch, records that carry terminal escapes (shown
escaped, redraw after redraw, in both views); and a dead etcd endpoint: one line, exit 1, within
the timeout."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from agent_nodes import free_port

from elasticstore import Store, StoreServer
from elasticstore.rendezvous.state import Keys

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


@contextmanager
def watch_on_a_pty(server: Any, size: tuple[int, int] | None = None,
                   env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``status --watch`` on a pseudo-terminal (``size``: rows, columns); yields the process
    and the terminal's master end; kills the process if it is still running at the end."""
    master, slave = pty.openpty()
    if size is not None:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[0], size[1], 0, 0))
    proc = subprocess.Popen(watch_cmd(server), stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True, close_fds=True, env=env)
    os.close(slave)
    try:
        yield proc, master
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        os.close(master)


def test_watch_on_a_terminal_draws_a_live_table() -> None:
    pytest.importorskip("rich")
    with StoreServer("127.0.0.2", 0) as server:
        record_round(server)
        with watch_on_a_pty(server) as (proc, master):
            text = read_until(master, lambda t: t.count("127.0.0.3-11-0") >= 2, 60)
            assert text.count("127.0.0.3-11-0") >= 2, text  # drawn, then redrawn
            assert "round 2: 2 node(s), 4 worker(s)" in text and "(lost)" in text
            assert "RANK" in text and "\x1b[2J" not in text  # rich's live view, not a cleared screen
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(30) == 0


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


ESC, BEL = "\x1b", "\x07"
LINK = f"{ESC}]8;;http://evil.example/{BEL}click{ESC}]8;;{BEL}"  # an OSC 8 hyperlink
DEEP = "[" * 100_000 + "]" * 100_000
HOSTILE = ["127.0.0.2-10-0", "127.0.0.3-11-0", "127.0.0.4-12-0", "127.0.0.5-13-0"]


def record_hostile_round(server: StoreServer) -> None:
    """A round whose records were written by someone hostile: escapes that clear the screen,
    move the cursor, plant hyperlinks; a bare CR that overwrites a line; a newline that fakes
    one; a record nested too deep; fields of the wrong type; rank keys that are no numbers."""
    keys = Keys("j")
    with Store(server.host, server.port) as st:
        st.set(keys.round, json.dumps({"schema": 1, "round": 2, "participants": HOSTILE,
                                       "standby": [f"evil{ESC}]8;;http://x{ESC}\\"]}))
        st.set(keys.alive(HOSTILE[0]), "x")
        st.set(keys.alive(f"127.0.0.9-1-0{ESC}[2J"), "x")  # a waiting node: its key is its name
        st.set(keys.status_nodes + HOSTILE[0], json.dumps(
            {"state": f"running{ESC}[2J{ESC}[Hfake", "round": 2, "local_workers": 2,
             "addr": f"10.0.0.1{LINK}", "formed_at": 1e308, "rendezvous_seconds": "fast",
             "ranks": {"0": {"step": f"7{ESC}]8;;http://evil{ESC}\\", "step_seconds": 0.1},
                       "1": {"step": 3, "step_seconds": 0.1}, "\u00b2": {"step": 1},
                       "1" * 5000: {"step": 1}, "2": "not a rank record"}}))
        st.set(keys.status_nodes + HOSTILE[1], json.dumps(
            {"state": "unhealthy: 50%\rFORGED line", "round": 2, "host": LINK,
             "updated": "yesterday", "local_workers": 2}))
        st.set(keys.status_nodes + HOSTILE[2], json.dumps(
            {"state": 5, "round": "2", "local_workers": "many", "failure_restarts": "x",
             "ranks": [1, 2], "addr": None}))
        st.set(keys.status_nodes + HOSTILE[3], DEEP)
        st.set(keys.failure, json.dumps(
            {"rank": "1", "host": f"h{ESC}]8;;http://x{ESC}\\", "how": f"exit{BEL}",
             "exit_code": 1, "message": "boom\r\nelasticstore: job j succeeded",
             "when": 10**400}))
        st.set(keys.host, json.dumps(
            {"schema": 1, "epoch": 2, "node": f"n{ESC}[2J", "endpoint": "127.0.0.2:1\rFORGED",
             "previous": f"p{LINK}", "since": 1e308}))


# What the hostile fields become (``terminal.printable``): every control character an escape.
ESCAPED = [
    "running\\x1b[2J\\x1b[Hfake",
    "10.0.0.1\\x1b]8;;http://evil.example/\\x07click\\x1b]8;;\\x07",
    "unhealthy: 50%\\rFORGED line",
    "evil\\x1b]8;;http://x\\x1b\\\\",
    "127.0.0.9-1-0\\x1b[2J",
    "rank 0 on 127.0.0.2-10-0: step 7\\x1b]8;;http://evil\\x1b\\\\,",
    "on h\\x1b]8;;http://x\\x1b\\\\: exit\\x07",
    "boom\\r\\nelasticstore: job j succeeded",
    "store host: 127.0.0.2:1\\rFORGED (node n\\x1b[2J, epoch 2; took over from p\\x1b]8;;",
]
# The raw sequences, none of which may reach the terminal.
RAW = [f"{ESC}[2J", f"{ESC}[H", f"{ESC}]8;;", BEL, "\rFORGED", f"{ESC}\\"]


def check_hostile_view(text: str) -> None:
    for escaped in ESCAPED:
        assert escaped in text, (escaped, text)
    for raw in RAW:
        assert raw not in text, (raw, text)
    lines = text.replace("\r\n", "\n").splitlines()
    assert not any(line.lstrip().startswith("elasticstore: job") for line in lines), text
    assert "rank 1 on 127.0.0.2-10-0: step 3" in text  # the well-formed rank is still shown
    for node in HOSTILE[2:]:  # mistyped, too deep: no state, no workers
        row = next(line for line in lines if node in line and "rank " not in line)
        assert "unknown (lost)" in row, row


def test_watch_to_a_pipe_escapes_hostile_records() -> None:
    with StoreServer("127.0.0.2", 0) as server:
        record_hostile_round(server)
        proc = subprocess.Popen(watch_cmd(server), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        assert proc.stdout is not None and proc.stderr is not None
        try:
            text = read_until(proc.stdout.fileno(), lambda t: t.count("\nstore: barriers") >= 2, 60)
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(30) == 0
            err = proc.stderr.read().decode(errors="replace")
            assert text.count("job j at ") >= 2, (text, err)  # drawn twice, appended
            assert "Traceback" not in err and "did not answer" not in text, (text, err)
            for char in (ESC, BEL, "\r"):  # plain text: no control but the line ends
                assert char not in text, (char, text)
            check_hostile_view(text)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
            proc.stdout.close()
            proc.stderr.close()


def test_watch_on_a_terminal_escapes_hostile_records() -> None:
    pytest.importorskip("rich")
    with StoreServer("127.0.0.2", 0) as server:
        record_hostile_round(server)
        # Wide and tall enough that rich neither wraps nor crops a line.
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        env["TERM"] = "xterm-256color"
        with watch_on_a_pty(server, (200, 400), env) as (proc, master):
            text = read_until(master, lambda t: t.count("store host: ") >= 2, 60)
            assert text.count("store host: ") >= 2, text  # drawn, then redrawn
            assert "RANK" in text and "Traceback" not in text, text
            check_hostile_view(text)
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(30) == 0


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
