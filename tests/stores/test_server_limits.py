"""Each limit of ``elasticstore-server`` set by its flag and hit: the request past it gets an error
reply (``StoreError``) or its connection is closed with a logged reason, while other connections
are served and nothing stored is lost."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from datetime import timedelta

import spawned
import pytest
import torch.distributed as dist

from elasticstore import Store, StoreError

OP_HELLO, OP_SET, OP_GET, OP_PING = 1, 2, 3, 18
NO_TIMEOUT = 0xFFFFFFFF
TOO_LARGE = 4


def _binary() -> str:
    path = os.path.join(sysconfig.get_path("scripts"), "elasticstore-server")
    assert os.access(path, os.X_OK), f"{path} is not installed with the package"
    return path


class Daemon:
    def __init__(self, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [_binary(), "--host", "127.0.0.1", "--port", "0", "--log-level", "info", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("elasticstore server listening on 127.0.0.1:"), line
        self.port = int(line.strip().rsplit(":", 1)[1])

    def store(self) -> Store:
        return Store("127.0.0.1", self.port, timeout=timedelta(seconds=10))

    def stop(self) -> str:
        """Stops the server (SIGTERM, exit 0) and returns its log."""
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, err
        return err


@pytest.fixture
def daemon_factory() -> Iterator[type[Daemon]]:
    started: list[Daemon] = []

    class Tracked(Daemon):
        def __init__(self, *flags: str) -> None:
            super().__init__(*flags)
            started.append(self)

    yield Tracked
    spawned.kill_all([d.proc for d in started])


# ---- raw native frames --------------------------------------------------------------------------
def _bytes(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def frame(op: int, rid: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IBI", 5 + len(payload), op, rid) + payload


def get_frame(rid: int, key: bytes, timeout: int = NO_TIMEOUT) -> bytes:
    return frame(OP_GET, rid, _bytes(key) + struct.pack("<I", timeout))


def raw(port: int, greet: bool = True) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if greet:
        s.sendall(b"ESTO" + frame(OP_HELLO, 1, struct.pack("<I", 1) + _bytes(b"raw")))
        status, rid, _ = read_frame(s)
        assert (status, rid) == (0, 1)
    return s


def read_frame(s: socket.socket) -> tuple[int, int, bytes]:
    def exact(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = s.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out

    (body,) = struct.unpack("<I", exact(4))
    rest = exact(body)
    return rest[0], struct.unpack("<I", rest[1:5])[0], rest[5:]


def closed_by_server(s: socket.socket, within: float = 10.0) -> bool:
    s.settimeout(within)
    try:
        while True:
            if not s.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def wait_stat(store: Store, name: str, value: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while store.stats()[name] != value and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stats()[name] == value


# ---- flags ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--max-key-bytes", "8193", "8192"),
        ("--max-value-bytes", "0", "1..8388608"),
        ("--max-keys-per-request", "x", "a count"),
        ("--max-connection-buffer-bytes", "1000", "1048576"),
        ("--max-connections-per-peer", "0", ">= 1"),
        ("--max-stored-keys", "-1", ">= 1"),
        ("--handshake-timeout-ms", "0", "milliseconds"),
        ("--keepalive-idle-ms", "500", "whole number of seconds"),
        ("--keepalive-interval-ms", "-1000", "0 (off)"),
        ("--keepalive-idle-ms", "40000000", "1000..32767000"),
        ("--keepalive-count", "128", "1..127"),
    ],
)
def test_a_bad_limit_value_names_the_flag(flag: str, value: str, why: str) -> None:
    done = subprocess.run([_binary(), flag, value], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert f"argument {flag}: {value} is not" in done.stderr and why in done.stderr


def test_help_lists_every_limit_flag() -> None:
    out = subprocess.run([_binary(), "--help"], capture_output=True, text=True, timeout=30).stdout
    for flag in ("--max-connections-per-peer", "--max-key-bytes", "--max-value-bytes",
                 "--max-keys-per-request", "--max-connection-buffer-bytes", "--max-buffered-bytes",
                 "--max-waiters-per-connection", "--max-stored-keys", "--max-stored-bytes",
                 "--frame-timeout-ms", "--handshake-timeout-ms", "--keepalive-idle-ms",
                 "--keepalive-interval-ms", "--keepalive-count"):
        assert flag in out


# ---- limits hit ---------------------------------------------------------------------------------
def test_key_value_and_count_limits(daemon_factory: type[Daemon]) -> None:
    d = daemon_factory("--max-key-bytes", "32", "--max-value-bytes", "1000",
                       "--max-keys-per-request", "3")
    with d.store() as store:
        store.set("k" * 32, b"v" * 1000)
        with pytest.raises(StoreError, match="key of 33 over the limit of 32"):
            store.set("k" * 33, b"v")
        with pytest.raises(StoreError, match="value of 1001 over the limit of 1000"):
            store.set("k", b"v" * 1001)
        with pytest.raises(StoreError, match="key count of 4 over the limit of 3"):
            store.multi_get(["a", "b", "c", "d"])
        with pytest.raises(StoreError, match="exceed 1000 bytes"):
            store.append("k" * 32, b"x")
        assert store.get("k" * 32) == b"v" * 1000  # the same connection, nothing lost
    d.stop()


def test_stored_keys_and_bytes_quota(daemon_factory: type[Daemon]) -> None:
    d = daemon_factory("--max-stored-keys", "10", "--max-stored-bytes", "4096")
    with d.store() as store, d.store() as other:
        for i in range(10):
            store.set(f"k{i}", b"v")
        with pytest.raises(StoreError, match="store full.*max_stored_keys"):
            store.set("k10", b"v")
        with pytest.raises(StoreError, match="store full"):
            other.queue_push("q", b"item")
        with pytest.raises(StoreError, match="store full"):
            other.add("counter", 1)
        store.set("k0", b"x" * 3000)  # replacing is no new key
        with pytest.raises(StoreError, match="store full.*max_stored_bytes"):
            other.set("k1", b"y" * 2000)
        store.delete_key("k9")
        other.add("counter", 5)
        assert store.get("counter") == b"5"
        assert store.get("k0") == b"x" * 3000
        assert [store.get(f"k{i}") for i in range(1, 9)] == [b"v"] * 8
        # torch's protocol has no error reply: its write past the quota closes its connection.
        torch_client = dist.TCPStore("127.0.0.1", d.port, is_master=False,
                                     wait_for_workers=False, timeout=timedelta(seconds=10))
        with pytest.raises(Exception):
            torch_client.set("another", "v")
            torch_client.get("k1")
        del torch_client
        assert store.num_keys() == 10 and store.get("k1") == b"v"
    assert "store full" in d.stop()


def test_connections_per_peer(daemon_factory: type[Daemon]) -> None:
    d = daemon_factory("--max-connections-per-peer", "3")
    with d.store() as store:
        a, b = raw(d.port), raw(d.port)
        c = raw(d.port, greet=False)
        assert closed_by_server(c)
        c.close()
        a.sendall(frame(OP_PING, 7, struct.pack("<Q", 1)))
        assert read_frame(a)[:2] == (0, 7)
        assert store.stats()["connections_refused"] == 1
        b.close()
        wait_stat(store, "connections", 2)
        e = raw(d.port)  # the count follows closes
        e.close()
        a.close()
        store.set("still", b"here")
    assert "max_connections_per_peer" in d.stop()


def test_waiters_per_connection(daemon_factory: type[Daemon]) -> None:
    d = daemon_factory("--max-waiters-per-connection", "4")
    with d.store() as store:
        s = raw(d.port)
        s.sendall(b"".join(get_frame(10 + i, b"w%d" % i) for i in range(5)))
        status, rid, payload = read_frame(s)
        assert (status, rid) == (TOO_LARGE, 14) and b"max_waiters_per_connection" in payload
        store.set("w0", b"1")
        assert read_frame(s)[:2] == (0, 10)  # the parked ones still complete
        s.close()


def test_handshake_and_frame_timeouts(daemon_factory: type[Daemon]) -> None:
    d = daemon_factory("--handshake-timeout-ms", "200", "--frame-timeout-ms", "200")
    with d.store() as store:
        silent = raw(d.port, greet=False)
        half = raw(d.port, greet=False)
        half.sendall(b"ES")
        slow = raw(d.port)
        slow.sendall(frame(OP_PING, 2, struct.pack("<Q", 1))[:7])  # slowloris: a partial frame
        t0 = time.monotonic()
        assert closed_by_server(silent) and closed_by_server(half) and closed_by_server(slow)
        assert time.monotonic() - t0 < 5
        for s in (silent, half, slow):
            s.close()
        time.sleep(0.4)
        store.set("k", b"v")  # an idle greeted connection outlives both timeouts
        assert store.get("k") == b"v"
    log = d.stop()
    assert "handshake not finished within 200 ms" in log
    assert "request not finished within 200 ms" in log


@pytest.mark.parametrize("flag", ["--max-connection-buffer-bytes", "--max-buffered-bytes"])
def test_buffer_limits_close_a_connection_that_does_not_read(
    daemon_factory: type[Daemon], flag: str
) -> None:
    d = daemon_factory(flag, str(2 * 1024 * 1024))
    with d.store() as store:
        sleeper = raw(d.port)
        sleeper.sendall(b"".join(get_frame(10 + i, b"big") for i in range(24)))
        wait_stat(store, "waiters", 24)
        store.set("big", b"x" * (1024 * 1024))  # 24 MiB of replies for a peer that reads none
        assert closed_by_server(sleeper)
        sleeper.close()
        assert len(store.get("big")) == 1024 * 1024
        assert store.stats()["bytes_buffered"] < 2 * 1024 * 1024
    log = d.stop()
    assert "closing connection" in log


# ---- the same limits through StoreServer and `elasticstore server` ------------------------------
def test_store_server_takes_the_limits() -> None:
    from elasticstore import ServerLimits, StoreServer

    limits = ServerLimits(max_key_bytes=16, max_stored_keys=2)
    with StoreServer(limits=limits) as server:
        assert server.config.limits == limits
        with Store(server.host, server.port, timeout=timedelta(seconds=10)) as store:
            with pytest.raises(StoreError, match="over the limit of 16"):
                store.set("k" * 17, "v")
            store.set("a", "1")
            store.set("b", "2")
            with pytest.raises(StoreError, match="max_stored_keys"):
                store.set("c", "3")
            assert store.multi_get(["a", "b"]) == [b"1", b"2"]  # nothing stored was lost
    with pytest.raises(ValueError, match="max_key_bytes"):
        StoreServer(limits=ServerLimits(max_key_bytes=10**6))  # over the protocol's ceiling
    with pytest.raises(ValueError, match="max_stored_keys"):
        ServerLimits(max_stored_keys=0)
    for bad, match in (({"keepalive_interval_ms": 500}, "keepalive_interval_ms.*whole number of seconds"),
                       ({"keepalive_idle_ms": 32_768_000}, "keepalive_idle_ms"),
                       ({"keepalive_count": 128}, "keepalive_count must be 0 .off. or 1..127"),
                       ({"keepalive_count": -1}, "keepalive_count must be an int >= 0")):
        with pytest.raises(ValueError, match=match):
            ServerLimits(**bad)
    ServerLimits(keepalive_idle_ms=0, keepalive_interval_ms=0, keepalive_count=0)  # 0: off


_SS_TIMER = re.compile(r"timer:\(keepalive,(?:(\d+)min)?(?:(\d+)(?:sec|\.))?(?:(\d+)ms)?,")


def _keepalive_timers(port: int) -> list[float]:
    """Seconds left on the keepalive timer of each server-side socket of ``port``, as ``ss``
    shows the kernel's timers ("1min", "12sec", "9.688ms" for 9.688 s, "688ms"; 0.0: that
    socket has no keepalive timer now)."""
    out = subprocess.run(["ss", "-tno", "state", "established", f"sport = :{port}"],
                         capture_output=True, text=True, timeout=30).stdout
    timers = []
    for line in (line for line in out.splitlines()[1:] if line.strip()):
        m = _SS_TIMER.search(line)
        minutes, secs, millis = (int(g or 0) for g in m.groups()) if m else (0, 0, 0)
        timers.append(60.0 * minutes + secs + millis / 1000)
    return timers


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_accepted_connections_carry_the_keepalive_timers() -> None:
    """The server's end of each connection runs a keepalive timer of at most the idle time
    (10 s by default, 3 s here), and none when keepalive is off (``ss`` shows the kernel's
    timers)."""
    from elasticstore import ServerLimits, StoreServer

    for limits, most in ((ServerLimits(), 10.0), (ServerLimits(keepalive_idle_ms=3000), 3.0),
                         (ServerLimits(keepalive_count=0), None)):
        with StoreServer(limits=limits) as server, \
                Store(server.host, server.port, timeout=timedelta(seconds=10)) as store:
            store.set("k", "v", ephemeral=True)
            timers: list[float] = []
            deadline = time.monotonic() + (0.5 if most is None else 5.0)
            while time.monotonic() < deadline:  # once the reply is acknowledged: no data in flight
                timers = _keepalive_timers(server.port)
                if most is not None and timers and all(t > 0 for t in timers):
                    break
                time.sleep(0.05)
            if most is None:
                assert timers == [0.0], timers
            else:
                assert len(timers) == 1 and 0 < timers[0] <= most, (limits, timers)


def test_keepalive_keeps_idle_live_peers_and_closes_one_that_stopped_reading(
    daemon_factory: type[Daemon],
) -> None:
    """With a 3 s keepalive bound (1 s idle, 2 probes 1 s apart): an idle but live client keeps
    its connection and session key well past the bound (its kernel answers the probes), while
    one that stops reading with replies pending (its receive window stays closed) is closed
    after about the bound, logged as such; the user timeout that bounds unacknowledged data
    bounds a closed window too."""
    d = daemon_factory("--keepalive-idle-ms", "1000", "--keepalive-interval-ms", "1000",
                       "--keepalive-count", "2")
    with d.store() as idle, d.store() as other:
        idle.set("eph/idle", "1", ephemeral=True)
        other.set("big", b"x" * (1 << 20))
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
        stuck.connect(("127.0.0.1", d.port))
        stuck.sendall(b"ESTO" + frame(OP_HELLO, 1, struct.pack("<I", 1) + _bytes(b"stuck")))
        stuck.sendall(b"".join(get_frame(10 + i, b"big", 0) for i in range(3)))  # never read
        t0 = time.monotonic()
        wait_stat(other, "connections", 3)  # stuck accepted
        wait_stat(other, "connections", 2, within=20.0)  # idle and other: stuck was closed
        closed = time.monotonic() - t0
        time.sleep(max(0.0, 4.5 - closed))  # idle for 1.5x the bound, at least
        assert idle.check(["eph/idle"]) and idle.get("eph/idle") == b"1"
        assert other.stats()["connections_closed_peer_lost"] == 1
        stuck.close()
    log = d.stop()
    print(f"\nkeepalive bound 3 s: a peer not reading closed after {closed:.2f}s; an idle live "
          f"peer kept its session for {time.monotonic() - t0:.1f}s")
    assert "peer stopped reading, its receive window stayed closed (write failed: Connection " \
           "timed out); keepalive bound 3000 ms" in log, log
    assert log.count("keepalive bound") == 1, log
    assert closed < 3.0 + 2.0


def test_python_server_command_takes_the_limit_flags() -> None:
    cli = os.path.join(sysconfig.get_path("scripts"), "elasticstore")
    done = subprocess.run([cli, "server", "--port", "0", "--max-stored-keys", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "argument --max-stored-keys: '0': must be >= 1" in done.stderr
    done = subprocess.run([cli, "server", "--port", "0", "--keepalive-interval-ms", "1500"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "argument --keepalive-interval-ms: '1500': must be 0 (off) or whole seconds" in done.stderr
    server = subprocess.Popen([cli, "server", "--port", "0", "--max-stored-keys", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # bounded by the test timeout
        port = int(line.strip().rsplit(":", 1)[1])
        with Store("127.0.0.1", port, timeout=timedelta(seconds=10)) as store:
            store.set("a", "1")
            with pytest.raises(StoreError, match="store full"):
                store.set("b", "2")
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=30)
