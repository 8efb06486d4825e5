"""Authentication settings: the token from the environment (and its precedence), Store.from_env(),
and the server command lines' --token-file and --allow-unauthenticated-from."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from datetime import timedelta

import pytest

import elasticstore
from elasticstore import AuthenticationError, Store, StoreServer
from spawned import kill_all

TOKEN = "s3cret-token"
SHORT = timedelta(seconds=5)


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTICSTORE_TOKEN", raising=False)
    monkeypatch.delenv("ELASTICSTORE_TOKEN_FILE", raising=False)


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with StoreServer(token=TOKEN) as srv:
        yield srv


# ---- environment --------------------------------------------------------------------------------


def test_token_from_env_and_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    assert elasticstore.read_token_file(token_file) == TOKEN
    monkeypatch.setenv("ELASTICSTORE_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("ELASTICSTORE_TOKEN", "the-env-token")
    with StoreServer() as srv:  # the file wins over ELASTICSTORE_TOKEN
        assert srv.requires_token
        with Store(srv.host, srv.port, timeout=SHORT) as store:
            store.set("k", "v")
        with pytest.raises(AuthenticationError):
            Store(srv.host, srv.port, token="the-env-token", timeout=SHORT)  # explicit wins
    monkeypatch.delenv("ELASTICSTORE_TOKEN_FILE")
    with StoreServer() as srv, Store(srv.host, srv.port, timeout=SHORT) as store:
        store.set("k", "v")
        with pytest.raises(AuthenticationError):
            Store(srv.host, srv.port, token=TOKEN, timeout=SHORT)
    with StoreServer(token="") as srv:  # "" means none, whatever the environment
        assert not srv.requires_token
        Store(srv.host, srv.port, token="", timeout=SHORT).close()


def test_unreadable_or_empty_token_file(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("ELASTICSTORE_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(OSError):
        StoreServer()
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("ELASTICSTORE_TOKEN_FILE", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="empty"):
        StoreServer()


def test_store_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, server: StoreServer) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    monkeypatch.setenv("ELASTICSTORE_HOST", server.host)
    monkeypatch.setenv("ELASTICSTORE_PORT", str(server.port))
    monkeypatch.setenv("ELASTICSTORE_TIMEOUT", "5")
    monkeypatch.setenv("ELASTICSTORE_TOKEN_FILE", str(token_file))
    with Store.from_env() as store:
        assert store.timeout == SHORT
        store.set("k", "v")
    for bad in ("1e400", "-5", "0", "nan", "inf", "1e300", "soon"):
        monkeypatch.setenv("ELASTICSTORE_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"ELASTICSTORE_TIMEOUT='{bad}'"):
            Store.from_env()
    monkeypatch.setenv("ELASTICSTORE_TIMEOUT", "5")
    monkeypatch.setenv("ELASTICSTORE_PORT", "x")
    with pytest.raises(ValueError, match="ELASTICSTORE_PORT"):
        Store.from_env()
    monkeypatch.delenv("ELASTICSTORE_HOST")
    with pytest.raises(ValueError, match="ELASTICSTORE_HOST"):
        Store.from_env()


# ---- command lines ------------------------------------------------------------------------------


def _server_binary() -> list[str]:
    return [os.path.join(sysconfig.get_path("scripts"), "elasticstore-server")]


def _python_cli() -> list[str]:
    return [sys.executable, "-m", "elasticstore.cli", "server"]


@pytest.mark.parametrize("command", [_server_binary, _python_cli], ids=["elasticstore-server", "elasticstore-server-cli"])
def test_server_command_lines_take_a_token_file(command: object, tmp_path: pathlib.Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    argv = [*command(), "--port", "0", "--token-file", str(token_file),  # type: ignore[operator]
            "--allow-unauthenticated-from", "10.0.0.0/8", "--allow-unauthenticated-from", "fd00::/8"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("elasticstore server listening on 127.0.0.1:"), line
        port = int(line.strip().rsplit(":", 1)[1])
        with Store("127.0.0.1", port, token=TOKEN, timeout=SHORT) as store:
            store.set("k", "v")
        with pytest.raises(AuthenticationError):
            Store("127.0.0.1", port, token="", timeout=SHORT)
        cli = subprocess.run(
            [sys.executable, "-m", "elasticstore.cli", "get", "k", "--addr", f"127.0.0.1:{port}",
             "--token-file", str(token_file)],
            capture_output=True, text=True, timeout=60,
        )
        assert (cli.returncode, cli.stdout) == (0, "v\n"), cli.stderr
    finally:
        kill_all([proc])


@pytest.mark.parametrize("command", [_server_binary, _python_cli], ids=["elasticstore-server", "elasticstore-server-cli"])
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--token-file", "/nonexistent/token"], "/nonexistent/token"),
        (["--allow-unauthenticated-from", "10.0.0.0/99"], "--allow-unauthenticated-from"),
    ],
    ids=["missing-token-file", "bad-cidr"],
)
def test_server_command_lines_refuse_bad_auth_flags(command: object, args: list[str], message: str) -> None:
    proc = subprocess.run([*command(), "--port", "0", *args], capture_output=True, text=True, timeout=60)  # type: ignore[operator]
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
