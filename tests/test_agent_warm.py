"""Warm-started workers (forked from the fork server) against a fresh interpreter, side by side,
and the failure report."""

from __future__ import annotations

import pytest
from agent_procs import TRAIN, agents

pytestmark = pytest.mark.slow


def test_failure_report_lists_the_ranks_it_stopped(tmp_path: object) -> None:
    workdir = str(tmp_path)
    with agents(workdir) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "2", "--max-restarts", "0"],
                        ["--dir", workdir, "--fail-rank", "1"], name="n1", script=TRAIN)
        assert a.wait(agent, 240) == 1
        out = a.output(agent)
    root, others = out.split("Root Cause (first observed failure):", 1)[1].split("Other Failures:", 1)
    assert "rank      : 1 (local_rank: 1)" in root and "rank 1 fails on purpose" in root
    assert "<NO_OTHER_FAILURES>" not in others, out
    assert "rank      : 0 (local_rank: 0)" in others and "signal SIGTERM" in others, out
