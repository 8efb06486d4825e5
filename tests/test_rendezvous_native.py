"""The rendezvous on the native store, with real processes: each simulated node on its own
loopback address (127.0.0.2, ...), the rendezvous server hosted by this test process."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rdzv_procs import Agents  # noqa: E402

import elasticstore  # noqa: E402

pytestmark = pytest.mark.slow

FAST = {"last_call_timeout": 0.3, "join_timeout": 30}


@pytest.fixture
def endpoint() -> Iterator[str]:
    with elasticstore.StoreServer("127.0.0.1", 0) as server:
        yield server.address


def agents(endpoint: str, lo: int, hi: int, **conf: object) -> Agents:
    return Agents(backend="elasticstore", endpoint=endpoint, run_id="job", min=lo, max=hi,
                  conf={**FAST, **conf})


def test_three_nodes_unique_deterministic_ranks(endpoint: str) -> None:
    with agents(endpoint, 3, 3) as group:
        nodes = group.start_together([f"127.0.0.{i}" for i in (4, 2, 3)])
        rounds = [a.expect("round") for a in nodes]
        assert [r["rank"] for r in rounds] == [2, 0, 1]  # by address, not by arrival
        assert {r["world"] for r in rounds} == {3} and {r["round"] for r in rounds} == {1}
        assert len({r["boot"] for r in rounds}) == 1 and rounds[1]["boot"].startswith("127.0.0.2:")


def test_sigkill_gives_survivors_a_new_round(endpoint: str) -> None:
    with agents(endpoint, 2, 3, ) as group:
        nodes = group.start_together([f"127.0.0.{i}" for i in (2, 3, 4)], rounds=2)
        first = [a.expect("round") for a in nodes]
        assert sorted(r["rank"] for r in first) == [0, 1, 2]
        killed_at = nodes[2].kill()
        waiting = [a.expect("waiting", 10) for a in nodes[:2]]
        second = [a.expect("round", 15) for a in nodes[:2]]
        assert [r["world"] for r in second] == [2, 2] and [r["rank"] for r in second] == [0, 1]
        assert not any(r["stale"] for r in second)  # a fresh worker store for round 2
        assert second[0]["boot"] != first[0]["boot"]
        noticed = max(w["t"] for w in waiting) - killed_at
        new_round = max(r["t"] for r in second) - killed_at
        print(f"SIGKILL -> num_nodes_waiting>0: {noticed:.3f}s; -> new round: {new_round:.3f}s "
              f"(last_call_timeout {FAST['last_call_timeout']}s)")
        assert noticed < 2.0


def test_scale_up_one_two_three(endpoint: str) -> None:
    with agents(endpoint, 1, 3) as group:
        a = group.start("127.0.0.2", rounds=3)
        assert a.expect("round")["world"] == 1
        b = group.start("127.0.0.3", rounds=2)
        a.expect("waiting")
        r2 = [a.expect("round"), b.expect("round")]
        assert [(r["round"], r["rank"], r["world"]) for r in r2] == [(2, 0, 2), (2, 1, 2)]
        c = group.start("127.0.0.4", rounds=1)
        a.expect("waiting")
        b.expect("waiting")
        r3 = [a.expect("round"), b.expect("round"), c.expect("round")]
        assert [(r["round"], r["rank"], r["world"]) for r in r3] == [(3, 0, 3), (3, 1, 3), (3, 2, 3)]


def test_standby_replaces_a_dead_node(endpoint: str) -> None:
    with agents(endpoint, 1, 2) as group:
        nodes = group.start_together([f"127.0.0.{i}" for i in (2, 3)], rounds=2)
        assert sorted(a.expect("round")["rank"] for a in nodes) == [0, 1]
        standby = group.start("127.0.0.4", rounds=1)
        time.sleep(1.0)  # a full round is not disturbed by a standby
        assert all(a.events.empty() for a in nodes) and standby.events.qsize() <= 1
        nodes[0].kill()
        nodes[1].expect("waiting", 10)
        got = [nodes[1].expect("round", 15), standby.expect("round", 15)]
        assert [(r["round"], r["rank"], r["world"]) for r in got] == [(2, 0, 2), (2, 1, 2)]


def test_interrupted_node_leaves_only_itself(endpoint: str) -> None:
    with agents(endpoint, 1, 3) as group:
        *stays, leaves = group.start_together(
            [f"127.0.0.{i}" for i in (2, 3, 4)], rounds=2,
            per={"127.0.0.4": {"rounds": 1, "after": "shutdown"}},
        )
        for a in [*stays, leaves]:
            a.expect("round")
        assert leaves.expect("done")["closed"] is False
        for a in stays:
            a.expect("waiting", 10)
        got = [a.expect("round", 15) for a in stays]
        assert [(r["round"], r["world"]) for r in got] == [(2, 2), (2, 2)]


def test_join_timeout_names_who_joined(endpoint: str) -> None:
    with agents(endpoint, 3, 3, join_timeout=1.5) as group:
        nodes = group.start_together([f"127.0.0.{i}" for i in (2, 3)], after="shutdown")
        for a in nodes:
            err = a.expect("error", 30)
            assert err["type"] == "RendezvousTimeoutError"
            assert "join_timeout=1.5s" in err["msg"] and "127.0.0.2-" in err["msg"]
            assert "127.0.0.3-" in err["msg"] and "(2)" in err["msg"]


def test_closed_rendezvous_refuses_new_rounds(endpoint: str) -> None:
    with agents(endpoint, 1, 2) as group:
        a = group.start("127.0.0.2", after="close")
        a.expect("round")
        assert a.expect("done")["closed"] is True
        b = group.start("127.0.0.3")
        assert b.expect("error")["type"] == "RendezvousClosedError"
