"""Hangs and stragglers with real agents and gloo workers (``hang_train.py``): a rank that stops
beating is found, its stacks and its peers' are shown, the group restarts and the job finishes; a
SIGSTOPped worker; a hang on the second of two nodes, named in ``elasticstore status``; a script that never beats is never judged;
a slow rank is marked in ``elasticstore status``. Timings are printed, not asserted beyond a
generous bound (benchmarks/hang.py measures them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from agent_nodes import agents, events, free_port, node_flags, until
from paths import program

pytestmark = pytest.mark.slow

HANG = program("hang_train.py")
ONE_NODE = ["--standalone", "--nproc-per-node", "2", "--heartbeat-timeout", "3"]


def _stamp(path: str) -> float:
    with open(path) as f:
        return float(f.read())


def _inits(d: str, attempt: int) -> list[float]:
    names = [n for n in os.listdir(d) if n.startswith(f"init-{attempt}-")]
    return [_stamp(os.path.join(d, n)) for n in names]


def test_a_hung_rank_is_restarted_with_its_stacks_shown(tmp_path: Any) -> None:
    d, logs = str(tmp_path), str(tmp_path / "logs")
    with agents(d) as a:
        agent = a.start([*ONE_NODE, "--max-restarts", "1", "--log-dir", logs],
                        ["--dir", d, "--hang", "sleep"], script=HANG)
        assert a.wait(agent, 90) == 0, a.output(agent)
        out = a.output(agent)
    hang = _stamp(os.path.join(d, "hang"))
    again = max(_inits(d, 1))
    print(f"hang -> restarted group past init_process_group: {again - hang:.2f}s "
          f"(--heartbeat-timeout 3)")
    assert again - hang < 30
    assert "rank 1 (pid" in out and "hung: no heartbeat for" in out and "restart 1/1" in out
    assert "in stuck_in_user_code" in out  # the hung rank's stack
    assert "waits on a peer" in out and "in all_reduce" in out  # its peer's, blocked in gloo
    hangs = [e for e in events(logs) if e["event"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["rank"] == 1 and hangs[0]["waiting_ranks"] == [0]
    assert hangs[0]["silent_seconds"] >= 3 and hangs[0]["step"] == 10
    stacks = [os.path.join(r, f) for r, _, fs in os.walk(logs) for f in fs if f == "stacks.log"]
    with open(stacks[0]) as f:
        assert len(stacks) == 1 and "stuck_in_user_code" in f.read()
    assert all(os.path.exists(os.path.join(d, f"done-{r}")) for r in (0, 1))


def test_a_stopped_worker_is_a_hang_named_in_the_root_cause(tmp_path: Any) -> None:
    d = str(tmp_path)
    with agents(d) as a:
        agent = a.start([*ONE_NODE, "--max-restarts", "0"], ["--dir", d, "--hang", "stop"],
                        script=HANG)
        assert a.wait(agent, 90) == 1, a.output(agent)
        out = a.output(agent)
    root = out.split("Root Cause (first observed failure):", 1)[1].split("Other Failures:")[0]
    assert "rank      : 1 (local_rank: 1)" in root and "host      : 127.0.0.1" in root
    assert "message   : hung: no heartbeat for" in root
    assert "the process is stopped" in out  # no stacks from a stopped process, and it says so


def test_a_hang_on_the_second_node_is_named_by_its_agent(tmp_path: Any) -> None:
    d, port = str(tmp_path), free_port()
    flags = ["--heartbeat-timeout", "3", "--max-restarts", "1"]
    with agents(d) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "2", 2, *flags), ["--dir", d, "--hang", "sleep",
                     "--hang-rank", "3", "--steps", "200"], script=HANG, name="n1")
        n2 = a.start(node_flags("127.0.0.3", port, "2", 2, *flags), ["--dir", d, "--hang", "sleep",
                     "--hang-rank", "3", "--steps", "200"], script=HANG, name="n2")
        until(lambda: len(_inits(d, 1)) == 4, 90, "the restarted group")
        st = subprocess.run([sys.executable, "-m", "elasticstore.cli", "status", "--rdzv-endpoint",
                             f"127.0.0.2:{port}", "--rdzv-id", "job", "--json"],
                            capture_output=True, text=True, timeout=30)
        assert st.returncode == 0, st.stderr
        failure = json.loads(st.stdout)["last_failure"]
        assert failure["rank"] == 3 and failure["host"] == "127.0.0.3", failure
        assert failure["message"].startswith("hung: no heartbeat for"), failure
        assert a.wait(n2, 120) == 0, a.output(n2)
        assert a.wait(n1, 120) == 0, a.output(n1)
        out1, out2 = a.output(n1), a.output(n2)
    hang = _stamp(os.path.join(d, "hang"))
    print(f"hang on node 2 -> 4 workers past init_process_group again: "
          f"{max(_inits(d, 1)) - hang:.2f}s")
    assert len(_inits(d, 1)) == 4
    assert "rank 3 (pid" in out2 and "hung: no heartbeat" in out2 and "stuck_in_user_code" in out2
    assert "hung" not in out1.replace("rank 3", "")  # node 1's ranks only waited on rank 3
    assert "no restart spent" in out1


def test_a_script_that_never_beats_is_never_judged(tmp_path: Any) -> None:
    d = str(tmp_path)
    with agents(d) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "2", "--heartbeat-timeout", "0.5",
                         "--first-heartbeat-timeout", "0.5"])  # agent_train.py never beats
        until(lambda: len(a.inits(0)) == 2, 60, "both workers past init")
        time.sleep(2.5)
        a.release()
        assert a.wait(agent, 60) == 0, a.output(agent)
        assert "hung" not in a.output(agent)


def test_a_slow_rank_is_marked_in_status_and_metrics(tmp_path: Any) -> None:
    d, port = str(tmp_path), free_port("127.0.0.1")
    metrics = free_port("127.0.0.1")
    with agents(d) as a:
        agent = a.start(["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "elasticstore",
                         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "slow",
                         "--local-addr", "127.0.0.1", "--metrics-port", str(metrics)],
                        ["--dir", d, "--hang", "slow", "--slow", "0.2", "--steps", "200"], script=HANG)

        def ranks() -> list[dict[str, Any]] | None:
            out = subprocess.run([sys.executable, "-m", "elasticstore.cli", "status",
                                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "slow", "--json"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                return None
            rows = json.loads(out.stdout)["ranks"]
            return rows if len(rows) == 2 and all(r["step"] >= 8 for r in rows) else None

        rows = until(ranks, 60, "both ranks' step times in the status")
        by_rank = {r["rank"]: r for r in rows}
        assert by_rank[1]["straggler"] and not by_rank[0]["straggler"], rows
        assert by_rank[1]["measure"] == "work" and by_rank[1]["ratio"] > 2
        text = subprocess.run([sys.executable, "-m", "elasticstore.cli", "status", "--rdzv-endpoint",
                               f"127.0.0.1:{port}", "--rdzv-id", "slow"], capture_output=True,
                              text=True, timeout=30).stdout
        assert "SLOW (straggler)" in text and "rank 1 on" in text
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert 'elasticstore_worker_work_seconds{rank="1"}' in body
        agent.kill()


PATTERNS = program("beat_patterns.py")


def test_ranks_waiting_on_an_untimed_evaluation_are_not_judged(tmp_path: Any) -> None:
    """Rank 0 evaluates 6 s in ``section("eval", timeout=None)``, rank 1 waits in
    ``dist.barrier()``; with ``--heartbeat-timeout 2`` the job runs on and finishes."""
    d = str(tmp_path)
    with agents(d) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "2", "--heartbeat-timeout", "2",
                         "--max-restarts", "0"],
                        ["--dir", d, "--mode", "eval", "--eval", "6"], script=PATTERNS)
        assert a.wait(agent, 90) == 0, a.output(agent)
        out = a.output(agent)
    assert "hung:" not in out and "succeeded: 1 round(s), 0/0 restart(s)" in out, out
    assert "no verdict while rank 0 is in section 'eval' (no timeout)" in out, out
    assert all(os.path.exists(os.path.join(d, f"done-{r}")) for r in (0, 1))


def test_a_rank_that_never_beats_is_not_killed_while_the_others_beat(tmp_path: Any) -> None:
    """Only rank 0 calls ``heartbeat()``; both ranks all_reduce every step for ~4 s, twice
    ``--first-heartbeat-timeout``: nobody is judged, the job finishes."""
    d = str(tmp_path)
    with agents(d) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "2", "--heartbeat-timeout", "2",
                         "--first-heartbeat-timeout", "2", "--max-restarts", "0"],
                        ["--dir", d, "--mode", "rank0", "--steps", "40", "--step-time", "0.1"],
                        script=PATTERNS)
        assert a.wait(agent, 90) == 0, a.output(agent)
        out = a.output(agent)
    assert "hung:" not in out and "succeeded: 1 round(s), 0/0 restart(s)" in out, out
    assert all(os.path.exists(os.path.join(d, f"done-{r}")) for r in (0, 1))


def test_a_deadlock_in_collectives_is_caught_and_reported_with_the_real_signal(tmp_path: Any) -> None:
    """Every rank waits in ``dist.recv`` for another: no rank is hung in its own code and no
    section is open, so the waiting rank is the verdict; it was stopped with SIGTERM (not
    SIGKILLed: its stacks show it waits), and the report says so."""
    d = str(tmp_path)
    with agents(d) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "2", "--heartbeat-timeout", "2",
                         "--max-restarts", "0"], ["--dir", d, "--mode", "deadlock"],
                        script=PATTERNS)
        assert a.wait(agent, 90) == 1, a.output(agent)
        out = a.output(agent)
    root = out.split("Root Cause (first observed failure):", 1)[1].split("Other Failures:")[0]
    assert "message   : hung: no heartbeat for" in root and "waits in a collective" in root, root
    assert "exitcode  : -15 (signal SIGTERM" in root, root


def test_an_untimed_section_on_another_node_holds_the_verdict(tmp_path: Any) -> None:
    """Two nodes, one rank each: rank 0 (node 1) evaluates 6 s in an untimed section, rank 1
    (node 2) waits in ``dist.barrier()``. Node 2 sees only a rank that waits in a collective;
    node 1's progress entry in the store (the open section) holds its verdict: both finish."""
    d, port = str(tmp_path), free_port()
    flags = ["--heartbeat-timeout", "2", "--max-restarts", "0"]
    train = ["--dir", d, "--mode", "eval", "--eval", "6"]
    with agents(d) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "2", 1, *flags), train, script=PATTERNS, name="n1")
        n2 = a.start(node_flags("127.0.0.3", port, "2", 1, *flags), train, script=PATTERNS, name="n2")
        assert a.wait(n2, 120) == 0, a.output(n2)
        assert a.wait(n1, 120) == 0, a.output(n1)
        out2 = a.output(n2)
    assert "hung:" not in out2 and "1 round(s)" in out2, out2
    assert "no verdict while rank 0 on 127.0.0.2 is in section 'eval' (no timeout)" in out2, out2
