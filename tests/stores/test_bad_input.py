"""Malformed input through raw sockets: only that connection is closed, with a logged reason;
other clients keep working; the server's memory stays bounded."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import spawned
import pytest

from elasticstore import Store

PREAMBLE = b"ESTO"
HELLO, SET, GET, NUM_KEYS = 1, 2, 3, 10


def frame(opcode: int, request_id: int, payload: bytes = b"") -> bytes:
    body = struct.pack("<BI", opcode, request_id) + payload
    return struct.pack("<I", len(body)) + body


def blob(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def hello(request_id: int = 1) -> bytes:
    return frame(HELLO, request_id, struct.pack("<I", 1) + blob(b"raw-test"))


@dataclass
class ServerProcess:
    proc: subprocess.Popen[str]
    host: str
    port: int
    log_path: str

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def rss_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server_proc() -> Iterator[ServerProcess]:
    """``elasticstore server`` in a subprocess, its stderr (the log) in a file.

    At ``info``: malformed input is logged at ``warning``, but a peer that closes in the middle of
    a frame (not malformed, perhaps a crashed client) only at ``info``."""
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        log_path = log.name
    try:
        with open(log_path, "w") as log_file, spawned.cli_server("--log-level", "info",
                                                               stderr=log_file) as server:
            yield ServerProcess(server.proc, server.host, server.port, log_path)
    finally:
        os.unlink(log_path)


def _connect(srv: ServerProcess) -> socket.socket:
    sock = socket.create_connection((srv.host, srv.port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def test_raw_handshake_and_get(server_proc: ServerProcess) -> None:
    """The hand-encoded frames below are right: a well-formed exchange is answered."""
    with _connect(server_proc) as sock:
        sock.sendall(PREAMBLE + hello(7))
        head = sock.recv(9, socket.MSG_WAITALL)
        body_len, status, request_id = struct.unpack("<IBI", head)
        assert (status, request_id) == (0, 7)
        rest = sock.recv(body_len - 5, socket.MSG_WAITALL)
        assert struct.unpack("<I", rest[:4])[0] == 1
        sock.sendall(frame(SET, 8, blob(b"raw") + blob(b"value") + b"\x00"))
        sock.sendall(frame(GET, 9, blob(b"raw") + struct.pack("<I", 1000)))
        replies = {}
        while len(replies) < 2:
            body_len, status, request_id = struct.unpack("<IBI", sock.recv(9, socket.MSG_WAITALL))
            replies[request_id] = (status, sock.recv(body_len - 5, socket.MSG_WAITALL))
        assert replies[8][0] == 0
        assert replies[9] == (0, blob(b"value") + replies[9][1][9:])


BAD_INPUTS: dict[str, tuple[bytes, bool]] = {
    # name: (bytes sent, then half-close our side)
    "garbage": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", False),
    "wrong_preamble": (b"ESTX" + hello(), False),
    "truncated_frame_then_close": (PREAMBLE + hello() + frame(SET, 2, blob(b"k") + blob(b"v") + b"\0")[:-4], True),
    "huge_declared_length": (PREAMBLE + hello() + struct.pack("<I", 0xFFFFFFF0) + b"\x02", False),
    "unknown_opcode": (PREAMBLE + hello() + frame(200, 2), False),
    "non_hello_first_frame": (PREAMBLE + frame(SET, 1, blob(b"k") + blob(b"v") + b"\0"), False),
    "body_shorter_than_header": (PREAMBLE + hello() + struct.pack("<I", 2) + b"\x0a\x00", False),
    "bytes_left_over": (PREAMBLE + hello() + frame(NUM_KEYS, 2, b"extra"), False),
    "field_past_frame_end": (PREAMBLE + hello() + frame(GET, 2, struct.pack("<I", 0xFFFF0000)), False),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_closes_only_that_connection(server_proc: ServerProcess, name: str) -> None:
    data, half_close = BAD_INPUTS[name]
    with Store(server_proc.host, server_proc.port, timeout=timedelta(seconds=10)) as healthy:
        healthy.set("before", "1")
        with _connect(server_proc) as bad:
            peer = f":{bad.getsockname()[1]}"
            bad.sendall(data)
            if half_close:
                bad.shutdown(socket.SHUT_WR)
            assert spawned.closed_by_server(bad), f"{name}: the server kept the connection open"
        assert healthy.get("before") == b"1"
        healthy.set("after", "2")
        assert healthy.get("after") == b"2"
        spawned.wait_until(
            lambda: any(
                line.startswith("elasticstore: ") and peer in line
                for line in server_proc.log().splitlines()
            ),
            5,
            f"a log line naming the peer {peer} ({name}); log:\n{server_proc.log()}",
        )
    assert server_proc.proc.poll() is None


@pytest.mark.slow
def test_memory_stays_bounded(server_proc: ServerProcess) -> None:
    with Store(server_proc.host, server_proc.port, timeout=timedelta(seconds=10)) as healthy:
        healthy.set("k", "v")
        baseline = server_proc.rss_kib()
        partial = 256 * 1024
        open_socks: list[socket.socket] = []
        try:
            for i in range(60):
                # Half-finished frames: a 4 MiB value declared, 256 KiB of it sent, then idle.
                sock = _connect(server_proc)
                open_socks.append(sock)
                head = struct.pack("<I", 4 * 1024 * 1024 + 64) + struct.pack("<BI", SET, 2)
                sock.sendall(PREAMBLE + hello() + head + b"x" * partial)
            for i in range(60):
                sock = _connect(server_proc)
                open_socks.append(sock)
                sock.sendall(PREAMBLE + hello() + struct.pack("<I", 0xFFFFFFF0) + b"\x02\x00")
            for i in range(60):
                sock = _connect(server_proc)
                open_socks.append(sock)
                sock.sendall(os.urandom(4096))
            spawned.wait_until(
                lambda: healthy.stats()["bytes_buffered"] >= 60 * partial * 0.9,
                10,
                "the half-finished frames to be buffered",
            )
            peak = server_proc.rss_kib()
            assert healthy.get("k") == b"v"
        finally:
            for sock in open_socks:
                sock.close()
        # Generous: the 15 MiB buffered plus allocator slack, far below 60 x 4 MiB declared.
        assert (peak - baseline) < 128 * 1024, f"RSS grew by {(peak - baseline) // 1024} MiB"
        spawned.wait_until(
            lambda: healthy.stats()["bytes_buffered"] < 64 * 1024,
            10,
            "buffered bytes to be released after the sockets closed",
        )
        spawned.wait_until(
            lambda: healthy.stats()["connections"] == 1, 10, "the bad connections to close"
        )
        assert healthy.get("k") == b"v"
