"""The two loops that apply ``decisions``: the decider of a round and the ring watcher.

``Decider`` watches the run's keys (O(n) events, on one node only), feeds
:func:`decisions.decide` and writes the round record once with compare-and-set.
``RingWatcher`` (one per participant, on its own connection) watches the successor's liveness
key and sets ``ctl/restart/R`` when it vanishes. ``await_round`` is a waiting node's loop. ``DeciderCheck`` (a waiting node, on a store
that keeps silent sessions open) removes a decider that went silent, so another takes over.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError

from ..errors import StoreNetworkError, WatchCompactedError
from . import decisions, failover
from .backend import StoreBackend
from .settings import RendezvousSettings
from .state import Keys, RoundState

__all__ = ["Decider", "DeciderCheck", "Heartbeat", "RingWatcher", "await_round"]

log = logging.getLogger(__name__)

_UNWATCHED_POLL = 30.0  # s: a ring watcher's watch bound where no beat is judged (etcd)
# A decider reads the run's keys again (one pass ends) after max(CATCH_UP, a sixteenth of the keys
# it read) events, or after CATCH_UP_MIN events once the pass is CATCH_UP_AFTER seconds old:
# reads stay O(1) per event, and at most a few per second when a storm keeps it behind.
CATCH_UP, CATCH_UP_MIN, CATCH_UP_AFTER = 64, 16, 0.1


def _names(keys: list[str]) -> set[str]:
    return {k.rsplit("/", 1)[1] for k in keys}


class Decider:
    """Forms round ``target``; this node holds ``ctl/decider/{target}``."""

    def __init__(
        self,
        *,
        backend: StoreBackend,
        keys: Keys,
        settings: RendezvousSettings,
        target: int,
        deadline: float,
        on_deadline: Callable[[], None],
        fence: Callable[[], None] | None = None,
    ) -> None:
        self._b, self._k, self._s = backend, keys, settings
        self._target, self._deadline, self._on_deadline = target, deadline, on_deadline
        self._fence = fence  # raises when this store must not form a round (host_loss._fence)
        self._min_since: float | None = None  # kept across passes: the last call goes on
        self._passes = 0
        self._wrote = False

    def run(self) -> RoundState:
        try:
            # A pass per compacted watch, lost compare-and-set or catch-up (CATCH_UP); each
            # reads the run's keys again, and the deadline bounds them all.
            for _ in range(1 << 20):
                state = self._form()
                self._passes += 1
                if state is not None:
                    return state
            raise RuntimeError(f"round {self._target}: could not write the round record")
        finally:
            # Kept once the round is written (the next round's decider deletes it, and it goes
            # with this node's session): its delete would wake every node waiting on ctl/.
            if not self._wrote:
                self._b.delete(self._k.decider(self._target))

    def _form(self) -> RoundState | None:
        b, k, s, target = self._b, self._k, self._s, self._target
        rev = b.revision()
        prev_bytes = b.get(k.round)
        prev = RoundState.from_json(prev_bytes) if prev_bytes is not None else None
        if prev is not None and prev.round >= target:
            return prev
        join_prefix, restart_key = k.join_prefix(target), k.restart(target - 1)
        run_keys = b.list(k.base)  # one read: the live and the joined nodes
        alive = _names([key for key in run_keys if key.startswith(k.alive_prefix)])
        joined = _names([key for key in run_keys if key.startswith(join_prefix)])
        restart = restart_key in run_keys if prev else False
        if self._passes and k.closed in run_keys:  # set while a pass's events were skipped
            raise RendezvousClosedError(f"rendezvous {s.run_id!r} closed")
        expect, expect_until, quorum = self._quorum(prev)
        # Past this many events in one pass, the keys are read again instead: one watch per
        # event lags behind a join storm of thousands (a round trip and, in a busy process, a
        # wait for the interpreter each), while one list jumps over the whole backlog.
        catch_up, events = max(CATCH_UP, (len(alive) + len(joined)) // 16), 0
        early = time.monotonic() + CATCH_UP_AFTER
        while True:
            now = time.monotonic()
            if now >= self._deadline:
                self._late(prev, frozenset(joined), quorum)
            min_since = self._min_since = decisions.update_min_since(
                self._min_since, len(joined), s.min_nodes, now)
            view = decisions.View(
                target, prev, frozenset(alive), frozenset(joined), restart, min_since, now,
                expect, expect_until, quorum,
            )
            action = decisions.decide(view, s.min_nodes, s.max_nodes, s.last_call_timeout)
            if isinstance(action, decisions.Complete):
                if self._fence is not None:
                    self._fence()
                if not b.cas(k.round, prev_bytes, action.state.to_json()):
                    return None  # re-read: the record changed under us
                self._wrote = True
                self._clean(target)
                return action.state
            if isinstance(action, decisions.Signal):
                log.info("round %d: asking round %d to re-rendezvous (%s)",
                         target, target - 1, action.reason)
                b.create(restart_key, json.dumps({"reason": action.reason}))
                restart = True
                continue
            until = self._deadline if action.until is None else min(action.until, self._deadline)
            try:
                event = b.watch(k.base, rev, until - now)
            except WatchCompactedError:
                return None
            if event is None:
                continue
            events += 1
            if events > catch_up or (events > CATCH_UP_MIN and time.monotonic() > early):
                return None  # read again: the next pass starts from the current revision
            rev = event.version
            name = event.key.rsplit("/", 1)[-1]
            if event.key.startswith(k.alive_prefix):
                (alive.add if event.kind == "set" else alive.discard)(name)
            elif event.key.startswith(join_prefix):
                (joined.add if event.kind == "set" else joined.discard)(name)
            elif event.key == restart_key and event.kind == "set":
                restart = True
            elif event.key == k.closed and event.kind == "set":
                raise RendezvousClosedError(f"rendezvous {s.run_id!r} closed")
            elif event.key == k.round and event.kind == "set":
                return None

    def _late(self, prev: RoundState | None, joined: frozenset[str], quorum: int) -> None:
        """``on_deadline`` (raises past the deadline), its message naming a quorum not met."""
        try:
            self._on_deadline()
        except RendezvousTimeoutError as exc:
            note = decisions.short_of_quorum(prev, joined, quorum)
            if not note:
                raise
            raise RendezvousTimeoutError(f"{exc}{note}") from None

    def _quorum(self, prev: RoundState | None) -> tuple[frozenset[str], float | None, int]:
        """(nodes waited for though not live yet, until when, the quorum of ``prev``): on an
        agent-hosted native store (a host record), see ``failover.py``; else nothing."""
        if prev is None or not self._s.failover or self._b.name != "elasticstore":
            return frozenset(), None, 0
        if failover.HostRecord.from_json(self._b.get(self._k.host)) is None:
            return frozenset(), None, 0
        record = failover.FailoverRecord.from_json(self._b.get(self._k.failover))
        if record is not None and record.round == prev.round:  # the first round on a new host
            until = time.monotonic() + failover.FAILOVER_WAIT
            return frozenset(record.expect), until, max(record.quorum, failover.fence_quorum(prev))
        return frozenset(), None, failover.fence_quorum(prev)

    def _clean(self, target: int) -> None:
        """Drops the previous round's decider key and the signals of round ``target - 2``
        (nobody reads them any more)."""
        if target > 1:
            self._b.delete(self._k.decider(target - 1))
        if target > 2:
            self._b.delete(self._k.restart(target - 2))
            self._b.delete(self._k.boot(target - 2))


class RingWatcher:
    """Watches ``successor``'s liveness key; sets ``ctl/restart/{rnd}`` when it vanishes, or
    (``silent_after``: a backend whose store does not end silent sessions) when its beat count
    did not change for that long: the key is then deleted, so the next decider does not wait
    for it."""

    def __init__(self, backend: StoreBackend, keys: Keys, rnd: int, successor: str,
                 silent_after: float | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self._b, self._k, self._rnd, self._succ = backend, keys, rnd, successor
        self._silent_after = silent_after
        self._on_error = on_error  # told when the watch fails (the store's host may be lost)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"rdzv-ring-{rnd}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        b, key, beat = self._b, self._k.alive(self._succ), self._k.beat(self._succ)
        silent_after = self._silent_after
        try:
            rev = b.revision()
            reason = "lost"
            if b.get(key) is not None:
                # The liveness key changes only when the node goes (no event per beat): its
                # beat count is read every silent_after/2 instead, and judged unchanged only
                # between two reads silent_after apart (a late read never makes it silent).
                poll = _UNWATCHED_POLL if silent_after is None else silent_after / 2
                seen = b.get(beat) if silent_after is not None else None
                since = time.monotonic()
                while not self._stop.is_set():
                    try:
                        event = b.watch(key, rev, poll)
                    except WatchCompactedError:
                        # The store's history moved past ``rev`` (a watch that timed out
                        # keeps it; the run's beats alone fill the history in minutes at
                        # scale): read the key again and go on from now, as etcd clients do.
                        rev = b.revision()
                        if b.get(key) is None:
                            break
                        continue
                    if event is not None:
                        rev = event.version
                        if event.key == key and event.kind == "delete":
                            break
                        continue
                    if silent_after is None:
                        continue
                    value, now = b.get(beat), time.monotonic()
                    if value != seen:
                        seen, since = value, now
                    elif now - since >= silent_after:
                        reason = "silent"
                        b.delete(key)
                        b.delete(beat)
                        break
            if not self._stop.is_set():
                log.info("round %d: %s %s", self._rnd, reason, self._succ)
                b.create(self._k.restart(self._rnd), json.dumps({"reason": f"{reason} {self._succ}"}))
        except Exception as exc:
            if not self._stop.is_set():
                log.warning("round %d: watching %s failed: %s", self._rnd, self._succ, exc)
                if self._on_error is not None:
                    self._on_error(exc)
        finally:
            try:
                b.close()
            except Exception:
                pass

    def stop(self) -> None:
        """Stops at once: closing the connection ends the blocked watch."""
        self._stop.set()
        try:
            self._b.close()
        except Exception:
            pass
        self._thread.join(timeout=1.0)


class DeciderCheck:
    """A waiting node's check of round ``target``'s decider, for a backend whose store keeps a
    silent session open (native: the decider's session-bound ``ctl/decider/T`` would outlive a
    SIGSTOP, a partition or a power loss, and the others would wait until ``join_timeout``).

    One waiting node checks: the one that created the session-bound ``ctl/check/T`` (the others
    claim it again, :meth:`claim`, when its delete comes as an event), so a thousand waiting
    nodes cost the store and their process no more than one. Every ``ttl/4`` seconds
    (:meth:`due`), :meth:`check` reads who decides and that node's beat count, which its
    heartbeat rewrites every ``ttl/3``. Unchanged (or missing) for ``ttl`` seconds: the decider
    is silent, as a ring watcher would judge it; its join, liveness and decider keys are
    deleted (the decider key last), and the waiting nodes, told by that delete, race to take
    its place. Only a silent decider is replaced: a late check (a busy process) reads a count
    that moved on."""

    def __init__(self, backend: StoreBackend, keys: Keys, target: int, ttl: float,
                 node: str) -> None:
        self._b, self._k, self._target, self._ttl, self._node = backend, keys, target, ttl, node
        self._period = ttl / 4
        self._next = 0.0
        self._seen: tuple[bytes | None, bytes | None] | None = None  # (decider, its beat count)
        self._since = 0.0
        self._mine = False
        self.claim()

    def claim(self) -> None:
        """Becomes the round's checker unless another node is."""
        if not self._mine:
            self._mine = self._b.create(self._k.check(self._target), self._node, ephemeral=True)
            self._next = time.monotonic() + self._period

    def release(self) -> None:
        """Leaves the check to another waiting node (this one decides, or stops waiting). Its
        key is bound to this node's session: where the connection is lost and cannot be made
        again, the session, and the key with it, ended on the server, so there is nothing left
        to delete, and this cleanup does not decide that the store is lost (it would end a wait
        that already has its round, or hide why the wait ended): the node's next call does."""
        if self._mine:
            self._mine = False
            try:
                self._b.delete(self._k.check(self._target))
            except StoreNetworkError as exc:
                log.info("round %d: the check key went with the lost connection (%s)",
                         self._target, exc)

    def due(self) -> float | None:
        """Seconds until the next check; None when another node checks."""
        return max(0.0, self._next - time.monotonic()) if self._mine else None

    def check(self) -> bool:
        """True when a silent decider was removed (a no-op before the next check is due)."""
        now = time.monotonic()
        if not self._mine or now < self._next:
            return False
        self._next = now + self._period
        decider = self._b.get(self._k.decider(self._target))
        if decider is None:
            return False  # gone already: the waiting nodes see its delete
        node = decider.decode()
        seen = (decider, self._b.get(self._k.beat(node)))
        if seen != self._seen:
            self._seen, self._since = seen, now
            return False
        if now - self._since < self._ttl:
            return False
        log.warning("round %d: decider %s silent for %.1fs (lease_ttl %gs): taking over",
                    self._target, node, now - self._since, self._ttl)
        self._b.delete(self._k.join(self._target, node))
        self._b.delete(self._k.alive(node))
        self._b.delete(self._k.beat(node))
        if self._b.get(self._k.decider(self._target)) == decider:  # not replaced meanwhile
            self._b.delete(self._k.decider(self._target))
        self._seen = None
        return True


def await_round(backend: StoreBackend, keys: Keys, target: int, check: DeciderCheck | None,
                check_late: Callable[[], None], deadline: float,
                on_closed: Callable[[bytes], NoReturn]) -> RoundState | None:
    """A waiting node: watches ``ctl/`` until round ``target`` (or later) is written; None when
    its decider left before writing it. ``check_late`` raises past ``deadline``; ``check``
    (when given) removes a silent decider."""

    def read_round() -> RoundState | None:
        data = backend.get(keys.round)
        return None if data is None else RoundState.from_json(data)

    while True:
        rev = backend.revision()
        state = read_round()
        if state is not None and state.round >= target:
            return state
        if backend.get(keys.decider(target)) is None:
            return None
        while True:
            check_late()
            wait = deadline - time.monotonic()
            due = None if check is None else check.due()
            try:
                event = backend.watch(keys.ctl, rev, wait if due is None else min(wait, due))
            except WatchCompactedError:
                break  # re-read
            if check is not None:
                check.check()  # its delete of the decider key comes as an event
            if event is None:
                continue  # the deadline check raises
            rev = event.version
            if event.key == keys.round:
                state = RoundState.from_json(event.value) if event.kind == "set" else None
                if state is not None and state.round >= target:
                    return state
            elif event.key == keys.decider(target) and event.kind == "delete":
                state = read_round()
                return state if state is not None and state.round >= target else None
            elif event.key == keys.closed and event.kind == "set":
                on_closed(event.value)
            elif event.key == keys.check(target) and event.kind == "delete" and check:
                check.claim()  # the node that checked the decider left


class Heartbeat:
    """Keeps a node's liveness key and its beat count (bound to a session of their own) fresh
    every ``period`` seconds, for a store that does not end silent sessions; the ring watchers
    and ``DeciderCheck`` time out a node whose count stopped changing. The beats come from a
    native thread that never takes the GIL: a busy interpreter (a thousand agents' threads in
    one process) does not delay them, while a stopped or cut-off process stops them."""

    def __init__(self, backend: StoreBackend, keys: Keys, node: str, value: str,
                 period: float) -> None:
        # The count goes to beat/R/{node}, outside the decider's prefix (no event per beat for
        # it); alive/{node} is created on the same session and then left alone.
        self._beat = backend.keep_fresh(keys.beat(node), value, period, keys.alive(node))

    def beat(self) -> None:
        self._beat.beat()

    def stop(self) -> None:
        """Stops beating at once; closing its session deletes the key."""
        self._beat.stop()
