"""``--rdzv-conf`` keys -> :class:`RendezvousSettings`, parsed and checked once.

Every key, its default and its meaning (documented in ``docs/rendezvous.md``):

==================== ========= ================================================================
key                  default   meaning
==================== ========= ================================================================
join_timeout         600       seconds a node waits in ``next_rendezvous`` for a round to form
last_call_timeout    30        seconds a round stays open after ``min_nodes`` joined
close_timeout        30        seconds ``shutdown`` may take to withdraw this node
store_timeout        60        seconds one store operation (and a reconnect) may take
lease_ttl            5         etcd: TTL of the lease that carries a node's liveness keys
is_host              (auto)    native: host the rendezvous server in this agent (torch's key)
failover             true      native: when the agent hosting the store is lost, a survivor
                               hosts it next (``failover.py``); false: the store's host is a
                               single point of failure, and no quorum rule applies
etcd_prefix          /elasticstore/rdzv   etcd: key prefix of the rendezvous
cacert / cert / key  (none)    etcd: TLS files (``ca_cert`` is accepted for ``cacert``)
user / password      (none)    etcd: authentication
protocol             (auto)    etcd: ``http`` or ``https`` (torch's etcd key; https needs cacert)
rank                 (none)    static: this node's rank (torchrun adds it from ``--node-rank``)
token_file           (env)     native/static: file holding the shared token; the rendezvous
                               server, every connection to it and each round's worker store use
                               it (without the key: ``ELASTICSTORE_TOKEN_FILE``/``_TOKEN``)
timeout              (ignored) torchrun always adds it (900); ``join_timeout`` is the one used
==================== ========= ================================================================

torch's own keys (``read_timeout``, ``keep_alive_*``, ``ssl_cert``, ...): ``torch_conf.py``.

``--rdzv-endpoint host:0`` (torch's ``localhost:0``: any free port) is taken for one node on a
backend whose agent hosts the store: a free port of ``host`` is chosen and this node hosts the
store (``is_host``); with more nodes it is refused (the others could not learn the port).

An unknown key or a bad value raises :class:`SettingsError` (a ``ValueError``) naming the key
and the reason, and in ``flag`` the launcher's flag it came from. Quotes left in
by a shell or torch's parser (``'join_timeout=5,timeout=5'``, ``key="value"``) are dropped.
``parse_pairs`` splits the flag's text, ``key=value,...``, for the launcher.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..stores.native.token import read_token_file
from .conf_values import SettingsError, bool_value, seconds_value
from .torch_conf import TORCH_KEYS, torch_keys

__all__ = ["DEFAULT_PORT", "RendezvousSettings", "SettingsError", "numeric_host", "parse_endpoint",
           "parse_pairs", "settings_from_params", "unquote_config"]

DEFAULT_PORT = 29400
log = logging.getLogger(__name__)

_SECONDS = ("join_timeout", "last_call_timeout", "close_timeout", "store_timeout", "lease_ttl")
_STRINGS = ("etcd_prefix", "cacert", "cert", "key", "user", "password", "protocol")
_KNOWN = {*_SECONDS, *_STRINGS, *TORCH_KEYS, "is_host", "failover", "rank", "timeout",
          "token_file"}
_QUOTES = ("'", '"')


def _unwrap(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in _QUOTES:
        return text[1:-1].strip()
    return text


def unquote_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as torch's parser split it, without the quotes: a quote opening the first key
    and closing the last value wrapped the whole string; a value may be quoted on its own."""
    items = [(str(k).strip(), v.strip() if isinstance(v, str) else v) for k, v in config.items()]
    if items and isinstance(items[-1][1], str):
        first, last = items[0][0], items[-1][1]
        if first[:1] in _QUOTES and last.endswith(first[0]):
            items[0] = (first[1:].strip(), items[0][1])
            items[-1] = (items[-1][0], items[-1][1][:-1].strip())
    return {_unwrap(k): _unwrap(v) if isinstance(v, str) else v for k, v in items}


def parse_pairs(text: str) -> tuple[tuple[str, str], ...]:
    """``--rdzv-conf`` as given, ``key=value,...`` (quotes dropped as ``unquote_config`` does) ->
    pairs; ``ValueError`` naming an item that is not ``key=value``."""
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (i.strip() for i in _unwrap(str(text)).split(","))):
        key, eq, val = item.partition("=")
        if not eq or not _unwrap(key):
            raise ValueError(f"{item!r} is not key=value")
        pairs.append((key, val))
    return tuple(unquote_config(dict(pairs)).items())


def numeric_host(host: str) -> str:
    """``host`` as a numeric address (forward lookup only: ``localhost`` -> ``127.0.0.1``)."""
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return str(infos[0][4][0])


def parse_endpoint(endpoint: str, default_port: int = DEFAULT_PORT,
                   any_port: bool = False) -> tuple[str, int]:
    """``host[:port]`` (IPv6 in brackets) -> (host, port); ``any_port``: port 0 is taken."""
    endpoint = endpoint.strip()
    if not endpoint:
        raise SettingsError("rdzv endpoint: empty (expected host[:port])", "--rdzv-endpoint")
    if endpoint.startswith("["):
        host, _, rest = endpoint[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif endpoint.count(":") == 1:
        host, port_text = endpoint.split(":")
    else:
        host, port_text = endpoint, ""
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not (0 if any_port else 1) <= int(port_text) < 65536:
        raise SettingsError(f"rdzv endpoint {endpoint!r}: port {port_text!r} is not a port number",
                            "--rdzv-endpoint")
    return host, int(port_text)


def _token_file(value: Any) -> tuple[str, str]:
    """(absolute path, token) of ``token_file``; refuses a missing, unreadable or empty file."""
    if not isinstance(value, str) or not value.strip():
        raise SettingsError(f"rdzv-conf token_file={value!r}: must be a path to a token file")
    path = os.path.abspath(os.path.expanduser(value.strip()))
    try:
        return path, read_token_file(path)
    except OSError as exc:
        raise SettingsError(f"rdzv-conf token_file={value!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SettingsError(f"rdzv-conf token_file={value!r}: {exc}") from None


def _free_port(host: str) -> int:
    """A free TCP port of ``host`` (the OS's choice), for ``host:0``."""
    try:
        addr = numeric_host(host)
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            s.bind((addr, 0))
            return int(s.getsockname()[1])
    except OSError as exc:
        raise SettingsError(f"rdzv endpoint {host}:0: no free port there ({exc})",
                            "--rdzv-endpoint") from None


@dataclass(frozen=True)
class RendezvousSettings:
    """Everything the rendezvous needs, checked once (see the module doc for the keys)."""

    run_id: str
    host: str
    port: int
    min_nodes: int
    max_nodes: int
    local_addr: str | None = None
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    store_timeout: float = 60.0
    lease_ttl: float = 5.0
    is_host: bool | None = None
    failover: bool = True
    etcd_prefix: str = "/elasticstore/rdzv"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    protocol: str | None = None
    rank: int | None = None
    token_file: str | None = None
    token: str | None = field(default=None, repr=False)  # read from token_file at parse time
    # Every member as given (etcd: ``--rdzv-endpoint`` may list several); host/port: the first's.
    endpoints: tuple[str, ...] = ()
    # One line each for torch's keys that mean nothing here (the launcher prints them).
    notices: tuple[str, ...] = field(default=(), compare=False)

    @property
    def store_token(self) -> str | None:
        """The token for ``Store``/``StoreServer``: the token file's, else ``None`` (their
        environment fallback: ``ELASTICSTORE_TOKEN_FILE``, then ``ELASTICSTORE_TOKEN``)."""
        return self.token if self.token_file is not None else None

    def __post_init__(self) -> None:
        if not self.run_id or "/" in self.run_id:
            raise SettingsError(f"run_id {self.run_id!r}: must be non-empty, without '/'", "--rdzv-id")
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise SettingsError(
                f"nnodes {self.min_nodes}:{self.max_nodes}: need 1 <= min_nodes <= max_nodes",
                "--nnodes")
        if self.protocol not in (None, "http", "https"):
            raise SettingsError(f"rdzv-conf protocol={self.protocol!r}: must be http or https")
        if (self.cert is None) != (self.key is None):
            raise SettingsError("rdzv-conf cert/key: give both (client certificate and its key)")
        if (self.user is None) != (self.password is None):
            raise SettingsError("rdzv-conf user/password: give both")
        if self.rank is not None and self.rank < 0:
            raise SettingsError(f"rdzv-conf rank={self.rank}: must be >= 0")
        if self.protocol == "https" and self.cacert is None:
            raise SettingsError("rdzv-conf protocol=https: needs cacert")

    @cached_property
    def address(self) -> str:
        """The endpoint's host as a numeric address, looked up once per settings, when first
        needed (connecting): a name that does not resolve yet (a Kubernetes Service starting) is
        looked up again until ``join_timeout`` (``resolve.py``)."""
        from .resolve import wait_for_name  # torch's error type: imported when connecting

        return wait_for_name([self.host], self.join_timeout)[1]

    @cached_property
    def local_address(self) -> str | None:
        """``local_addr`` as a numeric address (looked up once), None when not given."""
        return numeric_host(self.local_addr) if self.local_addr else None

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def member_endpoints(self) -> list[tuple[str, int]]:
        """Every ``--rdzv-endpoint`` entry as (host without brackets, port), the first first."""
        found = [parse_endpoint(e, self.port) for e in self.endpoints] or [(self.host, self.port)]
        return [(h.strip("[]"), p) for h, p in found]

    def endpoints_but(self, host: str, port: int) -> list[tuple[str, int]]:
        """``member_endpoints`` less ``host:port`` (brackets of an IPv6 ``host`` ignored): the
        other nodes' endpoints, where a node looks for a store newer than its own."""
        own = (host.strip("[]"), port)
        return [e for e in self.member_endpoints() if e != own]

    @classmethod
    def from_config(
        cls,
        *,
        run_id: str,
        endpoint: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None,
        config: Mapping[str, Any],
        default_port: int = DEFAULT_PORT,
        several: bool = False,
        any_port: bool = False,
    ) -> RendezvousSettings:
        """Parses ``config`` (the ``--rdzv-conf`` keys); refuses unknown keys and bad values.
        Quotes torch's parser leaves in (``--rdzv-conf "'timeout=5'"``, ``key="v"``) are dropped.
        ``several``: ``endpoint`` may list members, comma-separated (host and port: the first's).
        ``any_port``: port 0 is taken (one node, hosting the store on a free port of its host)."""
        config = unquote_config(config)
        unknown = sorted(set(config) - _KNOWN)
        if unknown:
            raise SettingsError(
                f"rdzv-conf: unknown key(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted(_KNOWN))})"
            )
        notices: list[str] = []
        config = torch_keys(config, notices)
        kwargs: dict[str, Any] = {}
        for key in _SECONDS:
            if key in config:
                kwargs[key] = seconds_value(key, config[key])
        for key in _STRINGS:
            value = config.get(key)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise SettingsError(f"rdzv-conf {key}={value!r}: must be a non-empty string")
            kwargs[key] = value
        if "is_host" in config:
            kwargs["is_host"] = bool_value("is_host", config["is_host"])
        if "failover" in config:
            kwargs["failover"] = bool_value("failover", config["failover"])
        if "rank" in config and config["rank"] is not None:
            try:
                kwargs["rank"] = int(config["rank"])
            except (TypeError, ValueError):
                raise SettingsError(f"rdzv-conf rank={config['rank']!r}: not an integer") from None
        if config.get("token_file") is not None:
            kwargs["token_file"], kwargs["token"] = _token_file(config["token_file"])
        if "timeout" in config:  # torchrun's; checked, not used (join_timeout is)
            seconds_value("timeout", config["timeout"])
        members = tuple(e.strip() for e in endpoint.split(",")) if several else (endpoint,)
        host, port = parse_endpoint(members[0], default_port, any_port=any_port)
        if port == 0:  # torch's localhost:0: one node, which hosts the store on a free port
            if int(max_nodes) != 1 or len(members) > 1:
                raise SettingsError(
                    f"rdzv endpoint {endpoint!r}: port 0 (any free port) needs --nnodes 1: other "
                    "nodes could not learn the port; give a port", "--rdzv-endpoint")
            if kwargs.get("is_host") is False:
                raise SettingsError(f"rdzv endpoint {endpoint!r}: port 0 (any free port) needs "
                                    "this node to host the store, and is_host=false says not")
            port, kwargs["is_host"] = _free_port(host), True
            members = (f"[{host}]:{port}" if ":" in host else f"{host}:{port}",)
        return cls(
            run_id=run_id,
            host=host,
            port=port,
            min_nodes=int(min_nodes),
            max_nodes=int(max_nodes),
            local_addr=local_addr or None,
            endpoints=members,
            notices=tuple(notices),
            **kwargs,
        )


def settings_from_params(
    params: Any, default_port: int = DEFAULT_PORT, several: bool = False
) -> RendezvousSettings:
    """Settings from torch's ``RendezvousParameters`` (the torchrun plugin path): the same
    parse as the launcher's; its notices are logged."""
    settings = RendezvousSettings.from_config(
        run_id=params.run_id,
        endpoint=params.endpoint,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        config=params.config,
        default_port=default_port,
        several=several,
    )
    for notice in settings.notices:
        log.warning("%s", notice)
    return settings
