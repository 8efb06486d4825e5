"""A connection storm at the server: clients whose handshake is already buffered when they are
accepted are served, however many arrived at once from one address; the per-address bound on
connections that have not finished their handshake (kMaxHalfOpenPerPeer) still closes silent ones.

The storm is made deterministic by stopping the server (SIGSTOP) while the clients connect and
send their handshake: the kernel completes the connections into the listen backlog, and the
server finds them all there at once when it continues, as under a real storm it finds more
connections queued than it has read."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import struct
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator

import pytest
import spawned

MAX_HALF_OPEN_PER_PEER = 1_024  # kMaxHalfOpenPerPeer
PROMPT = MAX_HALF_OPEN_PER_PEER + 76  # clients sending their handshake at once, from one address
SILENT = MAX_HALF_OPEN_PER_PEER + 76  # then as many connections that never send a byte
HELLO, STATS, OK = 1, 21, 0
TS_VALIDATE_MAGIC, TS_PING = 0x3C85F7CE, 13
REPLY_TIMEOUT_S = 20.0


def _binary() -> str:
    override = os.environ.get("ELASTICSTORE_SERVER_BINARY")
    return override or os.path.join(sysconfig.get_path("scripts"), "elasticstore-server")


def _frame(opcode: int, payload: bytes = b"") -> bytes:
    body = struct.pack("<BI", opcode, 1) + payload
    return struct.pack("<I", len(body)) + body


def _hello() -> bytes:
    # HELLO version 2, client name, empty nonce (no token)
    return b"ESTO" + _frame(HELLO, struct.pack("<I", 2) + struct.pack("<I", 5) + b"storm" +
                            struct.pack("<I", 0))


def _torch_handshake(nonce: int) -> bytes:
    # torch's TCPStore client: VALIDATE magic, then PING nonce (answered with the nonce)
    return struct.pack("<BI", 0, TS_VALIDATE_MAGIC) + struct.pack("<BI", TS_PING, nonce)


def _exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed by the server")
        buf += chunk
    return buf


def _handshake_answered(s: socket.socket, protocol: str, nonce: int) -> bool:
    try:
        if protocol == "torch":
            return bool(struct.unpack("<I", _exact(s, 4))[0] == nonce)
        (body,) = struct.unpack("<I", _exact(s, 4))
        return _exact(s, body)[0] == OK
    except OSError:  # reset, closed, or no answer in time
        return False


def _stats(port: int) -> dict[str, int]:
    # from another address than the storm's, so that this connection changes nothing it counts
    with socket.socket() as s:
        s.settimeout(REPLY_TIMEOUT_S)
        s.bind(("127.0.0.2", 0))
        s.connect(("127.0.0.1", port))
        s.sendall(_hello())
        (body,) = struct.unpack("<I", _exact(s, 4))
        assert _exact(s, body)[0] == OK
        s.sendall(_frame(STATS))
        (body,) = struct.unpack("<I", _exact(s, 4))
        rest = _exact(s, body)[5:]
    (n,), off, out = struct.unpack_from("<I", rest), 4, {}
    for _ in range(n):
        (ln,) = struct.unpack_from("<I", rest, off)
        name = rest[off + 4: off + 4 + ln].decode()
        (out[name],) = struct.unpack_from("<Q", rest, off + 4 + ln)
        off += 12 + ln
    return out


@contextlib.contextmanager
def _server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([_binary(), "--host", "127.0.0.1", "--port", "0"],
                                stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("elasticstore server listening on "), line
            yield proc, int(line.strip().rsplit(":", 1)[1])
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            spawned.kill_all([proc])


@pytest.fixture
def fd_room() -> Iterator[None]:
    """This process holds PROMPT + SILENT sockets: its soft open-file limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = PROMPT + SILENT + 256
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"open-file hard limit {hard} < {need}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("protocol", ["native", "torch"])
def test_buffered_handshakes_are_served_and_silent_connections_still_bounded(
    fd_room: None, protocol: str
) -> None:
    """1,100 clients from one address connect and send their handshake while the server is
    stopped, then 1,100 connections that send nothing: every client is answered (none reset to
    make room), and the silent ones are held to kMaxHalfOpenPerPeer, the oldest closed."""
    socks: list[socket.socket] = []
    with _server() as (proc, port):
        try:
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                for i in range(PROMPT + SILENT):
                    s = socket.socket()
                    socks.append(s)
                    s.settimeout(REPLY_TIMEOUT_S)
                    s.connect(("127.0.0.1", port))  # completed by the kernel into the backlog
                    if i < PROMPT:
                        s.sendall(_hello() if protocol == "native" else _torch_handshake(i))
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            answered = sum(_handshake_answered(s, protocol, i) for i, s in enumerate(socks[:PROMPT]))
            stats = _stats(port)
            assert answered == PROMPT, (
                f"{PROMPT - answered} of {PROMPT} clients whose handshake was buffered were closed; "
                f"stats {stats}")
            assert stats["connections_half_open"] <= MAX_HALF_OPEN_PER_PEER
            assert stats["connections_shed_half_open"] >= SILENT - MAX_HALF_OPEN_PER_PEER
        finally:
            for s in socks:
                s.close()
