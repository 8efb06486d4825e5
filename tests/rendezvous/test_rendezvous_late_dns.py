"""An ``--rdzv-endpoint`` host whose name resolves late (a Kubernetes Service or pod DNS name,
pods starting in any order) is looked up again until ``join_timeout``, not a crash; a name that
never resolves ends with a clear error naming the host and the time waited."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

import elasticstore  # noqa: F401  (registers the rendezvous backends)

RUN = os.path.join(os.path.dirname(sys.executable), "elasticstore-run")
NAME = "late-rdzv.elasticstore.test"


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _script(tmp_path: Path) -> str:
    script = tmp_path / "hello.py"
    script.write_text("print('worker ran', flush=True)\n")
    return str(script)


def _can_unshare_mount() -> str | None:
    """None when this process may bind-mount over /etc/hosts in a mount namespace, else why not."""
    if os.geteuid() != 0:
        return "needs root (unshare --mount, a bind mount over /etc/hosts)"
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare(1) and mount(8)"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=10)
    if probe.returncode != 0:
        return f"unshare --mount refused: {probe.stderr.decode(errors='replace').strip()}"
    return None


def test_endpoint_name_that_resolves_late_is_waited_for(tmp_path: Path) -> None:
    why = _can_unshare_mount()
    if why is not None:
        pytest.skip(why)
    try:
        socket.getaddrinfo(NAME, None)
        pytest.skip(f"{NAME} resolves already on this machine")
    except socket.gaierror:
        pass
    hosts = tmp_path / "hosts"
    shutil.copyfile("/etc/hosts", hosts)
    endpoint = f"{NAME}:{_free_port()}"
    # In a private mount namespace /etc/hosts is the temporary copy. The name is appended to it
    # (in place: the bind mount shows the same file) once the launcher said it waits for it.
    shell = 'mount --bind "$1" /etc/hosts && shift && exec "$@"'
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell, "sh", str(hosts),
           RUN, "--nnodes", "1", "--rdzv-backend", "elasticstore", "--rdzv-endpoint", endpoint,
           "--rdzv-id", "late-dns", "--rdzv-conf", "join_timeout=30", _script(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends at the launcher's exit (join_timeout 30 s bounds it)
            lines.append(line)
            if "does not resolve yet" in line:
                time.sleep(1)
                with open(hosts, "a") as f:
                    f.write(f"127.0.0.1 {NAME}\n")
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert out.count("does not resolve yet") == 1, out  # one line while waiting
    assert "worker ran" in out, out


@pytest.mark.parametrize("backend", ["elasticstore", "elasticstore-etcd"])
def test_endpoint_name_that_never_resolves_fails_naming_host_and_wait(
        tmp_path: Path, backend: str) -> None:
    if backend == "elasticstore-etcd":
        pytest.importorskip("grpc", reason="the elasticstore[etcd] extra")
        hosts = ["never-resolves.invalid", "nor-this.invalid"]  # RFC 2606: never in DNS
    else:
        hosts = ["never-resolves.invalid"]
    endpoint = ",".join(f"{h}:2379" for h in hosts)
    proc = subprocess.run(
        [RUN, "--nnodes", "1", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
         "--rdzv-id", "never-dns", "--rdzv-conf", "join_timeout=1.5", _script(tmp_path)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    named = ", ".join(repr(h) for h in hosts)
    assert f"rendezvous endpoint host{'s' if len(hosts) > 1 else ''} {named} did not resolve " \
        "within" in proc.stderr, proc.stderr
    assert "(join_timeout 1.5s)" in proc.stderr
    assert proc.stderr.count("not resolve yet") == 1, proc.stderr
    assert "worker ran" not in proc.stdout


def test_node_started_before_the_host_waits_for_its_server_up_to_join_timeout() -> None:
    """Pods start in any order: a node whose endpoint resolves but whose host's server is not up
    yet (its pod still pulling the image) waits for it past store_timeout, up to join_timeout."""
    port = _free_port("127.0.0.2")

    def params(addr: str) -> RendezvousParameters:
        return RendezvousParameters("elasticstore", f"127.0.0.2:{port}", "late-host", 2, 2, addr,
                                    store_timeout=1, join_timeout=30, last_call_timeout=0.2)

    handlers = []
    with ThreadPoolExecutor(2) as pool:
        early = pool.submit(get_rendezvous_handler, params("127.0.0.3"))
        try:
            time.sleep(3)  # three times store_timeout, and no server yet
            assert not early.done(), early.exception()
            handlers.append(get_rendezvous_handler(params("127.0.0.2")))  # the host, late
            handlers.append(early.result(timeout=30))
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
            assert sorted(i.rank for i in infos) == [0, 1]
        finally:
            if not handlers and not early.done():  # no host came: the wait ends at join_timeout
                handlers.append(get_rendezvous_handler(params("127.0.0.2")))
                handlers.append(early.result(timeout=30))
            for h in reversed(handlers):
                h.shutdown()
