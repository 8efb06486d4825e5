"""``elasticstore status`` for a job: one read of its rendezvous keys and its agents' status
records, rendered as one JSON object or a plain table. Reads only.

The object (``--json``)::

    {"run_id", "endpoint", "backend", "closed": reason | null,
     "round": {"number", "world_size", "formed_at", "rendezvous_seconds"} | null,
     "members": [{"node", "addr", "group_rank", "local_workers", "state", "round", ...}],
     "standby": [node], "waiting": [node],
     "unhealthy": [{"node", "addr", "host", "state", "updated"}],
     "restarts": int, "failure_restarts": int,
     "last_failure": {"rank", "host", "exit_code", "signal", "message", ...} | null,
     "ranks": [{"rank", "node", "step", "step_seconds", "work_seconds", "silent_seconds",
                "measure", "ratio", "straggler"}]  (beating ranks: ``stragglers.py``),
     "store": {counter: value} | {"error": ...},
     "host": {"endpoint", "epoch", "node", "previous", "since"} | null  (native, agent-hosted:
             who hosts the store; ``previous``/``since``: the switch that made it host)}
"""

from __future__ import annotations

import time
from typing import Any

from ..rendezvous.failover import HostRecord
from ..rendezvous.records import int_field, number_field, parse_json, str_field
from ..rendezvous.state import Keys
from .control import JobAddress, JobNotFound, connect, exists, read_round
from .stragglers import rank_rows, straggler_lines
from .terminal import printable

__all__ = ["MEMBER_COLUMNS", "footer_lines", "header_lines", "job_status", "member_rows", "render"]


def _last(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def job_status(addr: JobAddress) -> dict[str, Any]:
    """The job's state as one JSON-ready dict; raises ``JobNotFound`` or the store's errors."""
    keys = Keys(addr.run_id)
    store = connect(addr)
    try:
        if not exists(store, keys):
            raise JobNotFound(f"no job {addr.run_id!r} at {addr.endpoint}")
        rnd = read_round(store, keys)
        closed = store.try_get(keys.closed)
        closed_obj = parse_json(closed)
        alive = sorted(_last(k) for k in store.list_keys(keys.alive_prefix))
        status_keys = sorted(store.list_keys(keys.status_nodes))
        records = {}
        if status_keys:
            for key, value in zip(status_keys, store.multi_get(status_keys)):
                obj = parse_json(value)
                if isinstance(obj, dict):
                    records[_last(key)] = obj
        failure = parse_json(store.try_get(keys.failure))
        host = HostRecord.from_json(store.try_get(keys.host))
        try:
            health: dict[str, Any] = dict(store.stats())
        except Exception as exc:  # EtcdStore has no server counters
            health = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        store.close()
    participants = list(rnd.participants) if rnd else []
    standby = list(rnd.standby) if rnd else []
    members = []
    for rank, node in enumerate(participants):
        rec = records.get(node, {})
        members.append({
            "node": node, "addr": str_field(rec, "addr", node.rsplit("-", 2)[0]),
            "group_rank": rank, "local_workers": int_field(rec, "local_workers"),
            "state": str_field(rec, "state", "unknown"), "round": int_field(rec, "round"),
            "alive": node in alive, "host": str_field(rec, "host"),
        })
    formed = [records[n] for n in participants if n in records and rnd
              and int_field(records[n], "round") == rnd.round]
    round_obj = None
    if rnd is not None:
        round_obj = {
            "number": rnd.round, "world_size": rnd.world_size,
            "formed_at": min((number_field(r, "formed_at") or 0.0 for r in formed),
                             default=None) or None,
            "rendezvous_seconds": max((number_field(r, "rendezvous_seconds") or 0.0
                                       for r in formed), default=None),
            "workers": sum(int_field(r, "local_workers", 0) or 0 for r in formed) or None,
        }
    waiting = [n for n in alive if n not in participants and n not in standby]
    # Nodes whose health check failed (agent/health.py): out of the rendezvous, retrying.
    unhealthy = [{"node": n, "addr": str_field(r, "addr", n.rsplit("-", 2)[0]),
                  "host": str_field(r, "host"), "state": str_field(r, "state"),
                  "updated": number_field(r, "updated")}
                 for n, r in sorted(records.items())
                 if (str_field(r, "state") or "").startswith("unhealthy")]
    closed_reason = closed_obj.get("reason", "closed") if isinstance(closed_obj, dict) else None
    return {
        "run_id": addr.run_id, "endpoint": addr.endpoint, "backend": addr.backend,
        "closed": (str(closed_reason) if closed_reason is not None
                   else ("closed" if closed is not None else None)),
        "round": round_obj, "members": members, "standby": standby, "waiting": waiting,
        "unhealthy": unhealthy,
        "restarts": rnd.round - 1 if rnd else 0,
        "failure_restarts": max((int_field(r, "failure_restarts", 0) or 0
                                 for r in records.values()), default=0),
        "last_failure": failure if isinstance(failure, dict) else None,
        "ranks": rank_rows(records, participants),
        "store": health,
        "host": None if host is None else {
            "endpoint": host.endpoint, "epoch": host.epoch, "node": host.node,
            "previous": host.previous, "since": host.since},
    }


def _when(stamp: Any) -> str:
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        return "?"
    try:
        return (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
                + f" ({time.time() - stamp:.0f}s ago)")
    except (OverflowError, ValueError, OSError):  # beyond the platform's time range
        return "?"


MEMBER_COLUMNS = ("RANK", "NODE", "ADDR", "WORKERS", "STATE")


def header_lines(st: dict[str, Any]) -> list[str]:
    """The job, whether it is closed, and its round."""
    lines = [f"job {printable(st['run_id'])} at {st['endpoint']} ({st['backend']})"
             + (f": CLOSED ({printable(st['closed'])})" if st["closed"] else "")]
    rnd = st["round"]
    if rnd is None:
        lines.append("round: none formed yet")
    else:
        took = rnd["rendezvous_seconds"]
        lines.append(f"round {rnd['number']}: {rnd['world_size']} node(s), "
                     f"{rnd['workers'] or '?'} worker(s); formed {_when(rnd['formed_at'])}"
                     + (f", rendezvous took {took:.3f}s" if isinstance(took, (int, float)) else ""))
    host = st.get("host")
    if host:  # an agent hosts the store (native): where it is now, and whether it moved
        moved = (f"; took over from {host['previous']} {_when(host['since'])}"
                 if host.get("previous") else "")
        lines.append(printable(f"store host: {host['endpoint']} (node {host['node']}, epoch "
                               f"{host['epoch']}{moved})"))
    return lines


def member_rows(st: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per member, in MEMBER_COLUMNS order."""
    return [(str(m["group_rank"]), printable(m["node"]), printable(m["addr"]),
             str(m["local_workers"] or "?"),
             printable(m["state"]) + ("" if m["alive"] else " (lost)")) for m in st["members"]]


def footer_lines(st: dict[str, Any]) -> list[str]:
    """Waiting, standby and unhealthy nodes, restarts, the last failure, the store's health."""
    lines = [f"waiting: {printable(', '.join(st['waiting'])) or 'none'}; "
             f"standby: {printable(', '.join(st['standby'])) or 'none'}",
             f"restarts: {st['restarts']} (after failures: {st['failure_restarts']})"]
    for u in st.get("unhealthy", []):
        lines.append(printable(f"{u['node']} ({u['addr']}): {u['state']}, updated "
                               f"{_when(u['updated'])}"))
    f = st["last_failure"]
    if f:
        lines.append(printable(
            f"last failure: rank {f.get('rank')} on {f.get('host')}: {f.get('how')} "
            f"(exit code {f.get('exit_code')}) at {_when(f.get('when'))}: {f.get('message')}"))
    lines += straggler_lines(st.get("ranks") or [])
    health = st["store"]
    lines.append("store: " + (printable(health["error"]) if "error" in health else
                              ", ".join(f"{k} {v}" for k, v in sorted(health.items()))))
    return lines


def render(st: dict[str, Any]) -> str:
    """Plain text: the round, a member table, waiting/standby, restarts, failure, store."""
    rows = [MEMBER_COLUMNS, *member_rows(st)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(MEMBER_COLUMNS))]
    table = ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([*header_lines(st), *table, *footer_lines(st)])
