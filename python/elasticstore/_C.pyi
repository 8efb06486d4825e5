"""Types for the native extension ``elasticstore._C`` (C++, pybind11).

``_C`` knows nothing of torch. Timeouts are seconds (float); a negative timeout waits forever;
``0`` does not block. Keys are ``str`` or ``bytes`` (``str`` is encoded as UTF-8); values are
``str`` or ``bytes``; values come back as ``bytes``. Every call that touches the network releases
the GIL.

Errors: until :func:`_set_error_types` is called, ``_C`` raises ``RuntimeError`` for store errors,
``TimeoutError`` for timeouts and ``ConnectionError`` for network failures. ``elasticstore``
registers its own classes (which subclass torch's ``DistStoreError``/``DistNetworkError``) at import.
"""

from typing import Literal, TypedDict

_Key = str | bytes
_Value = str | bytes

__version__: str
PROTOCOL_VERSION: int
MAX_KEY_BYTES: int
MAX_VALUE_BYTES: int
MAX_KEYS_PER_REQUEST: int
NO_TIMEOUT: float  # -1.0
MAX_TOKEN_BYTES: int
# The client's latency histogram: upper bounds in seconds (50 us to 60 s), and the outcomes.
CLIENT_CALL_BUCKETS: tuple[float, ...]
CLIENT_CALL_OUTCOMES: tuple[str, ...]  # ("ok", "timeout", "network", "error")

# The native protocol's operations (csrc/wire/ops.def), in opcode order: (name, opcode, kind). The
# name is the one calls are counted under ("connect" for HELLO, "compare_set", ...); the kind is
# "session" (opens a connection), "auth" (part of the handshake), "store" (a store operation) or
# "admin" (server administration).
OPS: tuple[tuple[str, int, Literal["session", "auth", "store", "admin"]], ...]

class _CallStats(TypedDict):
    op: str  # "set", "get", "compare_set", ..., "connect" (connecting, handshake included)
    calls: dict[str, int]  # by outcome, every one of CLIENT_CALL_OUTCOMES
    seconds: float  # total time of these calls
    buckets: list[int]  # per bucket, not cumulative; len(CLIENT_CALL_BUCKETS) + 1 (last: above)

def client_call_stats() -> list[_CallStats]:
    """Calls of every Client of this process so far, per operation called at least once (by
    opcode), counted where each call ends: ok (returned), timeout (the server answered TIMEOUT),
    network (NetworkError), error (any other). Each counter is read on its own (no lock)."""

def _set_error_types(
    *,
    store: type[Exception],
    timeout: type[Exception],
    network: type[Exception],
    compacted: type[Exception],
    authentication: type[Exception] | None = None,
) -> None:
    """Sets the Python classes raised for: a store error reply (ERROR, WRONG_TYPE, TOO_LARGE,
    protocol violations), a timeout, a network failure, a COMPACTED watch, and a failed
    authentication (default: the store class). The compacted class is constructed with
    (message, oldest_revision)."""

class Server:
    """The native TCP store server. The constructor binds and listens (so ``port`` is known and
    address errors are raised at once); ``start()`` serves on a background thread."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        backlog: int = 0,  # 0: /proc/sys/net/core/somaxconn
        max_connections: int = 65536,
        log_level: Literal["debug", "info", "warning", "error", "off"] = "warning",
        # Limits (docs/protocol.md "Limits"); a value out of range raises ValueError naming it.
        max_connections_per_peer: int = 8192,  # connections from one IP address
        max_key_bytes: int = 8192,  # at most 8192
        max_value_bytes: int = 8388608,  # at most 8 MiB
        max_keys_per_request: int = 131072,  # at most 131072
        max_connection_buffer_bytes: int = 68157449,  # unsent replies of one connection, >= 1 MiB
        max_buffered_bytes: int = 1073741824,  # buffered across connections
        max_waiters_per_connection: int = 16384,  # blocked requests of one connection
        max_stored_keys: int = 16777216,  # keys plus queued items
        max_stored_bytes: int = 4294967296,  # their key and value bytes
        frame_timeout_ms: int = 30000,  # time to finish a request once started
        handshake_timeout_ms: int = 10000,  # time from connect to the end of the handshake
        # Dead peers (TCP keepalive): closed after idle + interval * count ms; whole seconds; 0: off.
        keepalive_idle_ms: int = 10000,  # silence before the first probe
        keepalive_interval_ms: int = 2000,  # between probes
        keepalive_count: int = 3,  # unanswered probes that end the connection, at most 127
        token: str = "",  # "": no authentication; else 1..MAX_TOKEN_BYTES bytes
        allow_unauthenticated_from: list[str] = ...,  # CIDRs that may use torch's protocol
        allowed_peers: list[str] = ...,  # peers vouched for at start
        allow_loopback: bool = True,  # loopback processes of the server's user may use torch's
        # protocol (tests turn it off)
        barrier_idle_ms: int = 600000,  # an idle released barrier name is forgotten after it
        torch_protocol: bool = True,  # with a token, False refuses torch's protocol from everyone
    ) -> None: ...
    @property
    def requires_token(self) -> bool: ...
    def allow_peer(self, addr: str) -> None:
        """An address that may use torch's protocol; ValueError when it does not parse or is a
        range (ranges: allow_unauthenticated_from)."""
    def set_allowed_peers(self, addrs: list[str]) -> None: ...
    def allowed_peers(self) -> list[str]: ...
    @property
    def host(self) -> str: ...  # the numeric address bound
    @property
    def port(self) -> int: ...
    @property
    def running(self) -> bool: ...
    def start(self) -> None: ...
    def stop(self) -> None:
        """Stops serving, closes every connection and the listening socket, joins the thread.
        Idempotent; also done on destruction."""
    def stats(self) -> dict[str, int]: ...

class Client:
    """A blocking client on one TCP connection. Thread-safe: calls from several threads are
    serialized on the connection; use ``clone()`` for independent connections. The constructor
    connects, retrying with backoff until ``connect_timeout``.

    ``host`` is a numeric address or a name, resolved forward (never a reverse lookup) on each
    connect, within the connect timeout. ``timeout`` bounds every call: reconnecting, sending,
    and the reply to a request that does not block server-side (a request that blocks gets its
    timeout plus a slack); past it the network error names the operation and its keys.

    When the connection breaks (network error, server restart, a call interrupted by a signal),
    the next call reconnects first: a new session, so the ephemeral keys of the old one are gone.
    A call that fails after its request was sent is not retried (it may have been applied).
    After ``fork()``, the child's first call drops the inherited connection (closing its file
    descriptor, sending nothing) and makes its own; the parent's connection is untouched.
    A blocking call on the main thread runs Python signal handlers every 100 ms: Ctrl-C raises
    ``KeyboardInterrupt`` at once (and closes the connection). Arguments refused before sending
    (a key or value over its limit, mismatched ``multi_set`` lengths, ``world_size < 1``) raise
    the store error."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout: float = 300.0,
        timeout: float = 300.0,
        client_name: str = "",
        token: str = "",  # the server's token; "": none (AuthenticationError on a failed handshake)
    ) -> None: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def session_id(self) -> int: ...
    @property
    def timeout(self) -> float:
        """The bound of every call, in seconds (negative: none); settable, applies to the next
        call."""
    @timeout.setter
    def timeout(self, seconds: float) -> None: ...
    @property
    def connect_timeout(self) -> float:
        """How long connecting again after the connection broke keeps retrying, in seconds
        (negative: no bound but the call's); settable, applies to the next reconnect and to
        clones."""
    @connect_timeout.setter
    def connect_timeout(self, seconds: float) -> None: ...
    def clone(self) -> Client: ...
    def close(self) -> None:
        """Closes the connection for good; a call blocked on another thread raises the network
        error, and so does every later call. Idempotent."""
    def set(self, key: _Key, value: _Value, ephemeral: bool = False) -> int:
        """Returns the revision of the change."""
    def get(self, key: _Key, timeout: float) -> bytes:
        """Blocks server-side until the key exists (one round trip)."""
    def try_get(self, key: _Key) -> tuple[bytes, int] | None:
        """(value, mod_revision), or None when the key is missing. Never blocks."""
    def add(self, key: _Key, delta: int) -> int: ...
    def compare_set(
        self, key: _Key, expected: _Value, desired: _Value, ephemeral: bool = False
    ) -> tuple[bool, bytes | None]:
        """(swapped, value now stored or None when the key is missing)."""
    def wait(self, keys: list[_Key], timeout: float) -> None: ...
    def check(self, keys: list[_Key]) -> bool: ...
    def delete_key(self, key: _Key) -> bool: ...
    def num_keys(self) -> int: ...
    def list_keys(self, prefix: _Key = "") -> list[str]: ...
    def append(self, key: _Key, value: _Value) -> int: ...
    def multi_get(self, keys: list[_Key], timeout: float) -> list[bytes]: ...
    def multi_set(self, keys: list[_Key], values: list[_Value]) -> int: ...
    def queue_push(self, queue: _Key, value: _Value) -> int:
        """Returns the queue length after the push."""
    def queue_pop(self, queue: _Key, timeout: float) -> bytes | None:
        """timeout 0: None when empty. Otherwise blocks; raises the timeout error when it passes."""
    def queue_len(self, queue: _Key) -> int: ...
    def ping(self) -> None: ...
    def allow_peers(self, addrs: list[str]) -> None:
        """ALLOW_PEERS: these addresses or CIDRs may use torch's protocol on a server with a token."""
    def barrier(self, key: _Key, world_size: int, timeout: float) -> int:
        """Returns the generation released (0, 1, 2, ...)."""
    def watch(
        self, key: _Key, after_revision: int | None, timeout: float, prefix: bool = False
    ) -> tuple[Literal["set", "delete"], str, bytes, int]:
        """The first change after ``after_revision`` (None: after now) to the key, or to any key
        under it when ``prefix``: (kind, key, value, revision)."""
    def stats(self) -> dict[str, int]: ...

class Heartbeat:
    """A session-bound key kept fresh from a native thread (no GIL). The constructor clones
    ``client`` (a session of its own), sets ``key`` to ``f"{value} 1"`` and then, every ``period``
    seconds, to ``f"{value} {n}"`` with n counting up; each beat also creates ``presence`` (when
    not empty) with ``value`` if it is missing, so a watcher of it sees no beat. A failed beat
    is retried next period (a lost connection reconnects: a new session). ``stop()`` ends the
    thread at once and closes the connection, which deletes the keys on the server (idempotent;
    the destructor calls it)."""

    def __init__(self, client: Client, key: str, value: str, period: float,
                 presence: str = "") -> None: ...
    def beat(self) -> None:
        """One beat now, on the calling thread (raises as ``Client.set``)."""
    @property
    def beats(self) -> int: ...
    def stop(self) -> None: ...
