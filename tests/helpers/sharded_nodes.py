"""Two simulated nodes of a sharded (FSDP2) job under elasticstore-run, for the node-loss tests:
``programs/fsdp_snapshots.py`` on 127.0.0.2 and 127.0.0.3 (2 workers each, ``--nnodes 1:2``),
the whole second node SIGKILLed (its area's reaper left to remove the area, as the node's memory
would be gone), and the survivor's restore at world size 2 checked against the full state
recorded at the step it resumed from."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
from typing import Any

import torch
from agent_nodes import Agents, node_flags, tree
from elasticstore.agent.snapshots import ROOT_ENV
from paths import program

TRAIN = program("fsdp_snapshots.py")
CONF = ["--rdzv-conf", "last_call_timeout=1", "--max-restarts", "1"]

__all__ = ["CONF", "TRAIN", "full_steps", "kill_node", "restored_at_world_2", "start_two_nodes"]


def full_steps(workdir: str) -> list[int]:
    """The steps whose full state the workers recorded (``full-<step>.pt``)."""
    return sorted(int(m.group(1)) for p in glob.glob(os.path.join(workdir, "full-*.pt"))
                  if (m := re.search(r"full-(\d+)\.pt$", p)))


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def start_two_nodes(a: Agents, port: int, args: list[str], shm_root: str) -> tuple[Any, Any]:
    env = {ROOT_ENV: shm_root}
    return tuple(a.start(node_flags(addr, port, "1:2", 2, *CONF), args, name=name, env=env,
                         script=TRAIN)
                 for name, addr in (("n1", "127.0.0.2"), ("n2", "127.0.0.3")))  # type: ignore[return-value]


def kill_node(a: Agents, node: Any) -> None:
    """SIGKILLs the node's agent and workers at once (not its area's reaper: the node's memory
    is gone with it), and waits for its agent."""
    for pid in [p for p in tree(node.pid) if "agent/snapshots.py" not in _cmdline(p)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert a.wait(node, 10) == -signal.SIGKILL


def restored_at_world_2(workdir: str, why: Any) -> dict[str, Any]:
    """What the survivor's ranks restored at world size 2 (``restored-*-2.json``), its full
    state checked equal to the one recorded at that step; ``why`` goes into failure messages."""
    found = glob.glob(os.path.join(workdir, "restored-*-2.json"))
    assert len(found) == 1, (found, why)
    with open(found[0]) as f:
        got: dict[str, Any] | None = json.load(f)
    assert got is not None, ("nothing restored", why)
    state = torch.load(found[0].replace(".json", ".pt"), weights_only=False)
    want = torch.load(os.path.join(workdir, f"full-{got['step']}.pt"), weights_only=False)
    assert sorted(state) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state[key], value), key
        else:
            assert state[key] == value, key
    return got
