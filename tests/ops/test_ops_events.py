"""``--event-log-handler``: the agent records torch's agent events (as torchrun does) to that
destination (``console`` prints them) and routes them into events.jsonl beside its own."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from agent_nodes import agents, assert_gone

pytestmark = pytest.mark.slow


def test_event_log_handler_records_torch_events(tmp_path: Any) -> None:
    logs = os.path.join(str(tmp_path), "logs")
    with agents(str(tmp_path)) as a:
        a.release()  # the worker stops after its first step
        node = a.start(["--nnodes", "1", "--nproc-per-node", "1", "--local-addr", "127.0.0.2",
                        "--rdzv-id", "evjob", "--log-dir", logs, "--event-log-handler", "console"],
                       name="n1")
        assert a.wait(node, 120) == 0, a.output(node)
        console = a.output(node)
        assert_gone(a.all_pids(), 5)
    with open(os.path.join(logs, "evjob", "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    names = [e["event"] for e in events]
    assert names.index("round_formed") < names.index("worker_started") < names.index("worker_exited")
    torch_events = [e["torch"] for e in events if e["event"] == "torch"]
    assert [(t["name"], t["source"]) for t in torch_events] == [
        ("torchelastic.worker.status.START", "WORKER"),
        ("torchelastic.worker.status.SUCCEEDED", "WORKER"),
        ("torchelastic.worker.status.SUCCEEDED", "AGENT"),
    ]
    start, worker, agent = (t["metadata"] for t in torch_events)
    assert start["run_id"] == "evjob" and start["global_rank"] == 0 and start["group_rank"] == 0
    assert start["hostname"] == "127.0.0.2" and start["rdzv_backend"] == "elasticstore"
    assert json.loads(worker["metadata"])["exit_code"] == 0
    assert agent["global_rank"] is None and agent["duration_ms"] > 0
    # torch's "console" destination prints each event as torchrun does
    assert console.count('"name": "torchelastic.worker.status.SUCCEEDED"') == 2, console


def test_no_torch_events_without_the_flag(tmp_path: Any) -> None:
    logs = os.path.join(str(tmp_path), "logs")
    with agents(str(tmp_path)) as a:
        a.release()
        node = a.start(["--nnodes", "1", "--nproc-per-node", "1", "--local-addr", "127.0.0.2",
                        "--rdzv-id", "evjob", "--log-dir", logs], name="n1")
        assert a.wait(node, 120) == 0, a.output(node)
        assert "torchelastic.worker.status" not in a.output(node)
    with open(os.path.join(logs, "evjob", "events.jsonl")) as f:
        assert not any(json.loads(line)["event"] == "torch" for line in f)
