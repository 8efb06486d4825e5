"""The pure decisions and the settings parser, as tables (no store, no processes)."""

from __future__ import annotations

import pytest

from elasticstore.rendezvous.decisions import (
    Complete, Signal, View, Wait, decide, order_nodes, role_in, update_min_since,
)
from elasticstore.rendezvous.settings import RendezvousSettings, parse_endpoint
from elasticstore.rendezvous.state import NodeId, RoundState

A, B, C, D = (str(NodeId(f"127.0.0.{i}", 100 + i, 0)) for i in (2, 3, 4, 10))
R1 = RoundState(1, (A, B, C))
R1_FULL = RoundState(1, (A, B), (C,))


def view(prev: RoundState | None, alive: set[str], joined: set[str], *, restart: bool = False,
         min_since: float | None = 0.0, now: float = 0.0) -> View:
    return View(2 if prev else 1, prev, frozenset(alive), frozenset(joined), restart, min_since, now)


# (name, view, min, max, last_call, expected action)
TABLE = [
    ("first round below min waits", view(None, {A}, {A}, min_since=None), 2, 3, 1.0, Wait(None)),
    ("max joined completes at once", view(None, {A, B, C}, {A, B, C}), 1, 3, 10.0,
     Complete(RoundState(1, (A, B, C)))),
    ("min joined: last call pending", view(None, {A, B}, {A, B}, now=0.5), 2, 3, 1.0, Wait(1.0)),
    ("min joined: last call over", view(None, {A, B}, {A, B}, now=1.0), 2, 3, 1.0,
     Complete(RoundState(1, (A, B)))),
    ("new nodes ordered by numeric address", view(None, {D, B}, {D, B}), 1, 2, 0.0,
     Complete(RoundState(1, (B, D)))),
    ("beyond max stands by", view(None, {A, B, C}, {A, B, C}), 1, 2, 0.0,
     Complete(RoundState(1, (A, B), (C,)))),
    ("running round, participant lost: signal", view(R1, {A, C, D}, {D}), 1, 3, 1.0,
     Signal(f"lost {B}")),
    ("running round, room for a newcomer: signal", view(RoundState(1, (A, B)), {A, B, D}, {D}),
     1, 3, 1.0, Signal(f"waiting {D}")),
    ("running full round, standby waits quietly", view(R1_FULL, {A, B, C}, {C}), 1, 2, 1.0,
     Wait(None)),
    ("restart: survivors expected before max completes", view(R1_FULL, {A, C}, {C}, restart=True),
     1, 2, 5.0, Wait(None)),
    ("restart: standby replaces the lost node, ranks kept",
     view(R1_FULL, {A, C}, {A, C}, restart=True), 1, 2, 5.0, Complete(RoundState(2, (A, C)))),
    ("restart: stable order of survivors", view(R1, {A, C}, {C, A}, restart=True, now=1.0),
     1, 3, 1.0, Complete(RoundState(2, (A, C)))),
    ("worker failure: a participant re-joins, the others are told", view(R1, {A, B, C}, {B}),
     1, 3, 1.0, Signal(f"re-joined {B}")),
    ("told: waiting for the live participants", view(R1, {A, B, C}, {B}, restart=True),
     1, 3, 1.0, Wait(None)),
    ("told: all live re-joined after a loss, at once", view(R1, {A, B}, {B, A}, restart=True,
                                                           now=0.5), 1, 4, 1.0,
     Complete(RoundState(2, (A, B)))),
    ("worker failure: all re-joined, same size, at once",
     view(R1, {A, B, C}, {C, B, A}, restart=True, now=0.0), 1, 4, 30.0,
     Complete(RoundState(2, (A, B, C)))),
    ("after a loss a newcomer replaces the lost node: same size, at once",
     view(R1, {A, B, D}, {A, B, D}, restart=True, now=0.0), 1, 4, 30.0,
     Complete(RoundState(2, (A, B, D)))),
    ("growing beyond the last round's size waits for the last call",
     view(R1, {A, B, C, D}, {A, B, C, D}, restart=True, now=0.5), 1, 5, 1.0, Wait(1.0)),
    ("a live standby not back yet: the last call applies", view(R1_FULL, {A, C}, {A},
                                                                restart=True, now=0.5),
     1, 2, 1.0, Wait(1.0)),
    ("the first round keeps its last call", view(None, {A, B}, {A, B}, now=0.5), 2, 2 + 1, 1.0,
     Wait(1.0)),
    ("scale-up: old and new all joined", view(RoundState(1, (B,)), {B, A}, {A, B}, restart=True),
     1, 2, 5.0, Complete(RoundState(2, (B, A)))),
    ("live survivor not back yet: waited for, even after last call",
     view(R1, {A, B, C}, {A, B}, restart=True, now=2.0), 1, 3, 1.0, Wait(None)),
    ("dead survivor is not waited for",
     view(R1, {A, B}, {A, B}, restart=True, now=2.0), 1, 3, 1.0,
     Complete(RoundState(2, (A, B)))),
]


@pytest.mark.parametrize("name,v,lo,hi,last_call,expected", TABLE, ids=[t[0] for t in TABLE])
def test_decide(name: str, v: View, lo: int, hi: int, last_call: float, expected: object) -> None:
    assert decide(v, lo, hi, last_call) == expected


@pytest.mark.parametrize("since,joined,now,expected", [
    (None, 1, 5.0, None), (None, 2, 5.0, 5.0), (3.0, 2, 5.0, 3.0), (3.0, 1, 5.0, None),
])
def test_min_since(since: float | None, joined: int, now: float, expected: float | None) -> None:
    assert update_min_since(since, joined, 2, now) == expected


def test_order_and_roles() -> None:
    assert order_nodes(frozenset({C, A, D}), RoundState(1, (C, B), (D,))) == [C, D, A]
    state = RoundState(3, (A, B), (C,))
    assert role_in(state, B).rank == 1 and role_in(state, C).standby
    assert role_in(state, D).rank is None and not role_in(state, D).standby


def test_state_is_json_and_checked() -> None:
    state = RoundState(4, (A, B), (C,))
    assert RoundState.from_json(state.to_json()) == state
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    for bad in (b"\x80\x04K\x01.", b'{"schema": 99}', b'{"schema":1,"round":0,'
                b'"participants":[],"standby":[]}', b"[]"):
        with pytest.raises(RendezvousStateError, match="not valid"):
            RoundState.from_json(bad)


def _settings(**config: object) -> RendezvousSettings:
    return RendezvousSettings.from_config(
        run_id="job", endpoint="127.0.0.1:1234", min_nodes=1, max_nodes=2, local_addr=None,
        config=config,
    )


def test_settings_defaults_and_torchrun_keys() -> None:
    s = _settings(timeout=900, is_host="true", rank=0)
    assert (s.join_timeout, s.last_call_timeout, s.lease_ttl, s.is_host) == (600.0, 30.0, 5.0, True)
    assert (s.host, s.port) == ("127.0.0.1", 1234)
    assert _settings(last_call_timeout="0.5").last_call_timeout == 0.5


@pytest.mark.parametrize("config,match", [
    ({"join_timout": 1}, "unknown key.*join_timout"),
    ({"join_timeout": "soon"}, "join_timeout='soon': not a number"),
    ({"last_call_timeout": -1}, "last_call_timeout=-1: must be a positive"),
    ({"is_host": "maybe"}, "is_host='maybe': not a boolean"),
    ({"cert": "c.pem"}, "cert/key"),
    ({"protocol": "ftp"}, "protocol='ftp'"),
    ({"rank": "x"}, "rank='x': not an integer"),
])
def test_settings_refused(config: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _settings(**config)


@pytest.mark.parametrize("text,expected", [
    ("10.0.0.1", ("10.0.0.1", 29400)), ("h:5", ("h", 5)), ("[::1]:7", ("::1", 7)), ("::1", ("::1", 29400)),
])
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


# --- after a switch of store host (failover.py): the expected nodes, the quorum ----------------

from elasticstore.rendezvous.failover import fence_quorum, majority  # noqa: E402

E, F = (str(NodeId(f"127.0.0.{i}", 100 + i, 0)) for i in (5, 6))
R5 = RoundState(1, (A, B, C, E, F))  # A hosted the store
R4 = RoundState(1, (A, B, C, D))


def failover_view(prev: RoundState, alive: set[str], joined: set[str], *, now: float = 0.0,
                  expect: set[str] | None = None, until: float | None = None,
                  quorum: int = 0) -> View:
    """Round 2 after a loss: ``ctl/restart/1`` is set (a new host seeds it), min_nodes joined
    at 0.0."""
    return View(2, prev, frozenset(alive), frozenset(joined), True, 0.0, now,
                frozenset(expect or ()), until, quorum)


# (name, view, min, max, last_call, expected action)
FAILOVER_TABLE = [
    ("new host: an expected survivor not here yet is waited for until expect_until",
     failover_view(R5, {B, C, E}, {B, C, E}, now=3.0, expect={B, C, E, F}, until=10.0,
                   quorum=3), 1, 5, 1.0, Wait(10.0)),
    ("new host: at expect_until the round forms without the expected node",
     failover_view(R5, {B, C, E}, {B, C, E}, now=10.0, expect={B, C, E, F}, until=10.0,
                   quorum=3), 1, 5, 1.0, Complete(RoundState(2, (B, C, E)))),
    ("new host: every expected node joined, no wait for expect_until",
     failover_view(R5, {B, C, E, F}, {B, C, E, F}, now=0.5, expect={B, C, E, F}, until=10.0,
                   quorum=3), 1, 5, 1.0, Complete(RoundState(2, (B, C, E, F)))),
    ("expected nodes without an expect_until are not waited for",
     failover_view(R5, {B, C, E}, {B, C, E}, now=0.5, expect={B, C, E, F}, until=None,
                   quorum=3), 1, 5, 1.0, Complete(RoundState(2, (B, C, E)))),
    ("new host: fewer than a strict majority of the last round waits, past expect_until",
     failover_view(R4, {B, C}, {B, C}, now=20.0, expect={B, C}, until=10.0,
                   quorum=max(majority(R4), fence_quorum(R4))), 1, 4, 1.0, Wait(None)),
    ("after a loss, fewer than the quorum of the last round waits (a newcomer does not count)",
     failover_view(R1, {C, D}, {C, D}, now=5.0, quorum=fence_quorum(R1)), 1, 4, 1.0, Wait(None)),
    ("after a loss, exactly half of the last round passes fence_quorum",
     failover_view(R4, {A, B}, {A, B}, now=0.0, quorum=fence_quorum(R4)), 1, 4, 1.0,
     Complete(RoundState(2, (A, B)))),
    ("after a loss, half of the last round plus a newcomer passes fence_quorum",
     failover_view(R4, {C, D, E}, {C, D, E}, now=5.0, quorum=fence_quorum(R4)), 1, 4, 1.0,
     Complete(RoundState(2, (C, D, E)))),
    ("a quorum of 0 (another backend, failover=0): one survivor of three forms a round",
     failover_view(R1, {C}, {C}, now=0.0), 1, 3, 1.0, Complete(RoundState(2, (C,)))),
]


@pytest.mark.parametrize("name,v,lo,hi,last_call,expected", FAILOVER_TABLE,
                         ids=[t[0] for t in FAILOVER_TABLE])
def test_decide_after_a_switch(name: str, v: View, lo: int, hi: int, last_call: float,
                               expected: object) -> None:
    assert decide(v, lo, hi, last_call) == expected


@pytest.mark.parametrize("participants,majority_,fence", [
    (1, 1, 1), (2, 2, 1), (3, 2, 2), (4, 3, 2), (5, 3, 3), (6, 4, 3), (7, 4, 4),
])
def test_majority_and_fence_quorum(participants: int, majority_: int, fence: int) -> None:
    """A new host's first round needs a strict majority, any later round at least half: two
    sides of a partition can never both reach theirs (one side holds at most half)."""
    state = RoundState(1, tuple(str(NodeId(f"10.0.0.{i}", 1, 0)) for i in range(participants)))
    assert (majority(state), fence_quorum(state)) == (majority_, fence)
    for side in range(participants + 1):  # a split into side | participants - side
        other = participants - side
        assert not (side >= majority_ and other >= fence), (side, other)


def test_short_of_quorum_names_the_quorum_in_the_timeout() -> None:
    from elasticstore.rendezvous.decisions import short_of_quorum

    assert short_of_quorum(R1, frozenset({C}), 2) == (
        "; only 1 of round 1's 3 participants joined and the round needs 2 of them (the others "
        "may be running on the other side of a partition)")
    assert short_of_quorum(R1, frozenset({C, D}), 2).startswith("; only 1 of round 1's 3")
    assert short_of_quorum(R1, frozenset({B, C}), 2) == ""  # met: not why
    assert short_of_quorum(R1, frozenset({C}), 0) == ""  # no quorum (failover=0, etcd)
    assert short_of_quorum(None, frozenset({A}), 0) == ""  # the first round
