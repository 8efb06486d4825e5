"""The ``elasticstore`` command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import spawned
import pytest

from elasticstore import Store, cli


def _cli(*args: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "elasticstore.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,  # type: ignore[call-overload]
    )


def _start_server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = _cli("server", "--host", "127.0.0.1", "--port", "0")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded by the test timeout
        yield proc, line
    finally:
        spawned.kill_all([proc])


@pytest.fixture
def cli_server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A server this test may stop."""
    yield from _start_server()


@pytest.fixture(scope="module")
def shared_server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    yield from _start_server()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_server_prints_serves_and_stops_on_signal(
    cli_server: tuple[subprocess.Popen[str], str], sig: signal.Signals
) -> None:
    proc, line = cli_server
    assert line.startswith("elasticstore server listening on 127.0.0.1:"), line
    port = int(line.strip().rsplit(":", 1)[1])
    assert port > 0
    with Store("127.0.0.1", port) as store:
        store.set("k", "v")
        assert store.get("k") == b"v"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out == ""  # exactly the one line, read above


def test_client_commands(shared_server: tuple[subprocess.Popen[str], str]) -> None:
    _, line = shared_server
    addr = line.split()[-1]

    def start(*args: str) -> subprocess.Popen[str]:
        # --addr for most; the ELASTICSTORE_ADDR environment variable for ls.
        if args[0] == "ls":
            return _cli(*args, env=dict(os.environ, ELASTICSTORE_ADDR=addr))
        return _cli(*args, "--addr", addr)

    def finish(p: subprocess.Popen[str]) -> tuple[int, str, str]:
        out, err = p.communicate(timeout=60)
        return p.returncode, out, err

    assert finish(start("set", "cli/a", "hello"))[0] == 0
    get, missing, ls, status = (
        start("get", "cli/a"), start("get", "cli/missing"), start("ls", "cli/"), start("status")
    )
    assert finish(get)[:2] == (0, "hello\n")
    code, _, err = finish(missing)
    assert code == 1 and "cli/missing" in err
    assert finish(ls)[:2] == (0, "cli/a\n")
    code, out, _ = finish(status)
    assert code == 0
    stats = dict(line.split() for line in out.splitlines())
    assert int(stats["keys"]) >= 1 and "connections" in stats


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["server", "--port", "70000"], "argument --port: 70000 is not a port number (0..65535)"),
        (["server", "--port", "-1"], "argument --port: -1 is not a port number (0..65535)"),
        (["server", "--port", "http"], "argument --port: http is not a port number (0..65535)"),
        (["server", "--backlog", "-5"], "argument --backlog: -5 is not a backlog >= 0"),
        (["server", "--max-connections", "0"], "argument --max-connections: 0 is not"),
        (["server", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["get", "k", "--addr", "nohost"], "argument --addr: nohost is not HOST:PORT"),
        (["get", "k", "--addr", "h:99999"], "argument --addr: h:99999: 99999 is not a port"),
        ([], "required: COMMAND"),
    ],
)
def test_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_flag_exit_status_from_the_console_script() -> None:
    p = _cli("server", "--port", "70000")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2
    assert "elasticstore server: error: argument --port: 70000 is not a port number (0..65535)" in err


def test_server_address_in_use_fails_cleanly(
    shared_server: tuple[subprocess.Popen[str], str],
) -> None:
    _, line = shared_server
    port = line.strip().rsplit(":", 1)[1]
    p = _cli("server", "--port", port)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and out == ""
    # The last line is ours (torch may warn on import before it).
    last = err.strip().splitlines()[-1]
    assert last == f"elasticstore: cannot listen on 127.0.0.1:{port}: Address already in use", err
