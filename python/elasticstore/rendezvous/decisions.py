"""Pure decisions: (what a node sees, the clock) -> what to do. No I/O, no clock reads.

The decider of round T (one node, holder of ``ctl/decider/T``) feeds :func:`decide` the live
nodes, the live joiners of T and the previous round; the executor in ``handler.py`` applies the
action it returns. Tested as a table in ``tests/rendezvous/test_rendezvous_decisions.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .state import RoundState, node_sort_key

__all__ = [
    "Complete", "Signal", "View", "Wait", "Action", "Role", "decide", "order_nodes", "role_in",
    "late_message", "short_of_quorum", "update_min_since",
]


@dataclass(frozen=True)
class View:
    """What the decider of round ``target`` sees at ``now`` (monotonic seconds)."""

    target: int
    prev: RoundState | None  # the round before ``target`` (None: the first round)
    alive: frozenset[str]
    joined: frozenset[str]  # live nodes that joined ``target``
    restart_signalled: bool  # ``ctl/restart/{target-1}`` exists
    min_since: float | None  # when ``joined`` last reached ``min_nodes`` (None: below it)
    now: float
    # After a switch of store host (``failover.py``): nodes of ``prev`` waited for though not
    # live here yet, until ``expect_until``; and how many of ``prev``'s participants the round
    # needs (a new host: a strict majority; any agent-hosted store: at least half).
    expect: frozenset[str] = frozenset()
    expect_until: float | None = None
    quorum: int = 0


@dataclass(frozen=True)
class Wait:
    """Wait for the next change, or until ``until`` (None: no deadline of the decider's own)."""

    until: float | None


@dataclass(frozen=True)
class Signal:
    """Tell the participants of the previous round to come back (``ctl/restart``)."""

    reason: str


@dataclass(frozen=True)
class Complete:
    """Write this round record (compare-and-set on the previous one)."""

    state: RoundState


Action = Union[Wait, Signal, Complete]


def update_min_since(min_since: float | None, joined: int, min_nodes: int, now: float) -> float | None:
    """Starts the last-call clock when ``min_nodes`` joined; stops it when they drop below."""
    if joined < min_nodes:
        return None
    return now if min_since is None else min_since


def order_nodes(joined: frozenset[str], prev: RoundState | None) -> list[str]:
    """Rank order: the previous participants in their previous order (ranks stay stable where
    membership allows), then its standbys, then new nodes by address, pid, local id."""
    old = [n for n in prev.participants if n in joined] if prev else []
    waiting = [n for n in prev.standby if n in joined and n not in old] if prev else []
    seen = set(old) | set(waiting)
    new = sorted((n for n in joined if n not in seen), key=node_sort_key)
    return old + waiting + new


def decide(view: View, min_nodes: int, max_nodes: int, last_call: float) -> Action:
    prev = view.prev
    if prev is not None and not view.restart_signalled:
        back = sorted(view.joined & set(prev.participants))
        if back:  # a participant came back (its workers failed): the others must come too
            return Signal(f"re-joined {', '.join(back)}")
        # The previous round runs: replace it only when a participant is lost or a waiting node
        # fits in (a node beyond max_nodes stands by and does not disturb a full round).
        lost = sorted(n for n in prev.participants if n not in view.alive)
        if lost:
            return Signal(f"lost {', '.join(lost)}")
        newcomers = sorted(view.joined - set(prev.participants))
        if newcomers and len(prev.participants) < max_nodes:
            return Signal(f"waiting {', '.join(newcomers)}")
        return Wait(None)
    expected = {n for n in prev.participants if n in view.alive} if prev else set()
    missing = expected - view.joined
    count = len(view.joined)
    if missing or count < min_nodes or view.min_since is None:
        # Live participants of the previous round were told to come back: wait for them (a
        # dead one's liveness key vanishes and it stops being expected; join_timeout bounds it).
        return Wait(None)
    if view.expect - view.joined and view.expect_until is not None and view.now < view.expect_until:
        return Wait(view.expect_until)  # survivors still switching to a new store host
    if prev is not None and len(view.joined & set(prev.participants)) < view.quorum:
        # Too few of the previous round: the others may be the larger side of a partition.
        return Wait(None)
    if prev is not None and _back_at_once(view, prev, max_nodes):
        return _complete(view, prev, max_nodes)
    last_call_at = view.min_since + last_call
    if count >= max_nodes or view.now >= last_call_at:
        return _complete(view, prev, max_nodes)
    return Wait(last_call_at)


def _back_at_once(view: View, prev: RoundState, max_nodes: int) -> bool:
    """A round after a loss or a restart forms as soon as every live node of the previous round
    (participants and standbys) has joined, unless it would be bigger than the previous round:
    only growth waits for the last call (a node joining later gets a scale-up round)."""
    previous = set(prev.participants) | set(prev.standby)
    if not {n for n in previous if n in view.alive} <= view.joined:
        return False
    return min(len(view.joined), max_nodes) <= len(prev.participants)


def _complete(view: View, prev: RoundState | None, max_nodes: int) -> Complete:
    order = order_nodes(view.joined, prev)
    return Complete(RoundState(view.target, tuple(order[:max_nodes]), tuple(order[max_nodes:])))


@dataclass(frozen=True)
class Role:
    """A node's place in a round record: ``rank`` (None: not a participant)."""

    rank: int | None
    standby: bool


def role_in(state: RoundState, node: str) -> Role:
    return Role(state.rank_of(node), node in state.standby)


def waiting_count(restart_value: bytes | None) -> int:
    """``num_nodes_waiting`` from the round's restart signal: positive once it is set."""
    return 0 if restart_value is None else 1


def short_of_quorum(prev: RoundState | None, joined: frozenset[str], quorum: int) -> str:
    """What the decider adds to ``late_message`` when the quorum of ``prev``'s participants
    (after a loss on an agent-hosted store, ``failover.py``) is why its round did not form;
    "" when it is met."""
    have = len(joined & set(prev.participants)) if prev is not None else 0
    if prev is None or have >= quorum:
        return ""
    return (f"; only {have} of round {prev.round}'s {len(prev.participants)} participants "
            f"joined and the round needs {quorum} of them (the others may be running on the "
            "other side of a partition)")


def late_message(run_id: str, target: int, join_timeout: float, min_nodes: int, max_nodes: int,
                 joined: list[str], alive: list[str], prev: RoundState | None) -> str:
    """Why round ``target`` did not form within ``join_timeout``: who joined, who is missing."""
    joined, alive = sorted(joined), sorted(alive)
    expected = sorted(set(prev.participants) - set(joined)) if prev else []

    def names(nodes: list[str]) -> str:
        shown = ", ".join(nodes[:16]) or "none"
        return shown + (f", ... ({len(nodes) - 16} more)" if len(nodes) > 16 else "")

    return (
        f"rendezvous {run_id!r}: round {target} did not form within join_timeout="
        f"{join_timeout:g}s (nnodes {min_nodes}:{max_nodes}); joined: "
        f"{names(joined)} ({len(joined)}); missing: "
        f"{max(0, min_nodes - len(joined))} more node(s) to reach min_nodes, previous "
        f"round's nodes not back: {names(expected)}; live nodes: {names(alive)}"
    )
