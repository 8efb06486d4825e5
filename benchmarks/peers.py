"""The peers the benchmarks compare, and how their servers and clients are started.

A peer is a row of the report: a name, how to start its server (always a separate process, so
the server never shares a GIL or a core budget with the measuring client), how to connect a
client, and which barriers it offers. Later rows (torch's TCPStore client against our server,
EtcdStore on etcd) plug in by adding a ``Peer`` to ``PEERS``.

Run as a script it hosts servers for the benchmarks:
    python peers.py tcpstore-server   torch's TCPStore master, libuv server
    python peers.py native-server     elasticstore's _C.Server without torch (memory baseline)
Both print "<what> listening on HOST:PORT" and exit when stdin closes.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

HOST = "127.0.0.1"  # all traffic stays on loopback
HERE = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------------- processes

_SERVERS: list["ServerProc"] = []
_CHILDREN: set[int] = set()


def set_pdeathsig() -> None:
    """The calling process gets SIGKILL when its parent dies (no orphans after a crash)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def cleanup() -> None:
    """Kills every child and server this process started. Idempotent."""
    for pid in list(_CHILDREN):
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        _CHILDREN.discard(pid)
    for srv in list(_SERVERS):
        srv.close()


_MAIN_PID = os.getpid()


def _on_exit() -> None:
    if os.getpid() == _MAIN_PID:
        cleanup()


atexit.register(_on_exit)


def _on_sigterm(signum, frame):  # turn SIGTERM into a normal exit so finally/atexit run
    raise SystemExit(128 + signum)


def install_sigterm_handler() -> None:
    """Called by report.py and conftest.py (the measuring process), not by server hosts."""
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        pass


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """On-CPU time of every live thread of pid (/proc/PID/task/*/schedstat, nanoseconds)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


@dataclass
class ServerProc:
    """A store server running in its own process."""

    host: str
    port: int
    proc: subprocess.Popen
    what: str
    out: Any = None  # temporary files holding its stdout and stderr
    err: Any = None

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            self.err.seek(0)
            return self.err.read().decode(errors="replace")[-n:]
        except (OSError, ValueError, AttributeError):
            return ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process so far (all its threads)."""
        return cpu_seconds(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
            except OSError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.out, self.err):
            try:
                if f:
                    f.close()
            except OSError:
                pass
        if self in _SERVERS:
            _SERVERS.remove(self)


def start_server_process(argv: list[str], what: str, timeout: float = 60.0) -> ServerProc:
    """Starts argv, waits for "... listening on HOST:PORT" on its stdout. Output goes to
    temporary files (a pipe nobody reads would block a chatty server)."""
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=out, stderr=err, preexec_fn=set_pdeathsig,
        cwd="/",  # never import a source tree by accident
    )
    srv = ServerProc(HOST, 0, proc, what, out, err)
    _SERVERS.append(srv)
    deadline = time.monotonic() + timeout
    try:
        while True:
            out.seek(0)
            text = out.read().decode(errors="replace")
            line = next((x for x in text.splitlines() if "listening on" in x), None)
            if line:
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{what}: no 'listening on' line (exit {proc.poll()}); "
                                   f"stdout {text[-500:]!r}; stderr {srv.stderr_tail()!r}")
            time.sleep(0.02)
    except BaseException:
        srv.close()
        raise
    hostport = line.strip().rsplit(" ", 1)[-1]
    host, port = hostport.rsplit(":", 1)
    srv.host = host.strip("[]")
    srv.port = int(port)
    return srv


# --------------------------------------------------------------------------------- store servers


def start_tcpstore_server() -> ServerProc:
    return start_server_process(
        [sys.executable, os.path.join(HERE, "peers.py"), "tcpstore-server"], "torch TCPStore (libuv)"
    )


def start_elasticstore_server() -> ServerProc:
    """`elasticstore server`, the CLI a user runs (console-script shebangs may point elsewhere,
    so the entry point is called with this interpreter)."""
    code = "import sys; from elasticstore.cli import main; sys.exit(main())"
    return start_server_process(
        [sys.executable, "-c", code, "server", "--host", HOST, "--port", "0"], "elasticstore server"
    )


def start_native_server() -> ServerProc:
    """elasticstore's _C.Server in a torch-free Python process: the server's own memory."""
    return start_server_process(
        [sys.executable, os.path.join(HERE, "peers.py"), "native-server"], "elasticstore _C.Server"
    )


def load_native():
    """elasticstore._C without importing elasticstore (and so torch): for light processes."""
    mod = sys.modules.get("elasticstore._C")
    if mod is not None:
        return mod
    if "torch" in sys.modules:
        from elasticstore import _C

        return _C
    spec = importlib.util.find_spec("elasticstore")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("elasticstore is not installed")
    for loc in spec.submodule_search_locations:
        for path in glob.glob(os.path.join(loc, "_C*.so")):
            s = importlib.util.spec_from_file_location("elasticstore._C", path)
            mod = importlib.util.module_from_spec(s)
            s.loader.exec_module(mod)
            return mod
    raise ImportError("elasticstore._C not found")


# ------------------------------------------------------------------------------------ clients


def connect_tcpstore(host: str, port: int, timeout: float):
    from torch.distributed import TCPStore

    return TCPStore(
        host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )


def connect_elasticstore(host: str, port: int, timeout: float):
    import elasticstore

    return elasticstore.Store(host, port, timeout=timedelta(seconds=timeout))


def connect_native(host: str, port: int, timeout: float):
    """elasticstore's _C.Client: no torch.distributed.Store adapter in the path."""
    return load_native().Client(host, port, connect_timeout=timeout)


def store_based_barrier(store, key: str, world_size: int, timeout: float) -> None:
    """torch's own store-based barrier (torch.distributed.elastic.utils.store.barrier): add a
    counter, the last arrival sets a key, everyone waits for it."""
    from torch.distributed.elastic.utils.store import barrier

    barrier(store, world_size, key_prefix=key, barrier_timeout=timeout)


def native_barrier(store, key: str, world_size: int, timeout: float) -> None:
    store.barrier(key, world_size, timeout)


# ------------------------------------------------------------------------------- availability


def _elasticstore_missing() -> Optional[str]:
    try:
        import elasticstore
        from elasticstore import _C  # noqa: F401
    except Exception as e:  # placeholder build, not installed, ...
        return f"elasticstore not importable: {type(e).__name__}: {e}"
    for name in ("Store", "StoreServer"):
        if not hasattr(elasticstore, name):
            return f"elasticstore.{name} missing"
    return None


def _torch_missing() -> Optional[str]:
    try:
        from torch.distributed import TCPStore  # noqa: F401
    except Exception as e:
        return f"torch.distributed.TCPStore not importable: {e}"
    return None


def _etcd_missing() -> Optional[str]:
    try:
        import elasticstore.etcd_store  # noqa: F401
    except Exception as e:
        return f"EtcdStore not available yet ({type(e).__name__})"
    if not shutil.which("etcd"):
        return "no etcd binary on PATH"
    return "EtcdStore row not wired yet"  # TODO: start etcd on loopback, connect EtcdStore


# ---------------------------------------------------------------------------------- the peers


@dataclass(frozen=True)
class Peer:
    name: str
    description: str  # what is measured, in one line (shown in the report)
    start_server: Callable[[], ServerProc]
    connect: Callable[[str, int, float], Any]  # -> a torch.distributed.Store-like client
    missing: Callable[[], Optional[str]]  # None when usable, else why not
    barriers: dict = field(default_factory=dict)  # name -> fn(store, key, n, timeout)
    ops: tuple = ("set", "get", "add", "compare_set", "check", "multi_get", "wait")
    start_light_server: Optional[Callable[[], ServerProc]] = None  # torch-free, for memory
    native_api: bool = False  # the client is _C.Client (get/wait/multi_get take a timeout)
    measure_memory: bool = True  # False when the server is another row's


_ALL_OPS = ("set", "get", "try_get", "add", "compare_set", "check", "multi_get", "wait")

PEERS: dict[str, Peer] = {
    p.name: p
    for p in [
        Peer(
            "elasticstore",
            "elasticstore.Store (native protocol) -> `elasticstore server` subprocess",
            start_elasticstore_server,
            connect_elasticstore,
            _elasticstore_missing,
            {"native": native_barrier, "store-based": store_based_barrier},
            _ALL_OPS,
            start_native_server,
        ),
        Peer(
            "elasticstore/_C",
            "elasticstore._C.Client (no Store adapter) -> `elasticstore server` subprocess",
            start_elasticstore_server,
            connect_native,
            _elasticstore_missing,
            {"native": native_barrier},
            _ALL_OPS,
            measure_memory=False,
            native_api=True,
        ),
        Peer(
            "tcpstore",
            "torch TCPStore client -> TCPStore(is_master=True, use_libuv=True) subprocess",
            start_tcpstore_server,
            connect_tcpstore,
            _torch_missing,
            {"store-based": store_based_barrier},
        ),
        Peer(
            "tcpstore->elasticstore",
            "torch TCPStore client -> `elasticstore server` (TCPStore-compatible codec)",
            start_elasticstore_server,
            connect_tcpstore,
            _elasticstore_missing,
            {"store-based": store_based_barrier},
            measure_memory=False,
        ),
        Peer(
            "etcd",
            "elasticstore.EtcdStore -> etcd v3 on loopback",
            start_elasticstore_server,  # placeholder until the etcd row is wired
            connect_elasticstore,
            _etcd_missing,
            {"store-based": store_based_barrier},
        ),
    ]
}
BASELINE = "tcpstore"  # ratios are to this peer


def missing(name: str) -> Optional[str]:
    return PEERS[name].missing()


def probe(peer: Peer, timeout: float = 2.0) -> Optional[str]:
    """Starts the peer's server, connects, does a set and a get. None when that works, else
    the error (with the server's last log line)."""
    srv = peer.start_server()
    try:
        store = peer.connect(srv.host, srv.port, timeout)
        store.set("probe", b"1")
        got = store.get("probe", timeout) if peer.native_api else store.get("probe")
        if got != b"1":
            return f"probe: get returned {got!r}"
        return None
    except Exception as e:
        tail = srv.stderr_tail().strip().splitlines()
        last = f" (server log: {tail[-1]})" if tail else ""
        msg = str(e).strip().splitlines()
        return f"{type(e).__name__}: {msg[-1] if msg else ''}{last}"
    finally:
        srv.close()


# ------------------------------------------------------------------------------- server hosts


def _serve_until_stdin_closes(what: str, port: int) -> None:
    print(f"{what} listening on {HOST}:{port}", flush=True)
    try:
        sys.stdin.buffer.read()
    except KeyboardInterrupt:
        pass


def main(argv: list[str]) -> int:
    set_pdeathsig()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if argv[:1] == ["tcpstore-server"]:
        from torch.distributed import TCPStore

        store = TCPStore(
            HOST, 0, is_master=True, use_libuv=True, wait_for_workers=False,
            timeout=timedelta(seconds=600),
        )
        _serve_until_stdin_closes("tcpstore server", store.port)
        return 0
    if argv[:1] == ["native-server"]:
        _C = load_native()
        server = _C.Server(HOST, 0)
        server.start()
        _serve_until_stdin_closes("elasticstore _C.Server", server.port)
        server.stop()
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
