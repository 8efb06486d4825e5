"""A node lost under a sharded (FSDP2) job: the survivor resumes from memory, its own snapshots and
the replica of the lost node's that its agent received (``elasticstore.replicas``), not from disk
(there is no checkpoint directory), at the smaller world size, bit-identical.

2 simulated nodes x 2 workers under elasticstore-run (``--nnodes 1:2``), a snapshot every step;
after step 5 the node on 127.0.0.3 is SIGKILLed whole (its agent and every worker; its area's
reaper is left to remove the area, as the node's memory would be gone); the node on 127.0.0.2
resumes at world size 2 from step >= the last step every rank completed - 1, and the full state
it restores (every DTensor's ``full_tensor()``) equals the one recorded at that step.
"""

from __future__ import annotations

import glob
import os
import re
import time
from pathlib import Path

import pytest
from agent_nodes import agents, free_port, until
from sharded_nodes import full_steps, kill_node, restored_at_world_2, start_two_nodes


def replica_steps(root: str) -> list[int]:
    """Per area under ``root`` (one per node), the newest step of its ``replicas/``."""
    found = []
    for area in glob.glob(os.path.join(root, "elasticstore-snapshots.*")):
        steps = [int(m.group(1)) for n in glob.glob(os.path.join(area, "replicas", "step-*"))
                 if (m := re.search(r"step-(\d+)\.local", n))]
        found.append(max(steps, default=-1))
    return found


@pytest.mark.slow  # ~30-70 s on 2 shared cores (load average 40+)
@pytest.mark.timeout(240)
def test_node_lost_survivor_resumes_from_memory_with_the_replica(tmp_path: Path,
                                                                 shm_root: str) -> None:
    workdir, port = str(tmp_path), free_port()
    args = ["--dir", workdir, "--steps", "12", "--step-time", "0.2"]
    with agents(workdir) as a:
        n1, n2 = start_two_nodes(a, port, args, shm_root)
        until(lambda: os.path.exists(os.path.join(workdir, "restored-0-4.json")), 150,
              "the workers at world size 4")
        until(lambda: [s for s in full_steps(workdir) if s >= 5], 60, "step 5 at world size 4")
        # a moment where each node's replica is at most a step behind (on a machine this loaded,
        # an agent's thread may wait seconds for a core: what the console's lag line is for)
        until(lambda: (r := replica_steps(shm_root)) and len(r) == 2 and
              min(r) >= max(full_steps(workdir)) - 1, 60, "the replicas one step behind at most")
        kill_node(a, n2)
        time.sleep(0.5)  # a full-<step>.pt being written when the node died
        last = max(full_steps(workdir))
        code = a.wait(n1, 150)
        out = a.output(n1)
        lost = a.output(n2)
    assert code == 0, out[-4000:]
    got = restored_at_world_2(workdir, (last, out[-4000:], lost[-3000:]))
    assert got["step"] >= last - 1, (got, last, out[-4000:], lost[-3000:])
    assert got["sources"] == ["memory", "memory"], got  # the replica is in this node's memory
