"""What one client can make the server spend: memory (peak RSS) and CPU, measured on a real
``elasticstore-server`` process over loopback with raw sockets. Each test runs the attacking
scenario at a modest size and asserts a bound that the unbounded code clearly exceeded.

``ELASTICSTORE_SERVER_BINARY`` points the tests at another build of the server (to measure an older
one)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import struct
import subprocess
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from dataclasses import dataclass

import spawned
import pytest

from elasticstore import Store
from elasticstore.errors import StoreError

MIB = 1024 * 1024
BIG = 8 * MIB  # kMaxValueBytes

# native opcodes and statuses (docs/protocol.md)
HELLO, SET, GET, TRY_GET, WAIT, DELETE_KEY, MULTI_GET, MULTI_SET = 1, 2, 3, 4, 7, 9, 13, 14
PING, BARRIER, STATS = 18, 19, 21
OK, TIMEOUT, TOO_LARGE = 0, 1, 4
NO_TIMEOUT = 0xFFFFFFFF
# torch's TCPStore protocol (docs/tcpstore-compat.md)
TS_VALIDATE_MAGIC = 0x3C85F7CE
TS_MULTI_SET, TS_PING = 11, 13


def _binary() -> str:
    override = os.environ.get("ELASTICSTORE_SERVER_BINARY")
    if override:
        return override
    return os.path.join(sysconfig.get_path("scripts"), "elasticstore-server")


@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int
    log_path: str

    def _status(self, field: str) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field}")

    def peak_rss(self) -> int:
        return self._status("VmHWM")

    def rss(self) -> int:
        return self._status("VmRSS")

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


_sockets: list[socket.socket] = []  # closed when the test's server stops


@pytest.fixture
def server() -> Iterator[Server]:
    with serving() as srv:
        yield srv


@contextlib.contextmanager
def serving(*flags: str, nofile: tuple[int, int] | None = None) -> Iterator[Server]:
    """An ``elasticstore-server`` process with these extra flags (and, with ``nofile``, that
    soft and hard RLIMIT_NOFILE), stopped (and checked gone) on exit."""
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        log_path = log.name
    # The limit is set by util-linux's prlimit, which then execs the server (the same pid), not by
    # a preexec_fn: that makes subprocess fork and run Python code in the child, where the fork
    # handlers of gRPC (loaded by the etcd tests that ran before in this pytest worker) restart
    # its poller, whose descriptor the child then closes, and gRPC aborts the child (SIGABRT,
    # "epoll_wait error: Bad file descriptor"; 3 of 200 such starts here).
    limit = [] if nofile is None else ["prlimit", f"--nofile={nofile[0]}:{nofile[1]}", "--"]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [*limit, _binary(), "--host", "127.0.0.1", "--port", "0", "--log-level", "info",
             *flags],
            stdout=subprocess.PIPE, stderr=log_file, text=True,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("elasticstore server listening on "):  # say why it did not serve
            try:
                code: int | None = proc.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            with open(log_path) as f:
                said = f.read()[-4000:]
            raise AssertionError(f"elasticstore-server {' '.join(flags)} did not start: stdout "
                                 f"{line!r}, exit {code}, stderr:\n{said}")
        yield Server(proc, int(line.strip().rsplit(":", 1)[1]), log_path)
    finally:
        for s in _sockets:
            s.close()
        _sockets.clear()
        spawned.kill_all([proc])
        os.unlink(log_path)


# ---- native frames -------------------------------------------------------------------------------

def blob(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def keys(names: list[bytes]) -> bytes:
    return struct.pack("<I", len(names)) + b"".join(blob(k) for k in names)


def frame(opcode: int, request_id: int, payload: bytes = b"") -> bytes:
    body = struct.pack("<BI", opcode, request_id) + payload
    return struct.pack("<I", len(body)) + body


class Native:
    """A raw native-protocol connection; every receive is bounded by a socket timeout."""

    def __init__(self, port: int, rcvbuf: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _sockets.append(self.sock)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(30)
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(b"ESTO" + frame(HELLO, 0, struct.pack("<I", 1) + blob(b"resources")))
        assert self.reply()[0] == OK

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 4 * MIB))
            if not chunk:
                raise ConnectionError("server closed the connection")
            buf += chunk
        return bytes(buf)

    def reply(self) -> tuple[int, int, bytes]:
        (body_len,) = struct.unpack("<I", self._exact(4))
        body = self._exact(body_len)
        return body[0], struct.unpack("<I", body[1:5])[0], body[5:]

    def call(self, opcode: int, payload: bytes = b"") -> tuple[int, bytes]:
        self.send(frame(opcode, 7, payload))
        status, _, rest = self.reply()
        return status, rest

    def set(self, key: bytes, value: bytes) -> None:
        assert self.call(SET, blob(key) + blob(value) + b"\0")[0] == OK

    def stats(self) -> dict[str, int]:
        status, rest = self.call(STATS)
        assert status == OK
        (n,) = struct.unpack_from("<I", rest)
        out, off = {}, 4
        for _ in range(n):
            (ln,) = struct.unpack_from("<I", rest, off)
            name = rest[off + 4: off + 4 + ln].decode()
            off += 4 + ln
            out[name] = struct.unpack_from("<Q", rest, off)[0]
            off += 8
        return out

    def close(self) -> None:
        self.sock.close()


def _settle(server: Server) -> None:
    """Waits until the server answers a PING (everything sent before was handled)."""
    c = Native(server.port)
    assert c.call(PING, struct.pack("<Q", 1))[0] == OK
    c.close()


# ---- 1. MULTI_GET totals the reply before building it ---------------------------------------------

@pytest.mark.parametrize("blocking", [False, True], ids=["at-once", "woken"])
def test_multi_get_over_the_reply_limit_is_refused_before_copying(
    server: Server, blocking: bool
) -> None:
    c = Native(server.port)
    c.set(b"big", b"x" * BIG)
    names = [b"big"] * 40  # a 320 MiB reply from a 300-byte request
    if blocking:
        c.send(frame(MULTI_GET, 9, keys(names + [b"late"]) + struct.pack("<I", 30_000)))
        c.set(b"late", b"1")  # wakes the MULTI_GET waiter
    else:
        c.send(frame(MULTI_GET, 9, keys(names) + struct.pack("<I", 0)))
    status, request_id, message = c.reply()
    assert (status, request_id) == (TOO_LARGE, 9), message
    assert b"over the limit" in message
    print(f"multi_get: peak RSS {server.peak_rss() / MIB:.0f} MiB")
    # The value (8 MiB) is held once in the store and once in the watch history.
    assert server.peak_rss() < 64 * MIB, f"peak RSS {server.peak_rss() / MIB:.0f} MiB"
    # Under the limit, the reply is still served.
    c.send(frame(MULTI_GET, 10, keys([b"big", b"late" if blocking else b"big"]) + struct.pack("<I", 0)))
    status, request_id, rest = c.reply()
    assert (status, request_id) == (OK, 10)
    assert struct.unpack_from("<I", rest)[0] == 2


# ---- 2. torch-protocol requests: bounded declared size, parsed in O(bytes) -------------------------

def _torch_client(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    _sockets.append(s)
    s.sendall(b"\0" + struct.pack("<I", TS_VALIDATE_MAGIC) + bytes([TS_PING]) + struct.pack("<I", 5))
    got = b""
    while len(got) < 4:
        chunk = s.recv(4 - len(got))
        assert chunk
        got += chunk
    assert struct.unpack("<I", got)[0] == 5
    return s


def test_torch_request_declaring_more_than_the_frame_limit_is_refused_early(server: Server) -> None:
    s = _torch_client(server.port)
    n, size = 16, 4 * MIB  # declares 64 MiB of values
    s.sendall(bytes([TS_MULTI_SET]) + struct.pack("<Q", n))
    chunk = b"v" * MIB
    sent, closed = 0, False
    deadline = time.monotonic() + 20
    try:
        for i in range(n):
            s.sendall(struct.pack("<Q", 1) + b"k" + struct.pack("<Q", size))
            for _ in range(size // MIB):
                s.sendall(chunk)
                sent += len(chunk)
            assert time.monotonic() < deadline
        s.settimeout(5)
        closed = s.recv(1) == b""
    except TimeoutError:
        closed = False
    except (ConnectionResetError, BrokenPipeError):
        closed = True
    finally:
        s.close()
    print(f"declared 64 MiB: read {sent / MIB:.0f} MiB, peak RSS {server.peak_rss() / MIB:.0f} MiB")
    assert closed, f"the server read a request declaring 64 MiB (peak RSS {server.peak_rss() / MIB:.0f} MiB)"
    assert sent < 32 * MIB, f"the server read {sent / MIB:.0f} MiB before refusing"
    assert server.peak_rss() < 48 * MIB, f"peak RSS {server.peak_rss() / MIB:.0f} MiB"
    assert "MULTI_SET" in server.log()
    _settle(server)  # still serving


def test_torch_request_sent_in_small_pieces_is_parsed_once(server: Server) -> None:
    s = _torch_client(server.port)
    n = 128 * 1024 - 1  # a 2.2 MB MULTI_SET of 128K tiny pairs, sent 1 KB at a time
    body = bytes([TS_MULTI_SET]) + struct.pack("<Q", n) + b"".join(
        struct.pack("<Q", 1) + b"k" + struct.pack("<Q", 0) for _ in range(n))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    before = server.cpu_seconds()
    for off in range(0, len(body), 1024):
        s.sendall(body[off:off + 1024])
        time.sleep(0.0005)
    s.sendall(bytes([TS_PING]) + struct.pack("<I", 6))
    s.settimeout(30)
    assert s.recv(4) == struct.pack("<I", 6)
    spent = server.cpu_seconds() - before
    s.close()
    print(f"2.2 MB request in 1 KB pieces: server CPU {spent:.3f} s")
    assert spent < 0.3, f"server CPU {spent:.2f} s for one 2.2 MB request"


# ---- 3. backpressure on replies -------------------------------------------------------------------

def test_clients_that_do_not_read_their_replies_are_paused_not_buffered(server: Server) -> None:
    writer = Native(server.port)
    writer.set(b"big", b"x" * BIG)
    readers = [Native(server.port, rcvbuf=64 * 1024) for _ in range(4)]
    per_client = 20  # 160 MiB of replies each
    for r in readers:
        r.send(b"".join(frame(TRY_GET, i, blob(b"big")) for i in range(per_client)))
    _settle(server)
    time.sleep(0.5)
    peak = server.peak_rss()
    print(f"4 non-reading clients: peak RSS {peak / MIB:.0f} MiB")
    # Reading resumes the paused connection: every reply arrives, in order.
    for i in range(per_client):
        status, request_id, rest = readers[0].reply()
        assert (status, request_id, len(rest)) == (OK, i, 1 + 4 + BIG + 8)
    assert peak < 160 * MIB, f"peak RSS {peak / MIB:.0f} MiB"
    for r in readers:
        r.close()


def test_wakeups_for_a_client_that_does_not_read_are_bounded(server: Server) -> None:
    sleeper = Native(server.port, rcvbuf=64 * 1024)
    n = 30  # 30 blocked GETs: one set wakes 240 MiB of replies
    sleeper.send(b"".join(frame(GET, i, blob(b"w") + struct.pack("<I", NO_TIMEOUT)) for i in range(n)))
    writer = Native(server.port)
    deadline = time.monotonic() + 10
    while writer.stats()["waiters"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    writer.set(b"w", b"x" * BIG)
    _settle(server)
    time.sleep(0.5)
    peak = server.peak_rss()
    print(f"30 woken GETs, never read: peak RSS {peak / MIB:.0f} MiB")
    # The value in the store and the history, the SET request, and one connection's output limit
    # (kMaxWriteBufferBytes, 65 MiB, briefly twice while its buffer grows).
    assert peak < 200 * MIB, f"peak RSS {peak / MIB:.0f} MiB"
    assert "not reading its replies" in server.log()
    assert writer.call(PING, struct.pack("<Q", 3))[0] == OK  # the others are served
    sleeper.close()


# ---- 4. multi-key WAIT: O(waiters of the key) per change ------------------------------------------

def test_multi_key_wait_costs_nothing_per_unrelated_change(server: Server) -> None:
    n_keys, n_waiters, cycles = 50_000, 10, 40
    names = [b"k%06d" % i for i in range(n_keys)]
    c = Native(server.port)
    for lo in range(0, n_keys - 1, 10_000):  # every key but the last
        batch = names[lo:min(lo + 10_000, n_keys - 1)]
        payload = struct.pack("<I", len(batch)) + b"".join(blob(k) + blob(b"1") for k in batch)
        assert c.call(MULTI_SET, payload)[0] == OK
    waiters = [Native(server.port) for _ in range(n_waiters)]
    for w in waiters:
        w.send(frame(WAIT, 1, keys(names) + struct.pack("<I", 60_000)))
    deadline = time.monotonic() + 20
    while c.stats()["waiters"] < n_waiters:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    before = server.cpu_seconds()
    worst = 0.0
    missing = n_keys - 1
    for _ in range(cycles):  # delete the key before the missing one, then set the missing one
        start = time.monotonic()
        assert c.call(DELETE_KEY, blob(names[missing - 1]))[0] == OK
        c.set(names[missing], b"1")
        worst = max(worst, time.monotonic() - start)
        missing -= 1
    spent = server.cpu_seconds() - before
    assert c.stats()["waiters"] == n_waiters  # one key is always missing
    c.set(names[missing], b"1")
    for w in waiters:
        assert w.reply()[0] == OK
    print(f"multi-key wait: server CPU {spent:.3f} s, worst cycle {worst:.4f} s")
    assert spent < 0.5, f"server CPU {spent:.2f} s over {cycles} cycles (worst {worst:.3f} s)"


# ---- 5. barrier names are not kept forever -------------------------------------------------------

def test_barrier_names_cost_little_and_timed_out_ones_nothing(server: Server) -> None:
    c = Native(server.port)
    # Arrivals that all timed out (generation 0 never released) leave nothing behind.
    for i in range(1000):
        c.send(frame(BARRIER, i, blob(b"lonely%d" % i) + struct.pack("<II", 2, 0)))
    for _ in range(1000):
        assert c.reply()[0] == TIMEOUT
    stats = c.stats()
    assert stats.get("barriers") == 0, stats
    # A released name keeps only its generation, so reusing it continues the count.
    status, rest = c.call(BARRIER, blob(b"reused") + struct.pack("<II", 1, 0))
    assert (status, struct.unpack("<Q", rest)[0]) == (OK, 0)
    status, rest = c.call(BARRIER, blob(b"reused") + struct.pack("<II", 1, 0))
    assert (status, struct.unpack("<Q", rest)[0]) == (OK, 1)
    # One-shot names: what each costs.
    n = 200_000
    base = server.rss()
    for lo in range(0, n, 10_000):
        c.send(b"".join(frame(BARRIER, i, blob(b"once-%07d" % i) + struct.pack("<II", 1, 0))
                        for i in range(lo, lo + 10_000)))
        for _ in range(10_000):
            assert c.reply()[0] == OK
    per_name = (server.rss() - base) / n
    print(f"barrier names: {per_name:.0f} bytes each")
    assert c.stats()["barriers"] == MAX_IDLE_BARRIER_NAMES  # the oldest idle ones forgotten
    assert per_name < 90, f"{per_name:.0f} bytes per released barrier name"


MAX_IDLE_BARRIER_NAMES = 65_536  # kMaxIdleBarrierNames


def _one_shot_barriers(c: Native, n: int) -> None:
    for lo in range(0, n, 10_000):
        c.send(b"".join(frame(BARRIER, i, blob(b"once-%07d" % i) + struct.pack("<II", 1, 0))
                        for i in range(lo, min(n, lo + 10_000))))
        for _ in range(lo, min(n, lo + 10_000)):
            assert c.reply()[0] == OK


def test_one_shot_barrier_names_are_bounded_and_forgotten_once_idle() -> None:
    """300,000 one-shot barrier names from a client that then leaves: the server keeps at most
    kMaxIdleBarrierNames of them, and none once they have been idle --barrier-idle-ms."""
    with serving("--barrier-idle-ms", "2000") as server:
        c = Native(server.port)
        base = server.rss()
        _one_shot_barriers(c, 300_000)
        grown = server.rss() - base
        held = c.stats()["barriers"]
        print(f"300000 one-shot barrier names: {held} held, server RSS +{grown / MIB:.1f} MiB")
        assert held <= MAX_IDLE_BARRIER_NAMES
        assert grown < 12 * MIB, f"server RSS grew by {grown / MIB:.1f} MiB"
        c.close()
        other = Native(server.port)
        spawned.wait_until(lambda: other.stats()["barriers"] == 0, 30,
                         "the idle barrier names to be forgotten")
        # A name forgotten starts again at generation 0; the server stays usable.
        status, rest = other.call(BARRIER, blob(b"once-0299999") + struct.pack("<II", 1, 0))
        assert (status, struct.unpack("<Q", rest)[0]) == (OK, 0)


# ---- blocked requests: their memory is bounded per connection ------------------------------------

def test_pipelined_blocking_requests_are_bounded(server: Server) -> None:
    c = Native(server.port)
    names = [b"w%07d" % i for i in range(20_000)]
    request = keys(names) + struct.pack("<I", 60_000)  # 220 KB naming 20K missing keys
    n = 400  # 88 MB sent
    base = server.rss()
    for i in range(0, n, 50):
        c.send(b"".join(frame(WAIT, j, request) for j in range(i, i + 50)))
    refused = 0
    c.sock.settimeout(0.5)
    try:
        while True:
            status, _, message = c.reply()
            assert status == TOO_LARGE, message
            refused += 1
    except TimeoutError:
        pass
    grown = server.rss() - base
    print(f"{n} pipelined 20K-key WAITs: {refused} refused, server RSS +{grown / MIB:.0f} MiB")
    assert refused > n // 2
    assert grown < 128 * MIB, f"server RSS grew by {grown / MIB:.0f} MiB"
    other = Native(server.port)  # another connection may still block
    other.send(frame(WAIT, 1, keys(names[:10]) + struct.pack("<I", 60_000)))
    setter = Native(server.port)
    payload = struct.pack("<I", 10) + b"".join(blob(k) + blob(b"1") for k in names[:10])
    assert setter.call(MULTI_SET, payload)[0] == OK
    assert other.reply()[0] == OK


# ---- connections that never authenticate ---------------------------------------------------------

MAX_HALF_OPEN_PER_PEER = 1_024  # kMaxHalfOpenPerPeer


def _open_files_limit(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no open-files line")


@pytest.mark.parametrize("attacker", ["127.0.0.1", "127.0.0.2"], ids=["same-address", "other-host"])
def test_unauthenticated_connections_leave_room_for_authenticated_ones(
    tmp_path: pathlib.Path, attacker: str
) -> None:
    """Under an open-file limit of 256, one peer holding 400 connections that never finish the
    handshake does not keep 8 clients with the token out: connections not yet authenticated are
    bounded per peer address and to half the descriptors, the oldest closed first."""

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with serving("--token-file", str(token), nofile=(256, 256)) as server:
        held: list[socket.socket] = []
        for _ in range(400):
            s = socket.socket()
            _sockets.append(s)
            s.bind((attacker, 0))
            s.settimeout(10)
            try:
                s.connect(("127.0.0.1", server.port))
                s.sendall(b"ES")  # a preamble begun, never finished
            except OSError:
                s.close()  # refused or reset at once: holds nothing
                continue
            held.append(s)
        clients = [Store("127.0.0.1", server.port, token="s3cret", timeout=timedelta(seconds=10))
                   for _ in range(8)]
        try:
            for i, c in enumerate(clients):
                c.set(f"k{i}", "v")
            assert clients[0].num_keys() == 8
            stats = clients[0].stats()
            print(f"400 never-authenticated connections from {attacker}: "
                  f"{stats['connections_half_open']} kept, {stats['connections_shed_half_open']} shed")
            assert stats["connections_half_open"] <= min(MAX_HALF_OPEN_PER_PEER, 256 // 2)
            assert "Too many open files" not in server.log()
        finally:
            for c in clients:
                c.close()


def test_server_raises_its_open_file_limit_to_the_hard_limit() -> None:
    with serving(nofile=(256, 1024)) as server:
        assert _open_files_limit(server.proc.pid) == (1024, 1024)
        assert "raised the open-file limit from 256 to 1024" in server.log()



def test_the_loop_reports_how_late_it_woke_and_its_slowest_pass(server: Server) -> None:
    """``loop_latest_wake_ms``: how far past its timer a wait returned (the server stopped, or
    not scheduled: starved of CPU); ``loop_slowest_pass_ms``: the longest pass between two
    waits. A GET that blocks parks a 0.5 s timer; the server is stopped for 1.5 s across it."""
    with Store("127.0.0.1", server.port) as st:
        before = st.stats()
        assert before["loop_latest_wake_ms"] < 500 and "loop_slowest_pass_ms" in before
        blocked = Store("127.0.0.1", server.port, timeout=timedelta(seconds=0.5))
        outcome: list[str] = []

        def wait() -> None:
            try:
                blocked.get("missing")
            except StoreError as exc:
                outcome.append(type(exc).__name__)

        parked = threading.Thread(target=wait)
        try:
            parked.start()
            time.sleep(0.2)  # the GET is parked: the loop waits for its 0.5 s timer
            os.kill(server.proc.pid, signal.SIGSTOP)
            time.sleep(1.5)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
            parked.join(10)
            blocked.close()
        assert not parked.is_alive() and outcome == ["StoreTimeoutError"], outcome
        assert st.stats()["loop_latest_wake_ms"] >= 500, st.stats()
