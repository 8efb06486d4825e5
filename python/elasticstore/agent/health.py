"""The node health check before a node joins a round (``--health-check``, ``--health-check-cmd``).

``gate(agent)`` is called by the agent's loop before each join. A check is due before the node's
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
  goes on to the rendezvous, which refuses it as it refuses any node arriving late.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import time
import weakref
from typing import TYPE_CHECKING

from .healthrun import CheckResult, run_check
from .logs import say

if TYPE_CHECKING:
    from .agent import Agent

__all__ = ["BACKOFF_FIRST_S", "BACKOFF_MAX_S", "gate"]

BACKOFF_FIRST_S = 5.0  # seconds before the first retry of a failed check
BACKOFF_MAX_S = 60.0  # the wait doubles up to this
REASON_CHARS = 300  # of the reason in the status record and the console line

# agent -> its restart count (failures here) when it last checked itself
_checked: weakref.WeakKeyDictionary[Agent, int] = weakref.WeakKeyDictionary()


def gate(agent: Agent) -> int | None:
    """Checks this node when a check is due (see the module doc), until it is healthy; None to
    go on to the rendezvous, or the number of a signal that came meanwhile."""
    s = agent.s.health
    failures = agent._failures_used
    if not s.enabled or (agent._rounds and _checked.get(agent, 0) >= failures):
        return None
    _checked[agent] = failures
    backoff = BACKOFF_FIRST_S
    for attempt in range(1, 1 << 30):
        result = _check(agent)
        if isinstance(result, int):
            say(f"[elasticstore-run] got {_signame(result)} during the health check: not joining")
            return result
        reason = _one_line(result.reason)
        agent.events.emit("health_check", ok=result.ok, reason=reason or None,
                          seconds=round(result.seconds, 4), warm_wait=round(result.warm_wait, 4),
                          attempt=attempt, check="command" if s.command else "default",
                          **result.detail)
        record = {"ok": result.ok, "reason": reason or None, "at": time.time(),
                  "seconds": round(result.seconds, 3), "attempt": attempt}
        if result.ok:
            say(f"[elasticstore-run] health check passed in {result.seconds:.2f}s{_summary(result)}")
            if attempt > 1:
                agent.events.publish(state="joining (health check passed)", health_check=record)
            else:
                agent.events.publish(health_check=record)
            return None
        say(f"[elasticstore-run] health check failed: {reason}; retrying in {backoff:g}s")
        agent.events.publish(state=f"unhealthy: {reason}", health_check=record)
        _step_aside(agent)
        sig = _wait(agent._sig_r, backoff)
        if sig is not None:
            say(f"[elasticstore-run] got {_signame(sig)} while unhealthy: not joining")
            return sig
        closed = _closed(agent)
        if closed is not None:  # the rendezvous refuses the node, or says what went wrong
            say(f"[elasticstore-run] {closed} while this node was unhealthy: not checking again")
            return None
        backoff = min(backoff * 2, BACKOFF_MAX_S)
    return None


def _check(agent: Agent) -> CheckResult | int:
    """One check through the agent's fork server (a fresh one when it died)."""
    server = agent._server
    assert server is not None
    if not server.alive():
        say("[elasticstore-run] the fork server died: starting a new one")
        server.close()
        agent._server = server = agent._server_factory(agent.s.warm)
    env = dict(os.environ)
    env.update(agent.s.extra_env)
    env.update({"LOCAL_WORLD_SIZE": str(agent.s.nproc), "ELASTICSTORE_HEALTH_CHECK": "1",
                "TORCHELASTIC_RUN_ID": agent.s.run_id})
    return run_check(server, agent.s.health, agent.s.nproc, env, agent._sig_r,
                     agent._clock)


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


def _step_aside(agent: Agent) -> None:
    try:
        agent.handler.step_aside()
    except Exception as exc:  # the store lost: the rendezvous will say so when the node joins
        say(f"[elasticstore-run] could not step aside in the rendezvous: {exc}")


def _closed(agent: Agent) -> str | None:
    """What ended the run ("the run was closed (finished)"), None while it is open; a store
    that does not answer ended it too (its host left): the rendezvous then says what failed."""
    try:
        if not agent.handler.is_closed():
            return None
        return f"the run was closed ({agent.handler.closed_reason() or 'no reason given'})"
    except Exception:
        return "the rendezvous store did not answer"


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
