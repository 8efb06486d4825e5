"""The limit for a Python client: one raw TCP round trip per call, no store behind it.

The C++ ping-pong (pingpong.py) is the physical limit of a round trip. A store client driven
from Python pays more than that on every call: the interpreter, the call into the client, the
socket calls. This peer measures the least of that: a Python object whose every store method
is one ``sendall`` of 32 bytes and one ``recv`` of the echo from tcp_pingpong's echo server (a
thread per connection, blocking sockets, in its own process). No store work happens anywhere, so
its rows are the ceiling for throughput and the floor for a connect storm that Python client
processes on this machine can reach, whatever the store; the stores' rows are read against it.

Values are kept in the client (``get`` returns what this client set), only so that the report's
probe and workloads run unchanged; no value crosses the wire.
"""

from __future__ import annotations

import socket
from typing import Iterable, Optional

import pingpong
from procs import ServerProc, start_server_process

MESSAGE = b"p" * 32

SKIPS = {
    "barrier": "python ping-pong: no barrier (an echo server cannot hold one); its storm row is "
               "connect + one round trip, the least any store's connect + barrier can cost",
    "memory": "python ping-pong: an echo server, not a store (no memory row)",
}


def start_server() -> ServerProc:
    return start_server_process([pingpong.pingpong_binary(), "server", "--port", "0"],
                                "tcp_pingpong echo server")


def missing() -> Optional[str]:
    try:
        pingpong.pingpong_binary()
    except Exception as e:
        return f"tcp_pingpong not built: {type(e).__name__}: {e}"
    return None


class EchoClient:
    """Store-shaped calls, each exactly one round trip to the echo server."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(None)  # blocking: no poll() before each call, the least syscalls
        self._values: dict = {}

    def round_trip(self) -> None:
        self._sock.sendall(MESSAGE)
        got = 0
        while got < len(MESSAGE):
            chunk = self._sock.recv(len(MESSAGE) - got)
            if not chunk:
                raise ConnectionError("echo server closed the connection")
            got += len(chunk)

    def set(self, key: str, value: bytes) -> None:
        self.round_trip()
        self._values[key] = value

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        self.round_trip()
        return self._values.get(key, b"")

    def try_get(self, key: str) -> Optional[bytes]:
        self.round_trip()
        return self._values.get(key)

    def add(self, key: str, amount: int) -> int:
        self.round_trip()
        return amount

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self.round_trip()
        return desired

    def check(self, keys: Iterable[str]) -> bool:
        self.round_trip()
        return True

    def close(self) -> None:
        self._sock.close()

    def __del__(self) -> None:  # dropped like the stores' clients are: no ResourceWarning
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()


def connect(host: str, port: int, timeout: float) -> EchoClient:
    return EchoClient(host, port, timeout)


def round_trip_barrier(client: EchoClient, key: str, world_size: int, timeout: float) -> None:
    """Not a barrier: one round trip, the least a barrier call can cost."""
    client.round_trip()
