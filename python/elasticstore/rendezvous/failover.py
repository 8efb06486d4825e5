"""Failover of an agent-hosted rendezvous store (the native backend's default).

One agent hosts the rendezvous server; when it is lost (killed, its host gone, cut off), the
surviving agents pick the next host without a second store to ask: every node keeps what it
needs of the run's state (:class:`Carried`: the last round record, the host record, the closed
record, the last failure) and computes the same ordered list of candidates from the last round
(:func:`candidates`: its participants in rank order, then its standbys, less every host already
lost). The first candidate that is alive serves on its own address at the store's port, seeded
with that state, and publishes a new :class:`HostRecord` (epoch + 1) last; the others accept a
server only once it shows that record. A node tries each candidate for ``FAILOVER_WAIT`` seconds
before the next one, so a candidate that died during the switch is passed over.

Which store is newest: the one whose round record is newest, then the one of the higher epoch
(:func:`find_standing`, ``AgentSide._outranked``). An epoch alone does not order two stores: a
node that was stopped or cut off, and took the host for lost, serves the next epoch seeded with
the round it knew, while the host it left (with the others) may have formed rounds since; the
epoch-only order had that host give its newer rounds up for the stale store, whose next round
repeated their numbers. A node carrying a newer round than a store holds never joins it: it
serves a later epoch itself, seeded with its round, and the stale host gives way to it.

Split brain: a new host forms its first round only with a strict majority of the last round's
participants (:class:`FailoverRecord` ``quorum``), and any round on an agent-hosted store keeps
at least half of the previous round's participants (``fence_quorum``): two sides of a partition
cannot both satisfy these, so at most one of them forms a round and trains. The price: a job
whose round loses more than half of its nodes at once waits for them (up to ``join_timeout``);
``--rdzv-conf failover=0`` turns both the failover and the rule off (the store's host is then a
single point of failure, as with torch's c10d backend).

Keys (run ``R``): ``rdzv/R/ctl/host`` (the host record), ``rdzv/R/ctl/failover`` (the first
round after a switch: whom to wait for, the quorum). Records are JSON, read with the bounded parse.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

from ..errors import StoreError, StoreNetworkError, StoreTimeoutError
from ..stores.native.store import Store
from .records import RecordError, int_field, number_field, parse_record, str_field
from .settings import RendezvousSettings, parse_endpoint
from .state import Keys, NodeId, RoundState

__all__ = ["FAILOVER_WAIT", "PROBE", "Carried", "FailoverRecord", "HostRecord", "Standing",
           "candidates", "endpoint_of", "fence_quorum", "find_host", "find_standing", "majority",
           "seed", "store_standing", "survivor_may_take_over"]

log = logging.getLogger(__name__)

FAILOVER_WAIT = 10.0  # seconds a node waits for a candidate to serve before trying the next
PROBE = 0.5  # seconds: one endpoint's probe (connect and one read) when looking for the store


def endpoint_of(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def listening(host: str, port: int, probe: float = PROBE) -> bool:
    """Whether anything accepts a connection at ``host:port``: one plain connect, so nothing
    listening is refused at once (a store client retries a refused connect for its whole
    connect timeout). A probe's first step, before it asks a store anything."""
    try:
        socket.create_connection((host, port), timeout=probe).close()
    except OSError:
        return False
    return True


def _record(data: bytes | None, what: str) -> dict[str, object] | None:
    if data is None:
        return None
    try:
        obj = parse_record(data, what)
    except RecordError as exc:
        log.warning("ignoring %s: %s", what, exc)
        return None
    return obj if isinstance(obj, dict) else None


@dataclass(frozen=True)
class HostRecord:
    """Who hosts the run's rendezvous store: ``epoch`` 1 is the first host, each switch adds
    one; ``previous``: the endpoint it took over from; ``since``: when (Unix time)."""

    epoch: int
    node: str
    endpoint: str
    previous: str | None = None
    since: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"schema": 1, "epoch": self.epoch, "node": self.node,
                           "endpoint": self.endpoint, "previous": self.previous,
                           "since": self.since}, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: bytes | None) -> HostRecord | None:
        obj = _record(data, "the rendezvous host record")
        if obj is None:
            return None
        epoch = int_field(obj, "epoch", 0) or 0
        node, endpoint = str_field(obj, "node"), str_field(obj, "endpoint")
        if epoch < 1 or not node or not endpoint:
            return None
        return cls(epoch, node, endpoint, str_field(obj, "previous"),
                   number_field(obj, "since", 0.0) or 0.0)

    @property
    def address(self) -> tuple[str, int]:
        host, port = parse_endpoint(self.endpoint)
        return host.strip("[]"), port


@dataclass(frozen=True)
class FailoverRecord:
    """The first round after a switch: round ``round``'s nodes in ``expect`` are waited for
    (for ``FAILOVER_WAIT`` after the decider first sees them missing) although they have not
    reached the new host yet, and the round needs ``quorum`` of its participants."""

    epoch: int
    round: int
    expect: tuple[str, ...]
    quorum: int

    def to_json(self) -> str:
        return json.dumps({"schema": 1, "epoch": self.epoch, "round": self.round,
                           "expect": list(self.expect), "quorum": self.quorum},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, data: bytes | None) -> FailoverRecord | None:
        obj = _record(data, "the rendezvous failover record")
        if obj is None:
            return None
        expect = obj.get("expect")
        if not isinstance(expect, list) or not all(isinstance(n, str) for n in expect):
            return None
        return cls(int_field(obj, "epoch", 0) or 0, int_field(obj, "round", 0) or 0, tuple(expect),
                   int_field(obj, "quorum", 0) or 0)


def majority(state: RoundState) -> int:
    """More than half of ``state``'s participants: what a new host's first round needs."""
    return len(state.participants) // 2 + 1


def fence_quorum(state: RoundState) -> int:
    """At least half of ``state``'s participants: what any round after it keeps on an
    agent-hosted store (the other side of a partition may hold a majority and take over)."""
    return (len(state.participants) + 1) // 2


@dataclass
class Carried:
    """What one node keeps of the run's state to seed a new host with."""

    round: RoundState | None = None
    host: HostRecord | None = None
    closed: bytes | None = None
    failure: bytes | None = None
    lost: set[str] = field(default_factory=set)  # hosts lost since ``round`` (node ids)
    # The failure record as read at the last refresh: a ``failure`` that differs was published
    # by this node since, and only this node has it (the others read it at the next round).
    read_failure: bytes | None = None

    def refresh(self, store: Store, keys: Keys, state: RoundState) -> None:
        """After entering round ``state``: the host, closed and failure records (one read).
        A newer round forgets the hosts lost before it: a participant of it is alive (a host
        that gave its store up and rejoined, or came back), a candidate like any other."""
        if self.round is None or state != self.round:  # a round formed since (by number or
            self.lost.clear()  # by members: one formed on a store given up repeats a number)
        self.round = state
        host, closed, failure = (store.try_get(k) for k in (keys.host, keys.closed, keys.failure))
        record = HostRecord.from_json(host)
        if record is not None and (self.host is None or record.epoch >= self.host.epoch):
            self.host = record
        self.closed = closed if closed is not None else self.closed
        self.failure = self.read_failure = failure if failure is not None else self.failure

    def published_since(self) -> bytes | None:
        """The failure record this node published since the last refresh, if any: it writes
        it to a new host itself (the host seeded what it read)."""
        return self.failure if self.failure != self.read_failure else None


def survivor_may_take_over(settings: RendezvousSettings, carried: Carried | None) -> bool:
    """Whether a survivor takes the run's store over when its host is lost: with ``failover``,
    where the store was looked up among several endpoints, or where this node carries a round
    and the store's host record (an agent-hosted store at one endpoint, once a round formed).
    An external store at one endpoint has no host record: no one takes it over. ``carried``
    None: nothing carried yet (a connection being made)."""
    if not settings.failover:
        return False
    if len(settings.endpoints) > 1:
        return True
    return carried is not None and None not in (carried.host, carried.round)


def candidates(carried: Carried) -> list[str]:
    """The nodes that may host next, in order: the last round's participants by rank, then its
    standbys, less every host lost so far. Every survivor computes the same list."""
    state = carried.round
    if state is None:
        return []
    lost = set(carried.lost)
    if carried.host is not None:
        lost.add(carried.host.node)
    return [n for n in (*state.participants, *state.standby) if n not in lost]


def addr_of(node: str) -> str:
    return NodeId.parse(node).addr


def seed(store: Store, keys: Keys, carried: Carried, record: HostRecord) -> None:
    """Writes the carried state into a new host's (empty) store, the host record last: a node
    uses the store only once that record is there."""
    state = carried.round
    assert state is not None
    # Its standbys switch too: waited for as well, they take the lost nodes' places at once
    # (not in a scale-up round right after this one).
    expect = tuple(n for n in (*state.participants, *state.standby) if n not in carried.lost
                   and n != record.node and (carried.host is None or n != carried.host.node))
    store.set(keys.round, state.to_json())
    store.set(keys.restart(state.round), json.dumps({"reason": f"store host lost; now {record.endpoint}"}))
    store.set(keys.failover, FailoverRecord(record.epoch, state.round, (record.node, *expect),
                                            majority(state)).to_json())
    if carried.closed is not None:
        store.set(keys.closed, carried.closed)
    if carried.failure is not None:
        store.set(keys.failure, carried.failure)
    store.set(keys.host, record.to_json())


def read_host(store: Store, keys: Keys) -> HostRecord | None:
    return HostRecord.from_json(store.try_get(keys.host))


def await_host(store: Store, keys: Keys, node: str, epoch: int, deadline: float) -> HostRecord | None:
    """The host record once ``node`` published epoch >= ``epoch`` on ``store`` (it seeds first);
    None at ``deadline`` or when the record names another node."""
    for _ in range(1 << 20):
        record = read_host(store, keys)
        if record is not None and record.epoch >= epoch:
            return record if record.node == node else None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)
    return None


@dataclass(frozen=True)
class Standing:
    """A store of the run as a probe found it: its host record and the number of the round its
    round record holds (0: none yet)."""

    record: HostRecord
    round: int

    @property
    def rank(self) -> tuple[int, int]:
        """Newer rounds first, then newer epochs (see the module)."""
        return self.round, self.record.epoch


def store_standing(host: str, port: int, keys: Keys, token: str | None,
                   probe: float = PROBE) -> Standing | None:
    """The run's store served at ``host:port`` (one short probe), or None: none answers there,
    or it holds no host record (a follower's copy, another run's store)."""
    wait = timedelta(seconds=probe)
    if not listening(host, port, probe):
        return None
    try:
        with Store(host, port, timeout=wait, connect_timeout=wait, token=token) as st:
            record = read_host(st, keys)
            data = st.try_get(keys.round) if record is not None else None
    except (StoreNetworkError, StoreTimeoutError, StoreError):
        return None
    if record is None:
        return None
    state = RoundState.from_json(data) if data is not None else None
    return Standing(record, state.round if state is not None else 0)


def find_standing(endpoints: list[tuple[str, int]], keys: Keys, token: str | None,
                  probe: float = PROBE) -> Standing | None:
    """The newest store (``Standing.rank``) among those that answer at ``endpoints``, or None."""
    best: Standing | None = None
    for host, port in endpoints:
        found = store_standing(host, port, keys, token, probe)
        if found is not None and (best is None or found.rank > best.rank):
            best = found
    return best


def find_host(endpoints: list[tuple[str, int]], keys: Keys, token: str | None,
              probe: float = PROBE) -> HostRecord | None:
    """The host record of the newest store among those at ``endpoints`` (``find_standing``):
    where a node that starts (or comes back) finds a store that moved."""
    found = find_standing(endpoints, keys, token, probe)
    return found.record if found is not None else None
