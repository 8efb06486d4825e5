"""Containment, failures and start methods: SIGTERM to an agent, a worker's own children, a
failing @record script, --start-method spawn and the legacy launcher."""

from __future__ import annotations

import os
import signal
import time

import pytest
from agent_nodes import agents, assert_gone, free_port, node_flags, until

pytestmark = pytest.mark.slow


def test_sigterm_to_agent_stops_workers_and_their_children(tmp_path: object) -> None:
    with agents(str(tmp_path)) as a:
        agent = a.start(["--nproc-per-node", "2", "--shutdown-timeout", "5"],
                        ["--dir", a.dir, "--child"], name="n1")
        until(lambda: len(a.inits(0)) == 2, 120, "2 workers past init_process_group")
        pids = a.all_pids()
        assert len(pids) == 4  # two workers, each with a child of its own
        os.kill(agent.pid, signal.SIGTERM)
        took = assert_gone(pids, 5.0)
        print(f"SIGTERM -> workers and their children gone in {took:.3f}s")
        assert a.wait(agent, 30) == 128 + signal.SIGTERM
        assert "got SIGTERM" in a.output(agent)


def test_failing_script_reports_root_cause(tmp_path: object) -> None:
    port = free_port()
    logs = os.path.join(str(tmp_path), "logs")
    with agents(str(tmp_path)) as a:
        flags = node_flags("127.0.0.2", port, "1", 2, "--max-restarts", "1", "--log-dir", logs)
        agent = a.start(flags, ["--dir", a.dir, "--fail-rank", "1"], name="n1")
        assert a.wait(agent, 120) == 1
        out = a.output(agent)
        assert "restart 1/1" in out and "FAILED" in out
        root = out.split("Root Cause (first observed failure):", 1)[1]
        assert "rank      : 1 (local_rank: 1)" in root.split("Other Failures", 1)[0]
        assert "host      : 127.0.0.2" in root and "exitcode  : 1 (exit code 1" in root
        assert "RuntimeError: rank 1 fails on purpose" in root
        assert "agent_train.py" in root  # the traceback from the @record error file
        for attempt in (0, 1):
            err = os.path.join(logs, "job", f"attempt_{attempt}", "1", "stderr.log")
            with open(err) as f:
                assert "rank 1 fails on purpose" in f.read()
            assert os.path.exists(os.path.join(logs, "job", f"attempt_{attempt}", "0", "stdout.log"))
        assert "[127.0.0.2:1] " in out  # console lines carry [host:rank]


def test_spawn_start_method_and_legacy_launch(tmp_path: object) -> None:
    with agents(str(tmp_path)) as a:
        a.release()  # one step, then done
        agent = a.start(["--start-method", "spawn", "--nproc-per-node", "1"], name="n1",
                        module="elasticstore.launch")
        assert a.wait(agent, 120) == 0, a.output(agent)
        (s,) = a.starts()
        assert not s["preloaded"] and s["fork_to_main"] is None  # a fresh interpreter
        assert s["name"] == "__main__" and s["local_rank_arg"] == 0
        assert s["argv"][1] == "--local-rank=0"
        for f in os.listdir(a.dir):
            if f.startswith(("start-", "init-")):
                os.unlink(os.path.join(a.dir, f))
        agent = a.start(["--use-env", "--nproc-per-node", "1"], name="n2", module="elasticstore.launch")
        assert a.wait(agent, 120) == 0, a.output(agent)
        (s,) = a.starts()
        assert s["preloaded"] and s["local_rank_arg"] is None and s["env"]["LOCAL_RANK"] == "0"


def test_agent_sigkill_with_busy_tree(tmp_path: object) -> None:
    with agents(str(tmp_path)) as a:
        agent = a.start(["--nproc-per-node", "2"], ["--dir", a.dir, "--child"], name="n1")
        until(lambda: len(a.inits(0)) == 2, 120, "2 workers past init_process_group")
        pids = a.all_pids()
        t0 = time.monotonic()
        os.kill(agent.pid, signal.SIGKILL)
        took = assert_gone(pids, 1.0)
        print(f"agent SIGKILL -> workers and their children gone in {took:.3f}s ({time.monotonic() - t0:.3f}s)")


def test_console_prefix_redirects_tee_filter_and_log_files(tmp_path: object) -> None:
    logs = os.path.join(str(tmp_path), "logs")
    script = "i=0; while [ $i -lt 200 ]; do echo \"line $i of rank $RANK xxxxxxxxxxxxxxxxxxxxxxxx\"; i=$((i+1)); done; echo oops >&2"
    with agents(str(tmp_path)) as a:
        flags = ["--no-python", "--nproc-per-node", "3", "--rdzv-id", "logs", "--log-dir", logs,
                 "-r", "0:3,1:3", "-t", "1:1", "--local-ranks-filter", "0,1", "--local-addr", "127.0.0.2"]
        agent = a.start(flags, ["-c", script], name="n1", script="/bin/sh")
        assert a.wait(agent, 120) == 0, a.output(agent)
        out = a.output(agent)
        lines = [ln for ln in out.splitlines() if ln.startswith("[127.0.0.2:")]
        # rank 0: redirected, no tee -> nothing on the console; rank 1: stdout teed, stderr
        # redirected; rank 2: filtered out of the console.
        assert not [ln for ln in lines if ln.startswith("[127.0.0.2:0]")]
        assert not [ln for ln in lines if ln.startswith("[127.0.0.2:2]")]
        # A teed stream carries torchrun's tee prefix, [<role><local rank>]:
        ones = [ln for ln in out.splitlines() if ln.startswith("[default1]:")]
        assert len(ones) == 200 and all(ln.endswith("of rank 1 xxxxxxxxxxxxxxxxxxxxxxxx") for ln in ones)
        for rank in (0, 1, 2):
            d = os.path.join(logs, "logs", "attempt_0", str(rank))
            with open(os.path.join(d, "stdout.log")) as f:
                assert len(f.read().splitlines()) == 200
            with open(os.path.join(d, "stderr.log")) as f:
                assert f.read() == "oops\n"
