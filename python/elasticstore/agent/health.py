"""The node health check before a node joins a round (``--health-check``, ``--health-check-cmd``).

``HealthGate.gate(rounds, failures)`` is called by the agent's loop before each join; the gate
gets its parts from the agent (settings, event log, rendezvous, signal socket, a live fork
server) and knows nothing of the agent itself. A check is due before the node's
first join, and before each join that follows a failure on this node (its workers failed, or its
fork server died: the failures that spend a restart); not after a round ended elsewhere (a node
lost or joining, another node's failure): this node was healthy a moment ago, and every node
waits for it in the next round, so a check there would only lengthen every recovery.

A passing check prints one short line with its time. A failing one:

- prints ``[elasticstore-run] health check failed: <reason>; retrying in <N>s``, appends a
  ``health_check`` event (``ok``, ``reason``, ``seconds``, ...; every check, passing too) and
  publishes the node's state ``unhealthy: <reason>`` (``elasticstore status`` shows it);
- steps aside (``handler.step_aside()``): its liveness key goes, so the others' next round forms
  without it (after a failure here they would otherwise wait for it to come back) and the node
  is not listed as waiting;
- waits ``BACKOFF_FIRST_S``, doubling up to ``BACKOFF_MAX_S``, and checks again, until the check
  passes, a signal comes (during the check or the wait: the check's processes are killed and the
  agent exits at once, ``128 + signal``), or the run is closed (finished, stopped): the node then
  goes on to the rendezvous, which refuses it as it refuses any node arriving late;
- gives up once the rendezvous' ``join_timeout`` has passed since its first check (the last wait
  is cut to end then, and one more check runs): a node that cannot join within it is as stuck as
  one that finds no peers. ``HealthCheckFailed`` (a ``RendezvousTimeoutError``) names the check,
  how long and how often it failed and its last reason (the command's last output lines); the
  agent exits 1.
"""

from __future__ import annotations

import selectors
import signal
import socket
import time
from collections.abc import Callable, Mapping

from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from ..rendezvous.api import AgentRendezvous
from .config import HealthSettings
from .events import EventLog
from .forkclient import ForkServer
from .healthrun import CheckResult, run_check
from .logs import say

__all__ = ["BACKOFF_FIRST_S", "BACKOFF_MAX_S", "HealthCheckFailed", "HealthGate"]

BACKOFF_FIRST_S = 5.0  # seconds before the first retry of a failed check
BACKOFF_MAX_S = 60.0  # the wait doubles up to this
REASON_CHARS = 300  # of the reason in the status record and the console line


class HealthCheckFailed(RendezvousTimeoutError):
    """The node's health check kept failing for the rendezvous' ``join_timeout``."""


class HealthGate:
    """The check before a join, for one agent: ``settings`` (``--health-check*`` and the join
    timeout that bounds the retries), ``env`` (the environment of the check's processes),
    ``events`` (the event log and status record), ``handler`` (to step aside and read whether
    the run closed), ``sig_r`` (the agent's signal wakeup socket), ``server()`` (a live fork
    server: the agent replaces one that died)."""

    def __init__(self, settings: HealthSettings, nproc: int, env: Mapping[str, str],
                 events: EventLog, handler: AgentRendezvous, sig_r: socket.socket,
                 server: Callable[[], ForkServer], clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        self.s, self._nproc, self._env = settings, nproc, dict(env)
        self._events, self._handler, self._sig_r = events, handler, sig_r
        self._server, self._clock = server, clock
        self._checked: int | None = None  # the restart count (failures here) at the last check

    def gate(self, rounds: int, failures: int) -> int | None:
        """Checks this node when a check is due (see the module doc), until it is healthy; None
        to go on to the rendezvous, or the number of a signal that came meanwhile. Raises
        ``HealthCheckFailed`` once it failed for ``join_timeout``."""
        s = self.s
        if not s.enabled or (rounds and self._checked is not None and self._checked >= failures):
            return None
        self._checked = failures
        backoff, deadline = BACKOFF_FIRST_S, self._clock() + s.join_timeout
        for attempt in range(1, 1 << 30):
            result = self._check()
            if isinstance(result, int):
                say(f"[elasticstore-run] got {_signame(result)} during the health check: not joining")
                return result
            reason = _one_line(result.reason)
            self._events.emit("health_check", ok=result.ok, reason=reason or None,
                              seconds=round(result.seconds, 4),
                              warm_wait=round(result.warm_wait, 4), attempt=attempt,
                              check="command" if s.command else "default", **result.detail)
            record = {"ok": result.ok, "reason": reason or None, "at": time.time(),
                      "seconds": round(result.seconds, 3), "attempt": attempt}
            if result.ok:
                say(f"[elasticstore-run] health check passed in {result.seconds:.2f}s"
                    f"{_summary(result)}")
                if attempt > 1:
                    self._events.publish(state="joining (health check passed)", health_check=record)
                else:
                    self._events.publish(health_check=record)
                return None
            left = deadline - self._clock()
            if left <= 0:
                what = f"{s.command!r}" if s.command is not None else "the default check"
                raise HealthCheckFailed(
                    f"health check {what} failed {attempt} time(s) in {s.join_timeout:g}s "
                    f"(join_timeout): not joining; last: {result.reason}")
            wait = min(backoff, left)
            say(f"[elasticstore-run] health check failed: {reason}; retrying in {wait:.3g}s")
            self._events.publish(state=f"unhealthy: {reason}", health_check=record)
            self._step_aside()
            sig = _wait(self._sig_r, wait)
            if sig is not None:
                say(f"[elasticstore-run] got {_signame(sig)} while unhealthy: not joining")
                return sig
            closed = self._closed()
            if closed is not None:  # the rendezvous refuses the node, or says what went wrong
                say(f"[elasticstore-run] {closed} while this node was unhealthy: not checking again")
                return None
            backoff = min(backoff * 2, BACKOFF_MAX_S)
        return None

    def _check(self) -> CheckResult | int:
        """One check through the agent's fork server."""
        env = dict(self._env)
        env.update({"LOCAL_WORLD_SIZE": str(self._nproc), "ELASTICSTORE_HEALTH_CHECK": "1"})
        return run_check(self._server(), self.s, self._nproc, env, self._sig_r, self._clock)

    def _step_aside(self) -> None:
        try:
            self._handler.step_aside()
        except Exception as exc:  # the store lost: the rendezvous will say so when the node joins
            say(f"[elasticstore-run] could not step aside in the rendezvous: {exc}")

    def _closed(self) -> str | None:
        """What ended the run ("the run was closed (finished)"), None while it is open; a store
        that does not answer ended it too (its host left): the rendezvous then says what failed."""
        try:
            if not self._handler.is_closed():
                return None
            return f"the run was closed ({self._handler.closed_reason() or 'no reason given'})"
        except Exception:
            return "the rendezvous store did not answer"


def _summary(result: CheckResult) -> str:
    d = result.detail
    if not d:
        return ""
    lo, hi = d["matmul_ms"]
    ar = d["all_reduce_ms"][1]
    return (f" ({d['processes']} process(es): matmul {lo:.1f}-{hi:.1f} ms, all_reduce "
            f"{ar:.1f} ms)")


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def _wait(sig_r: socket.socket, seconds: float) -> int | None:
    """Waits ``seconds``; the number of a signal that came meanwhile, else None."""
    deadline = time.monotonic() + seconds
    with selectors.DefaultSelector() as sel:
        sel.register(sig_r, selectors.EVENT_READ)
        for _ in range(1 << 20):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if sel.select(left):
                data = sig_r.recv(64)
                if data:
                    return int(data[0])
    return None
