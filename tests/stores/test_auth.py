"""Authentication (docs/authentication.md): the token handshake against real servers and clients,
hostile handshakes on raw sockets, and torch's unauthenticated protocol under a token. The settings
(environment, command lines) are in test_auth_config.py."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

import elasticstore
from elasticstore import AuthenticationError, Store, StoreServer
from spawned import closed_by_server, wait_until

TOKEN = "s3cret-token"
SHORT = timedelta(seconds=5)
NONCE = 32
HELLO, AUTH, SET, PING = 1, 22, 2, 18
OK, UNAUTHENTICATED = 0, 6
VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)
TORCH_GET_NUM_KEYS = b"\x07"


_OPEN: list[socket.socket] = []  # raw sockets of the running test, closed after it


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("ELASTICSTORE_TOKEN", raising=False)
    monkeypatch.delenv("ELASTICSTORE_TOKEN_FILE", raising=False)
    yield
    while _OPEN:
        _OPEN.pop().close()


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with StoreServer(token=TOKEN) as srv:
        yield srv


# ---- a raw native client ------------------------------------------------------------------------


def _bytes(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def _frame(op: int, rid: int, payload: bytes) -> bytes:
    return struct.pack("<IBI", 5 + len(payload), op, rid) + payload


def _hello(nonce: bytes, rid: int = 1) -> bytes:
    return _frame(HELLO, rid, struct.pack("<I", elasticstore._C.PROTOCOL_VERSION) + _bytes(b"raw") + _bytes(nonce))


def _mac(token: str, role: str, cn: bytes, sn: bytes) -> bytes:
    label = f"elasticstore/2 {role} proof".encode() + b"\0"
    return hmac.new(token.encode(), label + cn + sn, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def _reply(sock: socket.socket) -> tuple[int, int, bytes]:
    (body,) = struct.unpack("<I", _recv_exact(sock, 4))
    rest = _recv_exact(sock, body)
    return rest[0], struct.unpack("<I", rest[1:5])[0], rest[5:]


def _connect(port: int, source: str | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    _OPEN.append(sock)
    sock.settimeout(10)
    if source:
        sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _server_nonce(sock: socket.socket, cn: bytes) -> bytes:
    sock.sendall(b"ESTO" + _hello(cn))
    status, _, payload = _reply(sock)
    assert status == OK
    (n,) = struct.unpack("<I", payload[12:16])
    assert n == NONCE
    return payload[16 : 16 + NONCE]


# ---- native clients -----------------------------------------------------------------------------


def test_right_token_connects_and_clones(server: StoreServer) -> None:
    with Store(server.host, server.port, token=TOKEN, timeout=SHORT) as store:
        store.set("k", "v")
        assert store.clone().get("k") == b"v"  # the clone authenticates too


@pytest.mark.parametrize(
    ("token", "cause"),
    [("wrong", "wrong token"), ("", "requires a token and the client has none")],
    ids=["wrong-token", "no-token"],
)
def test_refused_client_gets_a_clear_error_and_touches_nothing(
    server: StoreServer, token: str, cause: str, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(AuthenticationError, match=cause) as info:
        Store(server.host, server.port, token=token, timeout=SHORT)
    assert isinstance(info.value, dist.DistStoreError)
    assert f"{server.host}:{server.port}" in str(info.value)
    assert server.stats()["keys"] == 0
    wait_until(lambda: server.stats()["connections"] == 0, 10, "the refused connection to close")
    # The server logged why it closed: its loop writes the line just after the refusal went out,
    # so the client may have it (and the test be here) first.
    err: list[str] = []
    wait_until(lambda: err.append(capfd.readouterr().err) or "authentication failed" in "".join(err),
               10, "the server's log line saying why it closed the connection")


def test_client_with_token_refuses_a_server_without_one() -> None:
    with StoreServer(token="") as srv:
        with pytest.raises(AuthenticationError, match="has a token but this server has none"):
            Store(srv.host, srv.port, token=TOKEN, timeout=SHORT)
        with Store(srv.host, srv.port, token="", timeout=SHORT) as store:
            store.set("k", "v")


def _fake_server(answer_auth: bool) -> tuple[socket.socket, threading.Thread]:
    """A server that answers HELLO with a nonce and AUTH with a proof made without the token
    (answer_auth), or answers HELLO as a server without authentication."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            try:
                _recv_exact(conn, 4)
                (body,) = struct.unpack("<I", _recv_exact(conn, 4))
                hello = _recv_exact(conn, body)
                rid = struct.unpack("<I", hello[1:5])[0]
                nonce = os.urandom(NONCE) if answer_auth else b""
                payload = struct.pack("<IQ", elasticstore._C.PROTOCOL_VERSION, 1) + _bytes(nonce)
                conn.sendall(struct.pack("<IBI", 5 + len(payload), OK, rid) + payload)
                if answer_auth:
                    (body,) = struct.unpack("<I", _recv_exact(conn, 4))
                    auth = _recv_exact(conn, body)
                    rid = struct.unpack("<I", auth[1:5])[0]
                    payload = _bytes(os.urandom(32))
                    conn.sendall(struct.pack("<IBI", 5 + len(payload), OK, rid) + payload)
                conn.recv(1)  # until the client closes
            except (OSError, EOFError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize(
    ("answer_auth", "cause"),
    [(True, "could not prove it holds the token"), (False, "server does not authenticate")],
    ids=["forged-proof", "no-auth-offered"],
)
def test_client_refuses_a_server_that_cannot_prove_the_token(answer_auth: bool, cause: str) -> None:
    listener, thread = _fake_server(answer_auth)
    with listener:
        port = listener.getsockname()[1]
        with pytest.raises(AuthenticationError, match=cause):
            Store("127.0.0.1", port, token=TOKEN, timeout=SHORT)
        thread.join(10)


# ---- hostile handshakes on raw sockets ----------------------------------------------------------


def test_raw_handshake_with_the_right_token_serves(server: StoreServer) -> None:
    sock = _connect(server.port)
    cn = os.urandom(NONCE)
    sn = _server_nonce(sock, cn)
    sock.sendall(_frame(AUTH, 2, _bytes(_mac(TOKEN, "client", cn, sn))))
    status, rid, payload = _reply(sock)
    assert (status, rid) == (OK, 2)
    assert payload[4:] == _mac(TOKEN, "server", cn, sn)  # the server's proof
    sock.sendall(_frame(PING, 3, struct.pack("<Q", 7)))
    assert _reply(sock) == (OK, 3, struct.pack("<Q", 7))
    sock.close()


def test_wrong_mac_is_refused_andclosed_by_server(server: StoreServer) -> None:
    sock = _connect(server.port)
    cn = os.urandom(NONCE)
    sn = _server_nonce(sock, cn)
    sock.sendall(_frame(AUTH, 2, _bytes(_mac("not-the-token", "client", cn, sn))))
    status, _, payload = _reply(sock)
    assert status == UNAUTHENTICATED and b"wrong token" in payload
    assert closed_by_server(sock)


def test_replayed_handshake_is_refused(server: StoreServer) -> None:
    # A recorded, successful handshake...
    first = _connect(server.port)
    cn = os.urandom(NONCE)
    sn = _server_nonce(first, cn)
    recorded_auth = _frame(AUTH, 2, _bytes(_mac(TOKEN, "client", cn, sn)))
    first.sendall(recorded_auth)
    assert _reply(first)[0] == OK
    first.close()
    # ... replayed byte for byte: the server's fresh nonce makes the recorded proof worthless.
    replay = _connect(server.port)
    sn2 = _server_nonce(replay, cn)
    assert sn2 != sn
    replay.sendall(recorded_auth)
    assert _reply(replay)[0] == UNAUTHENTICATED
    assert closed_by_server(replay)


def test_server_proof_is_not_a_client_proof(server: StoreServer) -> None:
    """Reflection: the server's own proof sent back as the client's is refused."""
    sock = _connect(server.port)
    cn = os.urandom(NONCE)
    sn = _server_nonce(sock, cn)
    sock.sendall(_frame(AUTH, 2, _bytes(_mac(TOKEN, "server", cn, sn))))
    assert _reply(sock)[0] == UNAUTHENTICATED
    assert closed_by_server(sock)


@pytest.mark.parametrize(
    "payload",
    [
        b"ESTO" + _hello(b"")[:9],  # truncated HELLO, then the client closes
        b"ESTO" + _hello(os.urandom(16)),  # a nonce of the wrong size
        b"ESTO" + _hello(os.urandom(NONCE)) + _frame(SET, 2, _bytes(b"k") + _bytes(b"v") + b"\0"),
        b"ESTO" + struct.pack("<IBI", 1 << 20, HELLO, 1),  # a huge handshake frame
    ],
    ids=["truncated", "short-nonce", "set-before-auth", "huge-hello"],
)
def test_bad_handshakes_close_and_touch_nothing(server: StoreServer, payload: bytes) -> None:
    sock = _connect(server.port)
    sock.sendall(payload)
    if payload.endswith(_hello(b"")[:9]):
        sock.shutdown(socket.SHUT_WR)
    assert closed_by_server(sock)
    sock.close()
    assert server.stats()["keys"] == 0
    with Store(server.host, server.port, token=TOKEN, timeout=SHORT) as store:
        assert store.try_get("k") is None


@pytest.mark.parametrize("mac_size", [0, 16, 33])
def test_malformed_auth_closes_without_a_reply(
    server: StoreServer, mac_size: int, capfd: pytest.CaptureFixture[str]
) -> None:
    """An AUTH whose MAC is not 32 bytes is malformed: the connection closes with no reply (a
    logged reason), it is not answered as a wrong token."""
    sock = _connect(server.port)
    _server_nonce(sock, os.urandom(NONCE))
    sock.sendall(_frame(AUTH, 2, _bytes(os.urandom(mac_size))))
    sock.settimeout(10)
    assert sock.recv(65536) == b""  # closed, and nothing was sent before the close
    sock.close()
    err: list[str] = []
    wait_until(lambda: err.append(capfd.readouterr().err) or "opcode AUTH" in "".join(err), 10,
               "the logged reason")
    assert "malformed frame (opcode AUTH)" in "".join(err)


# ---- torch's TCPStore protocol under a token ----------------------------------------------------


def _torch_served(port: int, source: str | None = None) -> bool:
    sock = _connect(port, source)
    try:
        sock.sendall(VALIDATE + TORCH_GET_NUM_KEYS)
        try:
            return len(_recv_exact(sock, 8)) == 8
        except (EOFError, ConnectionResetError):
            return False
    finally:
        sock.close()


def test_torch_client_from_loopback_is_served(server: StoreServer) -> None:
    torch_client = dist.TCPStore(server.host, server.port, is_master=False, timeout=SHORT)
    torch_client.set("t", "1")
    with Store(server.host, server.port, token=TOKEN, timeout=SHORT) as store:
        assert store.get("t") == b"1"


def test_torch_client_not_vouched_for_is_refused(capfd: pytest.CaptureFixture[str]) -> None:
    # Loopback stands for "this machine" by default; the test turns that off so that its
    # 127.0.0.x source addresses stand for other hosts.
    with StoreServer(token=TOKEN, allow_loopback=False) as srv:
        with pytest.raises(Exception):  # noqa: B017 (torch raises DistNetworkError or RuntimeError)
            dist.TCPStore(srv.host, srv.port, is_master=False, timeout=timedelta(seconds=2))
        assert "torch TCPStore client refused" in capfd.readouterr().err
        srv.allow_peer("127.0.0.1")
        assert srv.allowed_peers() == ["127.0.0.1/32"]
        torch_client = dist.TCPStore(srv.host, srv.port, is_master=False, timeout=SHORT)
        torch_client.set("t", "1")
        assert not _torch_served(srv.port, source="127.0.0.2")
        srv.set_allowed_peers([])
        assert not _torch_served(srv.port)


def test_operator_ranges_and_allow_peers_request() -> None:
    with StoreServer(
        token=TOKEN, allow_loopback=False, allow_unauthenticated_from=["127.0.0.1/32"]
    ) as srv:
        assert _torch_served(srv.port, source="127.0.0.1")
        assert not _torch_served(srv.port, source="127.0.0.2")
        with Store(srv.host, srv.port, token=TOKEN, timeout=SHORT) as store:
            store.allow_peers(["127.0.0.2"])  # the rendezvous vouching for a round's member
            with pytest.raises(elasticstore.StoreError, match="ALLOW_PEERS"):
                store.allow_peers(["not-an-address"])
        assert _torch_served(srv.port, source="127.0.0.2")
        assert not _torch_served(srv.port, source="127.0.0.3")
    with StoreServer(token=TOKEN, allow_loopback=False, allow_unauthenticated_from=["::ffff:127.0.0.0/120"]) as srv:
        assert _torch_served(srv.port, source="127.0.0.3")  # IPv4-mapped ranges match IPv4 peers


def test_without_token_torch_is_served_from_anywhere() -> None:
    with StoreServer(token="", allow_loopback=False) as srv:
        assert _torch_served(srv.port, source="127.0.0.2")


def test_bad_ranges_are_refused() -> None:
    with pytest.raises(ValueError, match="allow_unauthenticated_from"):
        StoreServer(token=TOKEN, allow_unauthenticated_from=["10.0.0.0/33"])
    with StoreServer(token=TOKEN) as srv, pytest.raises(ValueError):
        srv.allow_peer("example.com")


def test_non_loopback_bind_without_token_warns_once(capfd: pytest.CaptureFixture[str]) -> None:
    with StoreServer(host="0.0.0.0", token=""):
        pass
    err = capfd.readouterr().err
    assert err.count("without a token") == 1, err
    assert "anyone who can reach this port can read and write every key" in err
    with StoreServer(host="0.0.0.0", token=TOKEN), StoreServer(host="127.0.0.1", token=""):
        pass
    assert "without a token" not in capfd.readouterr().err


@pytest.mark.parametrize(
    ("token", "version", "status", "message"),
    [
        ("", 1, OK, b""),  # protocol 1 (no authentication) still served without a token
        (TOKEN, 1, UNAUTHENTICATED, b"protocol version 1 cannot carry one"),
        ("", 99, 2, b"unsupported protocol version 99"),
    ],
    ids=["v1-no-token", "v1-token", "v99"],
)
def test_protocol_versions(token: str, version: int, status: int, message: bytes) -> None:
    with StoreServer(token=token) as srv:
        sock = _connect(srv.port)
        sock.sendall(b"ESTO" + _frame(HELLO, 1, struct.pack("<I", version) + _bytes(b"old")))
        got, _, payload = _reply(sock)
        assert got == status and message in payload
        if status == OK:
            assert len(payload) == 12  # u32 version, u64 session: the version 1 reply
