"""Round R's worker store: rank 0's agent hosts a fresh native server and publishes its address
under ``ctl/boot/R``; the other participants wait for that record. Also where a node's own
address comes from."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousTimeoutError

from ..errors import AuthenticationError, StoreNetworkError, StoreTimeoutError, WatchCompactedError
from ..stores.native.server import StoreServer
from ..stores.native.store import Store
from .backend import StoreBackend
from .settings import RendezvousSettings
from .state import AgentKeys, Keys, NodeId, RoundState

__all__ = ["PEER_CHECK_TIMEOUT", "RECONNECT", "RoundReplaced", "await_boot", "connect_worker_store",
           "host_worker_store", "local_addr", "member_addrs", "peer_finished"]

# Seconds one connection attempt to a round's worker store may take (reconnects included): its
# host closes it as soon as the round is replaced, and a node must learn that, not retry for
# store_timeout.
RECONNECT = 3.0
PEER_CHECK_TIMEOUT = 0.5  # seconds: asking the round's store whether a peer finished


class RoundReplaced(Exception):
    """The round being joined was replaced before it could be used: join the next one."""


def local_addr(settings: RendezvousSettings) -> str:
    """``local_addr`` if set, else the address this host uses to reach the endpoint (a UDP
    connect sends nothing and needs no DNS); 127.0.0.1 when there is no route."""
    if settings.local_address is not None:
        return settings.local_address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((settings.address, settings.port))
            return str(sock.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def member_addrs(state: RoundState) -> list[str]:
    """The addresses of round ``state``'s participants (from their node ids), deduplicated."""
    addrs: list[str] = []
    for node in state.participants:
        try:
            addr = NodeId.parse(node).addr
        except ValueError:
            continue
        if addr not in addrs:
            addrs.append(addr)
    return addrs


def host_worker_store(addr: str, state: RoundState, token: str | None) -> StoreServer:
    """A new native server on ``addr`` (any port) for round ``state``'s workers."""
    server = StoreServer(addr, 0, token=token)
    if server.requires_token:
        # torch's TCPStore clients (the workers' MASTER_ADDR/PORT) cannot prove the token:
        # serve the round's members' hosts (loopback always is), refuse others.
        server.set_allowed_peers(member_addrs(state))
    return server


def await_boot(backend: StoreBackend, keys: Keys, rnd: int, deadline: float) -> str:
    """The worker store's address of round ``rnd``, once rank 0 published it; raises
    ``RoundReplaced`` when the round ends first, ``RendezvousTimeoutError`` at ``deadline``."""
    if (value := backend.get(keys.boot(rnd))) is not None:
        return value.decode()  # published already: one read
    for _ in range(1 << 20):  # one pass per compacted watch history
        rev = backend.revision()
        value = backend.get(keys.boot(rnd))
        if value is not None:
            return value.decode()
        if backend.get(keys.restart(rnd)) is not None:
            raise RoundReplaced()
        while time.monotonic() < deadline:
            try:
                event = backend.watch(keys.ctl, rev, deadline - time.monotonic())
            except WatchCompactedError:
                break
            if event is None:
                continue
            rev = event.version
            if event.key == keys.boot(rnd) and event.kind == "set":
                return event.value.decode()
            if event.key == keys.restart(rnd):
                raise RoundReplaced()
        else:
            break
    raise RendezvousTimeoutError(
        f"round {rnd}: rank 0 did not publish the worker store within join_timeout")


def connect_worker_store(backend: StoreBackend, keys: Keys, rnd: int, host: str, port: int,
                         timeout: float, token: str | None, deadline: float) -> Store:
    """A connection to round ``rnd``'s worker store at ``host:port``. Retried (``RECONNECT`` s
    a try) until ``deadline``; raises ``RoundReplaced`` when a try failed and the round ended
    meanwhile: its host closed the store on leaving it."""
    for _ in range(1 << 20):
        left = deadline - time.monotonic()
        try:
            return Store(host, port, timeout=timedelta(seconds=timeout),
                         connect_timeout=timedelta(seconds=max(0.001, min(RECONNECT, left))),
                         token=token)
        except AuthenticationError:
            raise
        except (StoreNetworkError, StoreTimeoutError) as exc:
            if backend.get(keys.restart(rnd)) is not None:
                raise RoundReplaced() from None
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(
                    f"round {rnd}: the worker store at {host}:{port} did not answer within "
                    f"join_timeout: {exc}") from None
    raise RendezvousTimeoutError(f"round {rnd}: could not connect to the worker store")


def peer_finished(info: RendezvousInfo, attempt: int, token: str | None) -> bool:
    """Whether another node of the round finished (its ``done`` key in the round's store). On
    a connection of its own with a short deadline: the round's store may have gone with its
    host; False when it cannot tell."""
    boot = info.bootstrap_store_info
    if boot is None:
        return False
    keys, quick = AgentKeys(attempt), timedelta(seconds=PEER_CHECK_TIMEOUT)
    try:
        with Store(boot.master_addr, boot.master_port, timeout=quick, connect_timeout=quick,
                   token=token) as st:
            return any(st.try_get(keys.done(i)) is not None for i in range(info.world_size))
    except Exception:
        return False
