"""Faults of the server's connections: a server killed or cut off under load, clients killed
mid-frame or left half-open, a client gone silent (its session keys go within the keepalive bound).
Network faults use a simulated node (a network namespace, see ``netfaults.py``; the ``net``
fixture is in conftest.py).

Each test prints its figures (run with ``-s``); each cleans up its processes, namespaces, veths
and rules in ``finally``/``with`` blocks and checks nothing of them is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist


import netfaults  # noqa: E402

import elasticstore  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


# --- a server killed or cut off under load ----------------------------------------------------


def _server_binary() -> str:
    path = os.path.join(sysconfig.get_path("scripts"), "elasticstore-server")
    assert os.access(path, os.X_OK), f"{path} is not installed with the package"
    return path


def _start_server(host: str, prefix: list[str] | None = None,
                  options: tuple[str, ...] = ()) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([*(prefix or []), _server_binary(), "--host", host, "--port", "0",
                             *options],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded by the test timeout
    assert line.startswith(f"elasticstore server listening on {host}:"), line
    return proc, int(line.strip().rsplit(":", 1)[1])


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


class Load:
    """Client threads, each with its own ``Store``, looping over set/add/get/check (and one
    blocked server-side in ``get`` of a missing key) until their first error, recorded with
    its wall time. Bounded: every thread stops after ``limit`` seconds."""

    def __init__(self, host: str, port: int, clients: int, timeout: float,
                 connect_timeout: float, limit: float = 60.0) -> None:
        self.errors: dict[str, tuple[float, BaseException]] = {}
        self.ops = [0] * clients
        self._stop = False
        self.stores = [elasticstore.Store(host, port, timeout=timedelta(seconds=timeout),
                                          connect_timeout=timedelta(seconds=connect_timeout))
                       for _ in range(clients + 1)]
        self.threads = [threading.Thread(target=self._loop, args=(i, limit), daemon=True)
                        for i in range(clients)]
        self.threads.append(threading.Thread(target=self._blocked, daemon=True))
        for thread in self.threads:
            thread.start()

    def _loop(self, i: int, limit: float) -> None:
        st, end = self.stores[i], time.monotonic() + limit
        try:
            while not self._stop and time.monotonic() < end:
                st.set(f"k{i}", str(self.ops[i]))
                st.add("n", 1)
                st.get(f"k{i}")
                st.check([f"k{i}"])
                self.ops[i] += 1
        except BaseException as exc:  # noqa: BLE001 (recorded for the test)
            self.errors[f"loop{i}"] = (time.time(), exc)

    def _blocked(self) -> None:
        try:
            self.stores[-1].get("never")  # waits server-side up to its timeout
        except BaseException as exc:  # noqa: BLE001
            self.errors["blocked-get"] = (time.time(), exc)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(timeout=max(0.1, deadline - time.monotonic()))
        self._stop = True

    def close(self) -> None:
        self._stop = True
        for st in self.stores:
            st.close()
        for thread in self.threads:
            thread.join(timeout=10)


@pytest.mark.parametrize("connect_timeout", [3.0, 30.0])
def test_server_sigkilled_under_load_every_client_fails_naming_it(connect_timeout: float) -> None:
    """SIGKILL of ``elasticstore-server`` while 4 clients loop and one waits in ``get``: every
    client raises ``DistNetworkError`` naming host:port, promptly (the in-flight call fails
    at once; a call that starts after the kill retries connecting for ``connect_timeout``)."""
    proc, port = _start_server("127.0.0.1")
    endpoint = f"127.0.0.1:{port}"
    load = Load("127.0.0.1", port, 4, timeout=30, connect_timeout=connect_timeout)
    try:
        time.sleep(1.0)
        assert all(n > 0 for n in load.ops) and not load.errors, load.errors
        killed = time.time()
        proc.send_signal(signal.SIGKILL)
        load.join(connect_timeout + 15)
        assert len(load.errors) == 5, f"clients still running: {set(range(5)) - set(load.errors)}"
        delays = {}
        for name, (t, exc) in load.errors.items():
            assert isinstance(exc, dist.DistNetworkError), (name, repr(exc))
            assert endpoint in str(exc), (name, str(exc))
            delays[name] = t - killed
        print(f"\nserver SIGKILLed under load (connect_timeout {connect_timeout:g}s): client "
              f"failures after " + ", ".join(f"{k} {v:.3f}s" for k, v in sorted(delays.items())))
        print("  e.g. " + str(load.errors["blocked-get"][1]).splitlines()[0])
        assert max(delays.values()) < connect_timeout + 2.0
        if connect_timeout <= 3.0:  # a later call retries connecting for connect_timeout
            t0 = time.monotonic()
            with pytest.raises(dist.DistNetworkError, match=endpoint.replace(".", r"\.")):
                load.stores[0].add("n", 1)
            print(f"  next call after the kill: DistNetworkError after "
                  f"{time.monotonic() - t0:.2f}s (connect_timeout {connect_timeout:g}s)")
            assert time.monotonic() - t0 < connect_timeout + 2.0
    finally:
        load.close()
        _stop(proc)


def test_silent_server_every_client_fails_within_its_timeout(net: None) -> None:
    """The server runs in a namespace whose link is then cut (no FIN, no RST): every client
    raises ``DistNetworkError`` naming host:port within its timeout, none hangs."""
    with netfaults.node(3) as n:
        proc, port = _start_server(n.addr, n.prefix())
        endpoint = f"{n.addr}:{port}"
        timeout = 3.0
        load = Load(n.addr, port, 4, timeout=timeout, connect_timeout=timeout)
        try:
            time.sleep(1.0)
            assert all(k > 0 for k in load.ops) and not load.errors, load.errors
            cut = n.partition()
            load.join(3 * timeout + 15)
            assert len(load.errors) == 5, f"running: {set(range(5)) - set(load.errors)}"
            delays = {}
            for name, (t, exc) in load.errors.items():
                assert isinstance(exc, dist.DistNetworkError), (name, repr(exc))
                assert endpoint in str(exc), (name, str(exc))
                delays[name] = t - cut
            print(f"\nserver cut off (client timeout {timeout:g}s): client failures after "
                  + ", ".join(f"{k} {v:.2f}s" for k, v in sorted(delays.items())))
            print("  e.g. " + str(load.errors["loop0"][1]).splitlines()[0])
            assert max(delays.values()) < 2 * timeout + 2.0
        finally:
            load.close()
            _stop(proc)


# --- clients killed mid-frame -----------------------------------------------------------------

HALF_FRAME = """
import socket, struct, sys, time
host, port, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = socket.create_connection((host, port), timeout=10)
def frame(op, rid, payload):
    return struct.pack("<IBI", 5 + len(payload), op, rid) + payload
def b(x):
    return struct.pack("<I", len(x)) + x
if kind == "tcpstore":  # torch's protocol: VALIDATE (0x00) then half of its u32 magic
    s.sendall(b"\\x00\\x3c")
else:
    s.sendall(b"ESTO" + frame(1, 1, struct.pack("<I", 1) + b(b"half")))
    hdr = s.recv(9)
    assert len(hdr) == 9 and hdr[4] == 0, hdr
    s.recv(struct.unpack("<I", hdr[:4])[0] - 5)
    s.sendall(frame(2, 2, b(b"eph/" + kind.encode()) + b(b"x") + b"\\x01"))  # ephemeral set
    s.recv(9 + 8)
    value = b"v" * (1 << 20)
    whole = frame(2, 3, b(b"big") + b(value) + b"\\x00")
    s.sendall(whole[: len(whole) // 2])  # half of a 1 MiB set
print("sent", flush=True)
time.sleep(120)
"""


def _half_frame_client(host: str, port: int, kind: str,
                       prefix: list[str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen([*(prefix or []), sys.executable, "-c", HALF_FRAME, host, str(port),
                             kind], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "sent\n", (line, proc.stderr.read() if proc.stderr else "")
    return proc


def _until(cond: Any, timeout: float) -> float:
    """Seconds until ``cond()`` holds (polled every 20 ms); raises after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout}s")
        time.sleep(0.02)
    return time.monotonic() - t0


def test_clients_sigkilled_mid_frame_leave_the_server_unaffected() -> None:
    """20 clients each send half a frame (16 half of a 1 MiB native SET, 4 half a TCPStore
    VALIDATE), then are SIGKILLed; meanwhile another client keeps working: its counter is
    exact, the server frees their connections, buffers and session keys, its memory stays
    bounded, and it serves the next 20 the same (no growth)."""
    proc, port = _start_server("127.0.0.1")
    try:
        with elasticstore.Store("127.0.0.1", port, timeout=timedelta(seconds=30)) as st:
            st.set("kept", "1")
            base = st.stats()
            rss0 = _rss_kib(proc.pid)
            rss = []
            for batch in range(2):
                kinds = [f"n{batch}-{i}" for i in range(16)] + ["tcpstore"] * 4
                clients = [_half_frame_client("127.0.0.1", port, k) for k in kinds]
                try:
                    # accepted and read by the server (the last bytes may still be in flight)
                    _until(lambda: st.stats()["connections"] == base["connections"] + 20, 10)
                    _until(lambda: st.stats()["bytes_buffered"] >= 16 * (1 << 19), 10)
                    assert len(st.list_keys("eph/")) == 16
                    for i in range(50):
                        assert st.add("counter", 1) == 50 * batch + i + 1
                    rss.append(_rss_kib(proc.pid))
                    killed = time.time()
                    for c in clients:
                        c.send_signal(signal.SIGKILL)
                    freed = _until(lambda: st.stats()["connections"] == base["connections"], 10)
                finally:
                    for c in clients:
                        _stop(c)
                after = st.stats()
                assert after["bytes_buffered"] == base["bytes_buffered"], after
                assert st.list_keys("eph/") == [] and st.get("kept") == b"1"
                assert not st.check(["big"])  # the half-sent SETs were never applied
                print(f"\nbatch {batch}: 20 clients SIGKILLed mid-frame: connections freed "
                      f"{freed:.3f}s after the kill ({time.time() - killed:.2f}s incl. checks); "
                      f"server RSS {rss0 // 1024} MiB before, {rss[-1] // 1024} MiB with 8 MiB "
                      f"of half frames buffered, {_rss_kib(proc.pid) // 1024} MiB after")
            assert int(st.get("counter")) == 100
            assert _rss_kib(proc.pid) < rss0 + 64 * 1024  # bounded, not one 1 MiB per client kept
            assert proc.poll() is None
    finally:
        _stop(proc)


def test_half_open_client_mid_frame_is_closed_by_the_frame_timeout(net: None) -> None:
    """A client in a namespace sends half a frame, then its link goes down and it is SIGKILLed:
    its FIN never arrives (a half-open connection). Others keep working; the server closes the
    half-open connection when the frame timeout passes (5 s here, ``--frame-timeout-ms``; 30 s by
    default), and its ephemeral key goes."""
    with netfaults.node(4) as n:
        proc, port = _start_server(n.root_addr, options=("--frame-timeout-ms", "5000"))
        client: subprocess.Popen[str] | None = None
        try:
            with elasticstore.Store(n.root_addr, port, timeout=timedelta(seconds=30)) as st:
                base = st.stats()["connections"]
                client = _half_frame_client(n.root_addr, port, "halfopen", n.prefix())
                assert st.stats()["connections"] == base + 1
                cut = n.link_down()
                client.send_signal(signal.SIGKILL)
                _stop(client)
                for i in range(100):
                    assert st.add("counter", 1) == i + 1
                assert st.stats()["connections"] == base + 1  # no FIN came: still open
                _until(lambda: st.stats()["connections"] == base, 20)
                closed = time.time() - cut
                assert st.list_keys("eph/") == [] and st.stats()["bytes_buffered"] == 0
                print(f"\nhalf-open client with half a frame: closed by the server "
                      f"{closed:.1f}s after its link went down (frame timeout 5 s); "
                      f"other clients unaffected")
        finally:
            if client is not None:
                _stop(client)
            _stop(proc)


# --- a client gone silent: its session keys go within the keepalive bound ----------------------

SESSION_HOLDER = """
import sys, threading, time
from datetime import timedelta
import elasticstore
host, ports = sys.argv[1], sys.argv[2:]
for port in ports:  # per server: a session key and two blocked waits, each on its own connection
    st = elasticstore.Store(host, int(port), timeout=timedelta(seconds=100))
    st.set(f"eph/{port}", "held", ephemeral=True)
    waits = [elasticstore.Store(host, int(port), timeout=timedelta(seconds=100)) for _ in range(2)]
    for w, key in zip(waits, ("never", "wake")):
        threading.Thread(target=w.wait, args=([key],), daemon=True).start()
    globals()[f"keep{port}"] = (st, waits)
print("bound", flush=True)
time.sleep(100)
"""

FAST_KEEPALIVE = ("--keepalive-idle-ms", "1000", "--keepalive-interval-ms", "1000",
                  "--keepalive-count", "2")  # a silent peer is closed after 1 + 2 * 1 = 3 s


def test_silent_client_loses_its_session_within_the_keepalive_bound(net: None) -> None:
    """A client in a namespace binds a session key and blocks in two waits (three connections)
    on three servers: one with fast keepalive (3 s), one with the default (10 s idle + 3 probes
    2 s apart: 16 s), one with keepalive off. Its link is then cut (iptables DROP: no FIN, no
    RST) and one of its waits is woken, so that its reply is never acknowledged (keepalive does
    not probe while data is in flight: the user timeout ends that one). The first two servers
    close all three connections (one warning each, naming the peer), dropping its key and
    waiters within their bounds; the third keeps them (the defect this detection removes)."""
    bounds = {"fast": 3.0, "default": 16.0}
    options = {"fast": FAST_KEEPALIVE, "default": (), "off": ("--keepalive-idle-ms", "0")}
    with netfaults.node(6) as n:
        servers: dict[str, tuple[subprocess.Popen[str], int]] = {}
        holder: subprocess.Popen[str] | None = None
        stores: dict[str, elasticstore.Store] = {}
        try:
            for name, opts in options.items():
                servers[name] = _start_server(n.root_addr, options=opts)
            holder = subprocess.Popen([*n.prefix(), sys.executable, "-c", SESSION_HOLDER,
                                       n.root_addr, *(str(port) for _, port in servers.values())],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert holder.stdout is not None
            line = holder.stdout.readline()  # bounded by the test timeout
            assert line == "bound\n", (line, holder.stderr.read() if holder.stderr else "")
            key = {name: f"eph/{port}" for name, (_, port) in servers.items()}
            for name, (_, port) in servers.items():
                stores[name] = elasticstore.Store(n.root_addr, port, timeout=timedelta(seconds=10))
                assert stores[name].check([key[name]])
                _until(lambda st=stores[name]: st.stats()["waiters"] == 2, 10)
            cut, t0 = n.partition(), time.monotonic()
            for store in stores.values():
                store.set("wake", "1")  # the reply to its wait goes out after the cut
            gone: dict[str, float] = {}  # both of the client's connections closed, key gone

            def closed(name: str) -> bool:
                stats = stores[name].stats()
                return (stats["connections"], stats["waiters"], stats["keys"]) == (1, 0, 1)

            while len(gone) < len(bounds) and time.monotonic() - t0 < max(bounds.values()) + 10:
                for name in bounds:
                    if name not in gone and closed(name):
                        gone[name] = time.monotonic() - t0
                time.sleep(0.02)
            held = time.monotonic() - t0
            assert set(gone) == set(bounds), f"keys still held {held:.1f}s after the cut: {gone}"
            for name in bounds:
                assert not stores[name].check([key[name]])
                assert stores[name].stats()["connections_closed_peer_lost"] == 3, name
                assert gone[name] < bounds[name] + 1.5, (name, gone)
            assert gone["fast"] < gone["default"]
            off = stores["off"].stats()
            assert stores["off"].check([key["off"]]), "keepalive off: the key must still be held"
            assert (off["connections"], off["waiters"], off["connections_closed_peer_lost"]) == (
                4, 1, 0), off
            for store in stores.values():
                store.close()
            stores.clear()
            logs = {}
            for name, (proc, _) in servers.items():
                proc.send_signal(signal.SIGTERM)
                logs[name] = proc.communicate(timeout=30)[1]
            for name in bounds:
                lost = [line for line in logs[name].splitlines() if "peer unreachable" in line]
                assert len(lost) == 3 and all(f"closing connection {n.addr}:" in line
                                              for line in lost), logs[name]
            assert "peer unreachable" not in logs["off"], logs["off"]
            print(f"\nclient's link cut (no FIN/RST): its session key, waiter and unacknowledged "
                  f"reply gone after "
                  f"{gone['fast']:.2f}s (keepalive 1 s idle + 2 x 1 s probes: bound 3 s), "
                  f"{gone['default']:.2f}s (default 10 s + 3 x 2 s: bound 16 s); keepalive off: "
                  f"still held after {held:.1f}s")
            print("  " + lost[0].strip())
        finally:
            for store in stores.values():
                store.close()
            if holder is not None:
                _stop(holder)
            for proc, _ in servers.values():
                _stop(proc)
