"""The rendezvous state: node ids, the round record (versioned JSON, never pickle), key layout.

Keys of run ``R`` (relative to the backend's store)::

    rdzv/R/alive/{node}       session-bound (native) or leased (etcd): the node lives
    rdzv/R/join/{T}/{node}    session-bound: the node wants to be in round T
    rdzv/R/ctl/round          the round record (JSON; compressed when large: ``records.py``),
                              written once per round by compare-and-set
    rdzv/R/ctl/decider/{T}    session-bound: the node deciding round T (created, never rewritten;
                              kept once T is written, deleted by the decider of T + 1)
    rdzv/R/ctl/restart/{T}    round T must be replaced (a participant was lost, a node waits)
    rdzv/R/ctl/boot/{T}       "addr:port" of round T's worker store (hosted by its rank 0)
    rdzv/R/ctl/check/{T}      session-bound: the waiting node that checks T's decider (native)
    rdzv/R/ctl/closed         the job is closed (JSON ``{"reason": ...}``, or ``1``)
    rdzv/R/ctl/host           native, agent-hosted: who hosts the store, its epoch (``failover``)
    rdzv/R/ctl/failover       native: the first round after a switch of host (``failover``)
    rdzv/R/ctl/follower       native: a follower's copy of the host record (``follower``), only
                              at a node's own endpoint, never in the served store
    status/R/node/{node}      an agent's status (JSON), for ``elasticstore status``
    status/R/failure          the last failure's root cause (JSON)
    status/R/imports          the modules the job's workers import (JSON list of names), written
                              by a round's rank-0 node for nodes that join later to preload
    beat/R/{node}             native: the node's heartbeat count, on its liveness key's session

Status and heartbeat keys live outside ``rdzv/R/``: the decider watches that prefix, and status
writes and beats must not cost it events.

Waiting nodes watch ``ctl/`` only: O(1) events per node per round.

In a round's worker store, the agents of attempt ``A`` (the round number - 1) keep
(:class:`AgentKeys`)::

    elasticstore/agent/A/node/{rank}   the node's worker count (JSON ``{"nproc": N}``)
    elasticstore/agent/A/done/{rank}   the node's workers succeeded ("host" or "node")
    elasticstore/agent/A/left/{rank}   the node read what it waited for and left the store
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousStateError

from .records import RecordError, pack_record, parse_record

__all__ = ["SCHEMA", "AgentKeys", "Keys", "NodeId", "RoundState", "node_sort_key"]

SCHEMA = 1


@dataclass(frozen=True, order=False)
class NodeId:
    """A node: its address, its process id and a local id (several handlers in one process are
    distinct nodes). Rendered as ``addr-pid-local``; the address may hold ``:`` (IPv6)."""

    addr: str
    pid: int
    local_id: int

    def __str__(self) -> str:
        return f"{self.addr}-{self.pid}-{self.local_id}"

    @classmethod
    def parse(cls, text: str) -> NodeId:
        addr, pid, local_id = text.rsplit("-", 2)
        return cls(addr, int(pid), int(local_id))


def node_sort_key(node: str) -> tuple[int, int, str, int, int]:
    """Deterministic order of new nodes: by numeric address, then pid and local id."""
    try:
        parsed = NodeId.parse(node)
    except ValueError:
        return (2, 0, node, 0, 0)
    try:
        ip = ipaddress.ip_address(parsed.addr)
        return (0, ip.version, f"{int(ip):040d}", parsed.pid, parsed.local_id)
    except ValueError:
        return (1, 0, parsed.addr, parsed.pid, parsed.local_id)


@dataclass(frozen=True)
class RoundState:
    """Round ``round``: ``participants`` in rank order, ``standby`` beyond ``max_nodes``."""

    round: int
    participants: tuple[str, ...]
    standby: tuple[str, ...] = field(default=())

    def rank_of(self, node: str) -> int | None:
        try:
            return self.participants.index(node)
        except ValueError:
            return None

    @property
    def world_size(self) -> int:
        return len(self.participants)

    def to_json(self) -> bytes:
        """The record as stored: JSON, compressed past ``records.PACK_ABOVE`` bytes (about
        1,000 nodes: each node receives it once per round, O(N^2) bytes from one server)."""
        return pack_record(json.dumps(
            {
                "schema": SCHEMA,
                "round": self.round,
                "participants": list(self.participants),
                "standby": list(self.standby),
            },
            separators=(",", ":"),
        ).encode())

    @classmethod
    def from_json(cls, data: bytes) -> RoundState:
        try:
            obj: Any = parse_record(data, "the round record")
            if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
                raise ValueError(f"schema {obj.get('schema') if isinstance(obj, dict) else obj!r}")
            rnd, parts, standby = obj["round"], obj["participants"], obj["standby"]
            if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 1:
                raise ValueError(f"round {rnd!r}")
            if not isinstance(parts, list) or not isinstance(standby, list):
                raise ValueError("participants and standby must be lists")
            # C-speed check: every node of a 4,096-node record parsed by each of its nodes
            if not {*map(type, parts), *map(type, standby)} <= {str}:
                raise ValueError("node ids must be strings")
            return cls(rnd, tuple(parts), tuple(standby))
        except RecordError as exc:
            raise RendezvousStateError(f"the rendezvous round record is not valid: {exc}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise RendezvousStateError(
                f"the rendezvous round record is not valid (expected schema {SCHEMA} JSON): "
                f"{exc}: {data[:200]!r}"
            ) from None


class Keys:
    """The key names of one run (see the module doc)."""

    def __init__(self, run_id: str) -> None:
        self.base = f"rdzv/{run_id}/"
        self.alive_prefix = self.base + "alive/"
        self.ctl = self.base + "ctl/"
        self.round = self.ctl + "round"
        self.closed = self.ctl + "closed"
        self.host = self.ctl + "host"
        self.failover = self.ctl + "failover"
        self.follower = self.ctl + "follower"
        self.status_prefix = f"status/{run_id}/"
        self.status_nodes = self.status_prefix + "node/"
        self.failure = self.status_prefix + "failure"
        self.imports = self.status_prefix + "imports"
        self.beat_prefix = f"beat/{run_id}/"

    def alive(self, node: str) -> str:
        return self.alive_prefix + node

    def join_prefix(self, target: int) -> str:
        return f"{self.base}join/{target}/"

    def join(self, target: int, node: str) -> str:
        return self.join_prefix(target) + node

    def decider(self, target: int) -> str:
        return f"{self.ctl}decider/{target}"

    def restart(self, rnd: int) -> str:
        return f"{self.ctl}restart/{rnd}"

    def boot(self, rnd: int) -> str:
        return f"{self.ctl}boot/{rnd}"

    def beat(self, node: str) -> str:
        return self.beat_prefix + node

    def check(self, target: int) -> str:
        return f"{self.ctl}check/{target}"


class AgentKeys:
    """The agents' key names in the worker store of attempt ``attempt`` (see the module doc)."""

    def __init__(self, attempt: int) -> None:
        self.prefix = f"elasticstore/agent/{attempt}/"

    def node(self, rank: int) -> str:
        return f"{self.prefix}node/{rank}"

    def done(self, rank: int) -> str:
        return f"{self.prefix}done/{rank}"

    def left(self, rank: int) -> str:
        return f"{self.prefix}left/{rank}"
