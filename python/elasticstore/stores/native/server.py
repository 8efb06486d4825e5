"""An in-process elasticstore server: the native event loop serving on its own thread."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from types import TracebackType

from ... import _C
from .token import resolve_token
from .server_limits import ServerLimits

__all__ = ["LOG_LEVELS", "ServerConfig", "ServerLimits", "StoreServer", "format_address", "resolve_host"]

LOG_LEVELS = ("debug", "info", "warning", "error", "off")
_RESOLVE_TIMEOUT = 60.0


def _is_numeric(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return True
        except OSError:
            pass
    return False


def resolve_host(host: str, timeout: float) -> str:
    """``host`` as a numeric address: itself when numeric, else the first address a forward
    lookup (``getaddrinfo``, never a reverse one) gives within ``timeout`` seconds. The lookup
    runs on a daemon thread, so a resolver that does not answer cannot hold the caller longer.
    Raises OSError naming the host."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if _is_numeric(bare):
        return bare
    result: list[str] = []
    failure: list[OSError] = []

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
            result.append(str(infos[0][4][0]))
        except OSError as exc:
            failure.append(exc)

    thread = threading.Thread(target=lookup, name=f"resolve {bare}", daemon=True)
    thread.start()
    thread.join(timeout)
    if failure:
        raise OSError(f"cannot resolve {bare!r}: {failure[0]}") from failure[0]
    if not result:
        raise OSError(f"cannot resolve {bare!r}: no answer from the resolver within {timeout:g} s")
    return result[0]


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (``[::1]:29400``)."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


@dataclass(frozen=True)
class ServerConfig:
    """The server's settings, parsed and checked once.

    ``port`` 0 picks a free port; ``backlog`` 0 uses ``/proc/sys/net/core/somaxconn``.
    """

    host: str = "127.0.0.1"
    port: int = 0
    backlog: int = 0
    max_connections: int = 65536
    log_level: str = "warning"
    token: str | None = field(default=None, repr=False)
    allow_unauthenticated_from: tuple[str, ...] = ()
    allowed_peers: tuple[str, ...] = ()
    allow_loopback: bool = True
    limits: ServerLimits = field(default_factory=ServerLimits)
    torch_protocol: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise TypeError(f"port must be an int, got {type(self.port).__name__}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is not a port number (0..65535)")
        if isinstance(self.backlog, bool) or not isinstance(self.backlog, int) or self.backlog < 0:
            raise ValueError(f"backlog must be an int >= 0 (0: somaxconn), got {self.backlog!r}")
        if (
            isinstance(self.max_connections, bool)
            or not isinstance(self.max_connections, int)
            or self.max_connections < 1
        ):
            raise ValueError(f"max_connections must be an int >= 1, got {self.max_connections!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        object.__setattr__(self, "allow_unauthenticated_from", tuple(self.allow_unauthenticated_from))
        object.__setattr__(self, "allowed_peers", tuple(self.allowed_peers))


class StoreServer:
    """The native store server, serving on a background thread of this process.

    ``host`` is a numeric address (``0.0.0.0`` or ``::`` for every interface) or a name, resolved
    forward within ``resolve_timeout`` seconds; the first address it resolves to is bound. The
    constructor binds, listens and starts serving, so ``port`` is known (and address errors are
    raised) at once::

        with StoreServer(port=0) as server:
            store = elasticstore.Store(server.host, server.port)

    ``token`` (docs/authentication.md): ``None`` reads ``ELASTICSTORE_TOKEN_FILE``, else
    ``ELASTICSTORE_TOKEN``; ``""`` means none. With a token, native clients must prove it, and
    torch's TCPStore protocol is served only to loopback processes of this process's user
    (``allow_loopback``), the ``allowed_peers`` (see :meth:`allow_peer`) and the
    ``allow_unauthenticated_from`` CIDRs; ``torch_protocol=False`` refuses it from everyone (a
    server only native clients use, such as a rendezvous server).
    Binding a non-loopback address without a token logs one warning. ``limits`` sets the
    server's bounds (key and value sizes, buffers, stored keys and bytes, timeouts, and how fast a
    peer gone without FIN/RST is closed with its session keys: TCP keepalive, 16 s by default; see
    :class:`ServerLimits`); a value out of range raises ``ValueError`` naming it.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        backlog: int = 0,
        max_connections: int = 65536,
        log_level: str = "warning",
        resolve_timeout: timedelta | float = _RESOLVE_TIMEOUT,
        token: str | None = None,
        allow_unauthenticated_from: Iterable[str] = (),
        allowed_peers: Iterable[str] = (),
        allow_loopback: bool = True,
        limits: ServerLimits | None = None,
        torch_protocol: bool = True,
    ) -> None:
        self._config = ServerConfig(
            host,
            port,
            backlog,
            max_connections,
            log_level,
            token,
            tuple(allow_unauthenticated_from),
            tuple(allowed_peers),
            allow_loopback,
            limits or ServerLimits(),
            torch_protocol,
        )
        self._server: _C.Server | None = None
        if isinstance(resolve_timeout, timedelta):
            resolve_timeout = resolve_timeout.total_seconds()
        server = _C.Server(
            resolve_host(host, resolve_timeout),
            port,
            backlog=backlog,
            max_connections=max_connections,
            log_level=log_level,  # type: ignore[arg-type]  # checked by ServerConfig
            token=resolve_token(token),
            allow_unauthenticated_from=list(self._config.allow_unauthenticated_from),
            allowed_peers=list(self._config.allowed_peers),
            allow_loopback=allow_loopback,
            torch_protocol=torch_protocol,
            **self._config.limits.as_kwargs(),
        )
        server.start()
        self._server = server
        self._host = server.host
        self._port = server.port

    @classmethod
    def from_config(cls, config: ServerConfig) -> StoreServer:
        kwargs = asdict(config)
        kwargs["limits"] = config.limits  # asdict turned it into a dict
        return cls(**kwargs)

    @property
    def config(self) -> ServerConfig:
        """The settings asked for (``port`` may be 0; see :attr:`port` for the bound one)."""
        return self._config

    @property
    def host(self) -> str:
        """The numeric address bound."""
        return self._host

    @property
    def port(self) -> int:
        """The port bound (never 0)."""
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` (IPv6 hosts in brackets)."""
        return format_address(self._host, self._port)

    @property
    def running(self) -> bool:
        return self._server is not None and self._server.running

    def stats(self) -> dict[str, int]:
        """Server counters (``connections``, ``keys``, ``waiters``, ``revision``, ...)."""
        if self._server is None:
            raise RuntimeError(f"{self!r} is closed")
        return dict(self._server.stats())

    @property
    def requires_token(self) -> bool:
        """Whether native clients must prove a token (and torch's protocol is restricted)."""
        return self._live().requires_token

    def allow_peer(self, addr: str) -> None:
        """Lets ``addr`` (one host's address) use torch's TCPStore protocol when the server has
        a token. Raises ``ValueError`` when it does not parse or is a range (ranges are the
        operator's: ``allow_unauthenticated_from``)."""
        self._live().allow_peer(addr)

    def set_allowed_peers(self, addrs: Iterable[str]) -> None:
        """Replaces the peers allowed by :meth:`allow_peer` (not the operator's CIDRs)."""
        self._live().set_allowed_peers(list(addrs))

    def allowed_peers(self) -> list[str]:
        """The peers allowed by :meth:`allow_peer`, as CIDRs."""
        return self._live().allowed_peers()

    def _live(self) -> _C.Server:
        if self._server is None:
            raise RuntimeError(f"{self!r} is closed")
        return self._server

    def close(self) -> None:
        """Stops serving, closes every connection and joins the thread. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "closed"
        return f"StoreServer({self.address}, {state})"
