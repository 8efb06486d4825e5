"""What a node of the endpoint list serves at its own endpoint while another node hosts the store.

Every agent whose address is an ``--rdzv-endpoint`` entry other than the first (where a node that
finds no moved store connects: a follower there would pass for the store) listens at that entry with a small server of its own, the *follower*, that holds one record: a
copy of the run's control records as this node last read them (the host record, hence the epoch,
and the last round's number) under ``ctl/follower``. Two things rest on it (``failover.py``):

- A node that starts (or comes back, the old host restarted with the same command line) finds
  the run alive at a survivor even while no store serves it (its host is lost and the next one not
  serving yet): it then waits for the next host instead of hosting a fresh epoch 1 beside the
  survivors (:func:`survey`, used by ``native.create_native_backend``).
- The first candidate's switch is immediate: its server is listening already; taking over seeds it
  (``takeover.py``) and the node's follower role ends (:meth:`Follower.promote`).

A follower's record is never a host record (``ctl/host``): a probe for the served store
(:func:`failover.find_host`) never mistakes a copy for a host.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import timedelta

from ..errors import StoreError, StoreNetworkError, StoreTimeoutError
from ..stores.native.server import StoreServer
from ..stores.native.store import Store
from .failover import PROBE, Carried, HostRecord, endpoint_of, listening
from .records import RecordError, int_field, parse_record
from .settings import RendezvousSettings, numeric_host
from .state import Keys

__all__ = ["Follower", "Survey", "own_follower", "start_follower", "survey"]

log = logging.getLogger(__name__)

class Follower:
    """A server at this node's endpoint holding its copy of the run's control records."""

    def __init__(self, server: StoreServer, store: Store, keys: Keys, node: str) -> None:
        self.server, self._store, self._key, self._node = server, store, keys.follower, node
        self._written: str | None = None

    def record(self, carried: Carried) -> None:
        """Writes this node's copy (host record, last round) when it changed; never raises."""
        host, rnd = carried.host, carried.round
        if host is None:
            return
        value = json.dumps({"schema": 1, "node": self._node, "host": json.loads(host.to_json()),
                            "round": rnd.round if rnd is not None else 0}, separators=(",", ":"))
        if value == self._written:
            return
        try:
            self._store.set(self._key, value)
            self._written = value
        except Exception as exc:  # a local server: only a bug gets here
            log.warning("follower record not written: %s", exc)

    def promote(self) -> StoreServer:
        """Hands the server over to serve the run's store (``takeover.py``): its copy goes, the
        host record is seeded next."""
        self._store.delete_key(self._key)
        self._store.close()
        return self.server

    def close(self) -> None:
        try:
            self._store.close()
        finally:
            self.server.close()


def start_follower(addr: str, port: int, keys: Keys, node: str, token: str | None) -> Follower | None:
    """A follower at ``addr:port``, or None when that address is not this node's or is taken."""
    try:
        server = StoreServer(addr, port, token=token, torch_protocol=False)
    except Exception as exc:
        log.info("no follower at %s:%d: %s", addr, port, exc)
        return None
    try:
        store = Store(addr, port, timeout=timedelta(seconds=10), connect_timeout=timedelta(seconds=5),
                      token=token)
    except BaseException:
        server.close()
        raise
    return Follower(server, store, keys, node)


def own_follower(settings: RendezvousSettings, addr: str, keys: Keys, node: str,
                 hosting: bool) -> Follower | None:
    """The follower of a node whose address is an ``--rdzv-endpoint`` entry other than the
    first (one of several), unless it hosts the store there; None otherwise."""
    if hosting or len(settings.endpoints) < 2:
        return None
    # Never at the first entry: a node that finds no moved store connects there, and must not
    # take a follower for the run's store (it would form a fresh run in it).
    for host, port in settings.member_endpoints()[1:]:
        try:
            if numeric_host(host) == addr:
                return start_follower(addr, port, keys, node, settings.store_token)
        except (OSError, ValueError):
            continue
    return None


def _copy_of(data: bytes | None) -> HostRecord | None:
    if data is None:
        return None
    try:
        obj = parse_record(data, "a follower's record")
    except RecordError as exc:
        log.warning("ignoring %s", exc)
        return None
    if not isinstance(obj, dict) or int_field(obj, "schema", 0) != 1:
        return None
    return HostRecord.from_json(json.dumps(obj.get("host")).encode())


@dataclass
class Survey:
    """What the endpoints say of a run (:func:`survey`): the newest host record a store serves,
    the newest copy a follower holds, and the endpoints that accept a connection but do not
    answer (a stopped or frozen process listens there: perhaps a node of the run)."""

    served: HostRecord | None = None
    copy: HostRecord | None = None
    silent: list[str] = field(default_factory=list)


def survey(endpoints: list[tuple[str, int]], keys: Keys, token: str | None,
           probe: float = PROBE) -> Survey:
    """One short probe of each endpoint (a connect, then the host and follower records in one
    connection): where a node that starts learns whether the run is alive."""
    out = Survey()
    wait = timedelta(seconds=probe)
    for host, port in endpoints:
        if not listening(host, port, probe):
            continue
        try:
            with Store(host, port, timeout=wait, connect_timeout=wait, token=token) as st:
                served = HostRecord.from_json(st.try_get(keys.host))
                copy = _copy_of(st.try_get(keys.follower))
        except (StoreNetworkError, StoreTimeoutError):
            out.silent.append(endpoint_of(host, port))  # accepted, no answer
            continue
        except StoreError:  # not a store of ours (or another token): says nothing of the run
            continue
        if served is not None and (out.served is None or served.epoch > out.served.epoch):
            out.served = served
        if copy is not None and (out.copy is None or copy.epoch > out.copy.epoch):
            out.copy = copy
    return out
