"""The replica transfer's wire: one TCP connection per transfer, from the sending agent to the
receiving agent (``receiver.py``), every size and wait bounded.

::

    receiver -> sender   PREAMBLE | nonce (32 random bytes)
    sender -> receiver   frame {"sender": id, "mac": hex, "step": S, "sizes": [bytes, ...],
                                "attempt": round written in (-1: before), "keep": step (-1)}
    receiver -> sender   frame {"ok": true} (or {"ok": false, "error": why}: nothing sent)
    sender -> receiver   the files' bytes, one after the other
    receiver -> sender   frame {"received": true} once it has read every byte
    sender -> receiver   frame {"commit": bool} (false: a file changed while it was read)
    receiver -> sender   frame {"ok": true} once the files are in place (or an error)

The sender checks its files only after ``received``: ``sendfile`` hands the file's pages to the
socket, and the bytes the receiver reads are the pages' contents when it reads them, so a file
rewritten after ``sendfile`` returned would otherwise arrive rewritten and be committed.

A frame is a 4-byte little-endian length and that many bytes of a JSON object. With the run's
token, ``mac`` is HMAC-SHA256(token, ``CONTEXT`` + nonce): the sender proves the token without
sending it, and a recorded transfer cannot be replayed (a fresh nonce each time). Without a token
the receiver takes transfers from the address of its ring predecessor only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import time
from typing import Any

from torch.distributed import DistNetworkError

__all__ = ["CONTEXT", "NONCE_BYTES", "PREAMBLE", "ReplicaError", "deadline_for", "mac",
           "recv_exact", "recv_frame", "send_frame"]

PREAMBLE = b"ESREPL\x00\x01"
NONCE_BYTES = 32
CONTEXT = b"elasticstore replica sender\x00"
MAX_FRAME_BYTES = 64 * 1024  # a header lists at most MAX_FILES sizes
MAX_FILES = 1024  # files of one step on one node (its local ranks)
MAX_FILE_BYTES = 1 << 40  # one snapshot file
IDLE_S = 30.0  # a peer silent this long mid-transfer is given up
BASE_S = 30.0  # a transfer's time limit: BASE_S plus its bytes at MIN_RATE
MIN_RATE = 20e6  # bytes/s
CHUNK = 1 << 20
_LEN = struct.Struct("<I")


class ReplicaError(DistNetworkError):
    """A replica transfer refused or broken (a ``torch.distributed.DistNetworkError``)."""


def mac(token: str, nonce: bytes) -> str:
    return hmac.new(token.encode(), CONTEXT + nonce, hashlib.sha256).hexdigest()


def deadline_for(total: int) -> float:
    """The monotonic time by which a transfer of ``total`` bytes must have ended."""
    return time.monotonic() + BASE_S + total / MIN_RATE


def _wait(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ReplicaError("the replica transfer ran past its time limit")
    sock.settimeout(min(left, IDLE_S))


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        _wait(sock, deadline)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ReplicaError(f"the peer closed the connection ({got} of {n} bytes read)")
        got += k
    return bytes(buf)


def send_frame(sock: socket.socket, obj: dict[str, Any], deadline: float) -> None:
    data = json.dumps(obj).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise ReplicaError(f"a replica frame of {len(data)} bytes (limit {MAX_FRAME_BYTES})")
    _wait(sock, deadline)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket, deadline: float) -> dict[str, Any]:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
    if n > MAX_FRAME_BYTES:
        raise ReplicaError(f"a replica frame of {n} bytes (limit {MAX_FRAME_BYTES})")
    try:
        obj = json.loads(recv_exact(sock, n, deadline))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ReplicaError(f"a replica frame that is not JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ReplicaError(f"a replica frame that is not an object: {type(obj).__name__}")
    return obj
