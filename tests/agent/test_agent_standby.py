"""A standby node (an agent beyond ``--nnodes`` max, waiting for a place) of a job that succeeds
without needing it: it exits 0 and says so, as the participants do, so that a scheduler counts
the job a success (under Slurm, one task that exits non-zero marks the step and the job FAILED).
A node that starts after the run finished is still refused (exit 1: the run id is closed;
``test_agent_finish``)."""

from __future__ import annotations

import os
import time

import pytest
from agent_nodes import agents, free_port, until
from step_log import STEPS_TRAIN, trained_since

pytestmark = pytest.mark.slow

ADDRS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def test_a_standby_of_a_job_that_succeeds_exits_0(tmp_path: object) -> None:
    """3 agents, ``--nnodes 2:2``: two train, one stands by; the job finishes: all three exit
    0, the standby saying it stood by (~20-40 s)."""
    workdir, port = str(tmp_path), free_port()

    def start(i: int, name: str) -> object:
        flags = ["--nnodes", "2:2", "--nproc-per-node", "1", "--rdzv-endpoint",
                 f"{ADDRS[0]}:{port}", "--local-addr", ADDRS[i], "--rdzv-id", "job",
                 "--rdzv-conf", "last_call_timeout=1,join_timeout=60"]
        return a.start(flags, ["--dir", workdir], name=name, script=STEPS_TRAIN,
                       env={"ELASTICSTORE_TEST_NODE": ADDRS[i], "STEPS_TERM_DELAY": ""})

    with agents(workdir) as a:
        nodes = [start(i, f"n{i + 1}") for i in range(3)]
        until(lambda: trained_since(workdir, 0, 2), 120, "two nodes training")
        time.sleep(2.0)  # the third has joined by now: a standby of the round
        open(os.path.join(workdir, "release"), "w").close()
        codes = {n.name: a.wait(n, 90) for n in nodes}  # type: ignore[attr-defined]
        outputs = {n.name: a.output(n) for n in nodes}  # type: ignore[attr-defined]
        assert set(codes.values()) == {0}, (codes, outputs)
        stood = [name for name, out in outputs.items() if "stood by" in out]
        assert len(stood) == 1, outputs
