"""``elasticstore-server``: the server as a native executable, installed next to the console script."""

from __future__ import annotations

import os
import socket
import signal
import subprocess
import sysconfig
from collections.abc import Iterator
from datetime import timedelta

import spawned
import pytest
import torch.distributed as dist

from elasticstore import Store


def _binary() -> str:
    path = os.path.join(sysconfig.get_path("scripts"), "elasticstore-server")
    assert os.access(path, os.X_OK), f"{path} is not installed with the package"
    return path


def _run(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [_binary(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture
def daemon() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = _run("--host", "127.0.0.1", "--port", "0")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded by the test timeout
        assert line.startswith("elasticstore server listening on 127.0.0.1:"), line
        yield proc, int(line.strip().rsplit(":", 1)[1])
    finally:
        spawned.kill_all([proc])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serves_both_protocols_and_stops_on_signal(
    daemon: tuple[subprocess.Popen[str], int], sig: signal.Signals
) -> None:
    proc, port = daemon
    with Store("127.0.0.1", port, timeout=timedelta(seconds=10)) as store:
        store.set("k", "v")
        torch_client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, wait_for_workers=False,
            timeout=timedelta(seconds=10),
        )
        assert torch_client.get("k") == b"v"  # one key space for both protocols
        torch_client.set("t", "1")
        assert store.get("t") == b"1"
        del torch_client
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out == "" and err == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "argument --port: 70000 is not a port number (0..65535)"),
        (["--port", "x"], "argument --port: x is not a port number (0..65535)"),
        (["--port"], "argument --port: expected one argument"),
        (["--backlog", "-1"], "argument --backlog: -1 is not a backlog >= 0"),
        (["--max-connections", "0"], "argument --max-connections: 0 is not a connection count"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["--bogus"], "argument --bogus: unrecognized argument"),
    ],
)
def test_bad_flags_name_the_flag(argv: list[str], message: str) -> None:
    p = _run(*argv)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 2 and out == ""
    assert err.startswith(f"elasticstore-server: {message}"), err


def test_address_in_use_fails_cleanly(daemon: tuple[subprocess.Popen[str], int]) -> None:
    _, port = daemon
    p = _run("--port", str(port))
    out, err = p.communicate(timeout=30)
    assert p.returncode == 1 and out == ""
    assert err == f"elasticstore-server: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_help() -> None:
    p = _run("--help")
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and err == ""
    assert out.startswith("usage: elasticstore-server")


def _own_name_and_address() -> tuple[str, str] | None:
    """This machine's name and the address it resolves to, if that address can be bound here."""
    name = socket.gethostname()
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0]
        with socket.socket(family) as probe:
            probe.bind((sockaddr[0], 0))
    except OSError:
        return None
    return name, str(sockaddr[0])


def test_host_name_is_resolved_forward_once() -> None:
    found = _own_name_and_address()
    if found is None:
        pytest.skip("this machine's name does not resolve to an address it can bind")
    name, addr = found
    proc = _run("--host", name, "--port", "0")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        shown = f"[{addr}]" if ":" in addr else addr
        assert line.startswith(f"elasticstore server listening on {shown}:"), line
        port = int(line.strip().rsplit(":", 1)[1])
        with Store(addr, port, timeout=timedelta(seconds=10)) as store:
            store.set("k", "v")
    finally:
        spawned.kill_all([proc])


def test_unresolvable_host_names_the_flag() -> None:
    p = _run("--host", "no-such-host.invalid", "--port", "0")
    out, err = p.communicate(timeout=60)  # the lookup is bounded by 10 s
    assert p.returncode == 2 and out == ""
    assert err.startswith("elasticstore-server: argument --host: "), err
    assert "'no-such-host.invalid'" in err, err
