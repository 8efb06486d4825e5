"""The modules a running job's workers import, shared between its nodes, so that a node that
joins it (a replacement, a standby, a scale-up) starts its first workers with them.

A node's fork server preloads what its workers import (``preload.py``); ``share_held`` gives
the modules it holds to the rendezvous (``AgentRendezvous.share_imports``, written by the
round's rank-0 node), every ``SHARE_PERIOD_S`` while they grow. A node's agent, before its
first round, reads that list (``preload_job_imports``) and teaches it to its fork server, which
imports it before it serves (``preload.Preloader.teach``, checked as workers' reports are), and
reads it again while it waits for that round (``reread_job_imports``): a standby that started
with the job finds the list only once the rank-0 node's fork server preloaded.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..rendezvous.api import AgentRendezvous
from .logs import say

__all__ = ["REREAD_S", "SHARE_PERIOD_S", "held_names", "preload_job_imports",
           "reread_job_imports", "share_held", "teach"]

SHARE_PERIOD_S = 5.0  # how often the modules a fork server holds are looked at (share_held)
REREAD_S = 5.0  # how often a node waiting for its first round reads the list again
TEACH_BYTES = 96 * 1024  # the module names sent in one "teach" (preload.SHARED_BYTES)
TEACH_WAIT_S = 90.0  # the longest a node waits for them to be imported (the server: 60 s)
TEACH_RETRY_S = 0.2  # asked again while a stand-in answers for the server


class ForkServer(Protocol):
    """What this module uses of ``forkclient.ForkServer``, which imports this module (its
    ``settle_preloads`` calls ``share_held``)."""

    learn: bool
    sharing: Any
    closed: threading.Event

    def ask(self, request: dict[str, Any], timeout: float) -> bytes | None: ...

    def alive(self) -> bool: ...


def held_names(server: ForkServer, timeout: float = 30.0) -> list[str] | None:
    """The modules ``server`` preloaded from its workers' reports (sorted); None when it did not
    answer ([] from a stand-in, while the server imports)."""
    try:
        names = json.loads(server.ask({"op": "names"}, timeout) or b"null")
    except ValueError:
        return None
    return [str(n) for n in names] if isinstance(names, list) else None


def teach(server: ForkServer, names: list[str], timeout: float = TEACH_WAIT_S) -> bool:
    """Has ``server`` import ``names`` (at most ``TEACH_BYTES`` of them) before it serves; True
    once it did, False when it could not within ``timeout``. A stand-in serving meanwhile (an
    idle import) answers ``busy``: asked again every ``TEACH_RETRY_S``."""
    taken, size = [], 0
    for name in names:
        size += len(name) + 4
        if size > TEACH_BYTES:
            break
        taken.append(name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = server.ask({"op": "teach", "names": taken}, max(0.1, deadline - time.monotonic()))
        if answer != b"busy":
            return answer == b"done"
        time.sleep(TEACH_RETRY_S)
    return False


class _Sharing:
    """``share_held``'s thread for one fork server: it lives as long as the server."""

    def __init__(self, server: ForkServer, share: Callable[[list[str]], bool]) -> None:
        self.server, self.share, self.given, self.said = server, share, 0, False
        self.lock = threading.Lock()
        threading.Thread(target=self._run, name="share-imports", daemon=True).start()

    def _run(self) -> None:
        for _ in range(1 << 40):
            if not self.step() or self.server.closed.wait(SHARE_PERIOD_S):
                return

    def step(self) -> bool:
        """One look (any thread); False once the server is gone."""
        names = held_names(self.server) if self.server.alive() else None
        if names is None:
            return False
        with self.lock:
            if len(names) > self.given:
                try:
                    if self.share(names):  # written (this node is its round's rank 0)
                        self.given = len(names)
                except Exception as exc:  # an optimisation: the job goes on without it
                    if not self.said:
                        say(f"[elasticstore-run] sharing the preloaded modules failed: {exc}")
                    self.said = True
        return True


def share_held(server: ForkServer, share: Callable[[list[str]], bool], now: bool = False) -> None:
    """Gives ``share`` the modules ``server`` holds whenever it holds more than ``share`` last
    took (it returns whether it did), in a thread of its own from the first call on (the latest
    ``share`` is used), every ``SHARE_PERIOD_S`` while the server lives; ``now``: also once
    before it returns (a round starts with new preloads). Never raises: a failure is said once."""
    if not server.learn:
        return
    if server.sharing is None:
        server.sharing = _Sharing(server, share)
    server.sharing.share = share
    if now:
        server.sharing.step()


def preload_job_imports(handler: AgentRendezvous, server: ForkServer) -> int:
    """Before a node's first round: its fork server imports the modules the job's workers
    import, as the run's list has them (``share_imports`` by a round's rank-0 node;
    ``preload.Preloader.teach`` checks each), so that its first workers start with them; a node
    that takes a lost node's place then costs the others no more than one that restarts. Says
    what it did; never fails the join (nothing listed yet: a new job's nodes, nothing to do).
    Returns how many names it taught."""
    try:
        return _teach_longer(handler, server, 0, quiet=False)
    except Exception as exc:  # an optimisation: the join goes on without it
        say(f"[elasticstore-run] reading the job's modules to preload failed: {exc}")
        return 0


def _teach_longer(handler: AgentRendezvous, server: ForkServer, taught: int,
                  quiet: bool = True, done: threading.Event | None = None) -> int:
    """Reads the run's list and teaches it to ``server`` when it is longer than ``taught``
    names (not once ``done`` is set); returns the length taught. Raises what reading raises."""
    if not server.learn:
        return taught
    names = handler.shared_imports()
    if len(names) <= taught or (done is not None and done.is_set()):
        return taught
    if not teach(server, names) and not quiet:
        say("[elasticstore-run] the fork server did not import the job's modules in time: "
            "this node's first workers import them")
    return len(names)


def reread_job_imports(handler: AgentRendezvous, server: ForkServer, taught: int,
                       done: threading.Event) -> None:
    """While a node waits for its first round (a standby, nodes still meeting): the run's list
    again every ``REREAD_S``, a longer one taught to its fork server. The list is written once
    the rank-0 node's fork server preloaded, seconds into the job: a standby that started with
    the job finds it only then. Ends quietly on an error (the join goes on without it)."""
    if not server.learn:
        return
    for _ in range(1 << 40):
        if done.wait(REREAD_S):
            return
        try:
            taught = _teach_longer(handler, server, taught, done=done)
        except Exception:  # the store lost, the server gone: noticed where they matter
            return
