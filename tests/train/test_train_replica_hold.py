"""A node lost at any moment of a sharded (FSDP2) job whose replica transfers span several steps:
the survivor resumes from memory at the committed step or later (``elasticstore.replicas``: the
agents agree on one step, the workers hold its memory until the replicas of it are placed), not
from disk, not from step 0.

2 simulated nodes x 2 workers under elasticstore-run (``--nnodes 1:2``, no checkpoint directory),
a snapshot every step of a state with 128 MB of ballast: 64 MB per node to send, a copy that spans
several steps here (each step sleeps 20 ms; the agents' console says by how many the committed
step trails). Once a step is committed (the agents' ``.replica-hold`` files say which; without
them, at step 40) and at least 5 steps later (step 30 at the earliest), the node on 127.0.0.3 is
SIGKILLed whole, without waiting for any replica to catch up. The survivor resumes at world size
2 from its own snapshots and the lost node's replica, at a step >= the committed one, the state
bit-identical to the one recorded at that step (the ballast equal to what it held then).
"""

from __future__ import annotations

import glob
import json
import os
import time
from pathlib import Path

import pytest
from agent_nodes import agents, free_port, until
from sharded_nodes import full_steps, kill_node, restored_at_world_2, start_two_nodes

HOLD = ".replica-hold"


def committed(root: str) -> int | None:
    """The newest committed step any node's hold file names (None: no commit, or no file)."""
    found = []
    for path in glob.glob(os.path.join(root, "elasticstore-snapshots.*", HOLD)):
        try:
            with open(path) as f:
                step = json.load(f).get("committed")
        except (OSError, ValueError):
            continue
        if isinstance(step, int):
            found.append(step)
    return max(found, default=None)


def newest(workdir: str) -> int:
    return max(full_steps(workdir), default=0)


@pytest.mark.slow  # ~40-60 s on 2 shared cores
@pytest.mark.timeout(240)
def test_node_lost_at_any_moment_resumes_from_the_committed_step(tmp_path: Path,
                                                                 shm_root: str) -> None:
    workdir, port = str(tmp_path), free_port()
    args = ["--dir", workdir, "--steps", "100", "--step-time", "0.02", "--ballast-mb", "128",
            "--steps-after-restore", "2"]
    with agents(workdir) as a:
        n1, n2 = start_two_nodes(a, port, args, shm_root)
        until(lambda: os.path.exists(os.path.join(workdir, "restored-0-4.json")), 150,
              "the workers at world size 4")
        until(lambda: committed(shm_root) is not None or newest(workdir) >= 40, 120,
              "a committed step (or step 40)")
        at = max(newest(workdir) + 5, 30)  # a few commits later, at no particular moment
        until(lambda: newest(workdir) >= at, 60, f"step {at}")
        held = committed(shm_root)
        kill_node(a, n2)  # without waiting for any replica to catch up
        time.sleep(0.5)  # a full-<step>.pt being written when the node died
        last = newest(workdir)
        code = a.wait(n1, 150)
        out = a.output(n1)
        lost = a.output(n2)
    assert code == 0, out[-4000:]
    got = restored_at_world_2(workdir, (held, last, out[-4000:], lost[-3000:]))
    assert got["sources"] == ["memory", "memory"], (got, held, last)  # not disk, not step 0
    assert held is not None, (got, last)
    assert held <= got["step"] <= last, (got, held, last)
    assert got["ballast_ok"] == [True, True], got
