"""``--rdzv-conf token_file=PATH``: the rendezvous, each round's worker store and the workers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

import elasticstore  # noqa: F401  (registers the rendezvous backends)
from elasticstore import AuthenticationError, Store

TOKEN = "rdzv-s3cret"
SHORT = timedelta(seconds=5)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _params(endpoint: str, addr: str, **conf: Any) -> RendezvousParameters:
    return RendezvousParameters("elasticstore", endpoint, "tokjob", 2, 2, addr, **conf)


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(autouse=True)
def _no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTICSTORE_TOKEN", raising=False)
    monkeypatch.delenv("ELASTICSTORE_TOKEN_FILE", raising=False)


def test_two_nodes_rendezvous_and_worker_store_require_the_token(token_file: str) -> None:
    port = _free_port("127.0.0.2")
    endpoint = f"127.0.0.2:{port}"
    handlers = [
        get_rendezvous_handler(_params(endpoint, addr, token_file=token_file,
                                       last_call_timeout=0.2, join_timeout=30))
        for addr in ("127.0.0.2", "127.0.0.3")
    ]
    try:
        # The rendezvous server refuses a client without the token, serves one with it.
        with pytest.raises(AuthenticationError):
            Store("127.0.0.2", port, token="", timeout=SHORT, connect_timeout=SHORT).get("x")
        with Store("127.0.0.2", port, token=TOKEN, timeout=SHORT) as st:
            st.set("probe", "1")
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        assert sorted(i.rank for i in infos) == [0, 1]
        boot = infos[0].bootstrap_store_info
        assert boot is not None and boot.master_addr == "127.0.0.2"
        infos[0].store.set("k", "v")
        assert infos[1].store.get("k") == b"v"
        # The round's worker store requires the same token ...
        with pytest.raises(AuthenticationError):
            Store(boot.master_addr, boot.master_port, token="", timeout=SHORT,
                  connect_timeout=SHORT).get("k")
        with Store(boot.master_addr, boot.master_port, token=TOKEN, timeout=SHORT) as st:
            assert st.get("k") == b"v"
        # ... and vouches for the round's members' hosts for torch's TCPStore clients.
        host = next(h for h, i in zip(handlers, infos) if i.rank == 0)
        server = host._worker_server  # type: ignore[attr-defined]
        assert server is not None and server.requires_token
        assert sorted(server.allowed_peers()) == ["127.0.0.2/32", "127.0.0.3/32"]
        # The operator commands reach a token-protected rendezvous with --token-file.
        status = [sys.executable, "-m", "elasticstore.cli", "status", "--addr", endpoint,
                  "--rdzv-id", "tokjob", "--json", "--timeout", "5"]
        ok = subprocess.run([*status, "--token-file", token_file], capture_output=True,
                            text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        assert "127.0.0.3" in ok.stdout
        refused = subprocess.run(status, capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "token" in refused.stderr.lower(), refused.stderr
    finally:
        for h in reversed(handlers):
            h.shutdown()


def test_static_backend_with_token_vouches_for_each_node(token_file: str) -> None:
    port = _free_port("127.0.0.2")
    endpoint = f"127.0.0.2:{port}"
    handlers = [
        get_rendezvous_handler(RendezvousParameters(
            "elasticstore-static", endpoint, "tokjob", 2, 2, addr, rank=rank,
            join_timeout=30, token_file=token_file))
        for rank, addr in ((0, "127.0.0.2"), (1, "127.0.0.3"))
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        infos[0].store.set("k", "v")
        assert infos[1].store.get("k") == b"v"
        with pytest.raises(AuthenticationError):
            Store("127.0.0.2", port, token="", timeout=SHORT, connect_timeout=SHORT).get("k")
        server = handlers[0]._server  # type: ignore[attr-defined]
        assert server is not None and server.requires_token
        assert sorted(server.allowed_peers()) == ["127.0.0.2/32", "127.0.0.3/32"]
    finally:
        for h in reversed(handlers):
            h.shutdown()


def test_members_allowed_peers_serve_torch_clients_from_members_only() -> None:
    # The list the handler hands the server, on a server that does not treat loopback as this
    # machine, so that 127.0.0.x source addresses stand for other hosts (as tests/stores/test_auth.py).
    from elasticstore import StoreServer
    from elasticstore.rendezvous.worker_store import member_addrs
    from elasticstore.rendezvous.state import RoundState

    state = RoundState(3, ("127.0.0.2-10-0", "127.0.0.3-11-0", "127.0.0.3-12-1"))
    assert member_addrs(state) == ["127.0.0.2", "127.0.0.3"]
    with StoreServer("127.0.0.1", 0, token=TOKEN, allow_loopback=False) as srv:
        srv.set_allowed_peers(member_addrs(state))

        def served(source: str) -> bool:
            with socket.socket() as sock:
                sock.settimeout(10)
                sock.bind((source, 0))
                sock.connect(("127.0.0.1", srv.port))
                sock.sendall(b"\x00" + (0x3C85F7CE).to_bytes(4, "little") + b"\x07")
                try:
                    return len(sock.recv(8)) > 0
                except (ConnectionResetError, TimeoutError):
                    return False

        assert served("127.0.0.3")
        assert not served("127.0.0.9")


def test_torch_client_without_token_cannot_stop_a_job_over_loopback(
    token_file: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """A local process with torch's own TCPStore client (which cannot carry the token) is
    refused by a token-protected rendezvous server even over loopback: it reads no key and
    cannot write ``ctl/closed``, and the job's rendezvous completes."""
    import torch.distributed as dist

    port = _free_port("127.0.0.1")
    endpoint = f"127.0.0.1:{port}"
    handlers = [
        get_rendezvous_handler(_params(endpoint, "127.0.0.1", token_file=token_file,
                                       last_call_timeout=0.2, join_timeout=30))
        for _ in range(2)
    ]
    try:
        intruded = []
        try:
            intruder = dist.TCPStore("127.0.0.1", port, is_master=False,
                                     timeout=timedelta(seconds=5))
            intruder.set("rdzv/tokjob/ctl/closed", '{"reason": "stopped by an intruder"}')
            intruded.append(intruder.check(["rdzv/tokjob/ctl/closed"]))
        except (RuntimeError, dist.DistError):
            pass
        with ThreadPoolExecutor(2) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        assert not intruded
        assert sorted(i.rank for i in infos) == [0, 1]
        assert not any(h.is_closed() for h in handlers)
        err = capfd.readouterr().err
        assert "torch TCPStore client refused" in err and "serves only native clients" in err
    finally:
        for h in reversed(handlers):
            h.shutdown()


def _torch_validate_served(port: int) -> bool:
    """Whether the server answers torch's VALIDATE + GET_NUM_KEYS on a loopback connection."""
    with socket.socket() as sock:
        sock.settimeout(10)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"\x00" + (0x3C85F7CE).to_bytes(4, "little") + b"\x07")
        try:
            return len(sock.recv(8)) > 0
        except (ConnectionResetError, TimeoutError):
            return False


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_worker_store_serves_torch_clients_of_its_own_user_only_on_loopback() -> None:
    """On a shared host, another local user's process with torch's client is refused by the
    round's worker store; the job's own processes (same user) are served."""
    from elasticstore.rendezvous.state import RoundState
    from elasticstore.rendezvous.worker_store import host_worker_store

    server = host_worker_store("127.0.0.1", RoundState(1, ("127.0.0.1-10-0",)), TOKEN)
    try:
        assert _torch_validate_served(server.port)
        pid = os.fork()
        if pid == 0:  # another user on the same host
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                code = 1 if _torch_validate_served(server.port) else 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "another user's torch client was served"
    finally:
        server.close()


def test_allowed_peers_are_single_hosts() -> None:
    """Vouching at run time names hosts; a range (up to every address) is the operator's."""
    from elasticstore import StoreServer

    with StoreServer(token=TOKEN) as srv, Store(srv.host, srv.port, token=TOKEN) as st:
        for wide in ("0.0.0.0/0", "::/0", "10.0.0.0/8"):
            with pytest.raises(ValueError, match="range"):
                srv.allow_peer(wide)
            with pytest.raises(elasticstore.StoreError, match="range"):
                st.allow_peers([wide])
        srv.set_allowed_peers(["10.1.2.3", "fd00::1", "10.1.2.4/32"])
        assert sorted(srv.allowed_peers()) == ["10.1.2.3/32", "10.1.2.4/32", "fd00::1/128"]


def test_bad_token_file_is_refused_naming_the_key(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, reason in ((tmp_path / "missing", "No such file"), (empty, "empty")):
        with pytest.raises(ValueError, match=f"token_file=.*{reason}"):
            get_rendezvous_handler(_params("127.0.0.1:1", "127.0.0.1", token_file=str(path)))


def test_bad_token_file_refused_by_elasticstore_run(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text("print('never')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "elasticstore.run", "--standalone", "--nproc-per-node", "1",
         "--rdzv-conf", f"token_file={tmp_path / 'missing'}", str(script)],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )
    assert proc.returncode != 0
    assert "token_file" in proc.stderr and "No such file" in proc.stderr
    assert "never" not in proc.stdout


# The start of both worker scripts: the round's store refuses a client without the token.
REFUSES_WITHOUT_TOKEN = textwrap.dedent("""
    import os
    from datetime import timedelta
    import torch.distributed as dist
    from elasticstore import AuthenticationError, Store

    try:  # the round's store requires the token
        Store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), token="",
              timeout=timedelta(seconds=5)).get("x")
        raise SystemExit("the round's store served a client without the token")
    except AuthenticationError:
        pass
""")
WORKER = REFUSES_WITHOUT_TOKEN + textwrap.dedent("""
    assert "ELASTICSTORE_TOKEN" not in os.environ
    assert os.environ["ELASTICSTORE_TOKEN_FILE"] == os.environ["EXPECTED_TOKEN_FILE"]
    rank = int(os.environ["RANK"])
    with Store.from_env() as st:
        st.add("ranks", 1)
        st.set(f"w{rank}", "ok")
        st.wait([f"w{1 - rank}"])
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
    print(f"worker {rank} ok", flush=True)
""")


def test_elasticstore_run_workers_use_the_token_file(tmp_path: Path, token_file: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, EXPECTED_TOKEN_FILE=token_file)
    port = _free_port("127.0.0.1")
    proc = subprocess.run(
        [sys.executable, "-m", "elasticstore.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--rdzv-backend", "elasticstore", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--local-addr", "127.0.0.1", "--rdzv-id", "tokrun",
         "--rdzv-conf", f"token_file={token_file}", str(script)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "worker 0 ok" in out and "worker 1 ok" in out
    assert TOKEN not in out


TORCHRUN_WORKER = REFUSES_WITHOUT_TOKEN + textwrap.dedent("""
    rank = int(os.environ["RANK"])
    # torchrun's agent: the workers inherit ELASTICSTORE_TOKEN_FILE from torchrun's environment.
    with Store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])) as st:
        st.set(f"tw{rank}", "ok")
        st.wait([f"tw{1 - rank}"])
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
    print(f"worker {rank} ok", flush=True)
""")


def test_torchrun_plugin_with_token_file(tmp_path: Path, token_file: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(TORCHRUN_WORKER)
    env = dict(os.environ, ELASTICSTORE_TOKEN_FILE=token_file, OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo")
    port = _free_port("127.0.0.1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
         "--rdzv-backend=elasticstore", f"--rdzv-endpoint=127.0.0.1:{port}",
         "--local-addr=127.0.0.1", "--rdzv-id=tokrun", "--monitor-interval=0.1",
         f"--rdzv-conf=token_file={token_file},last_call_timeout=0.2", str(script)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "worker 0 ok" in out and "worker 1 ok" in out
