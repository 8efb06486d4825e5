"""The node health check before a node joins a round (``--health-check``, ``--health-check-cmd``):
its flags, one check run through a real fork server (passing, failing, timed out, interrupted),
and real agents: a sick node stays out and the others run without it, the check runs again only
after this node's own failure, a signal ends a sick agent at once, a sick node whose run closed
goes away. Every process is cleaned up by pid (``agents()`` checks nothing is left)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from agent_nodes import agents, alive, assert_gone, free_port, node_flags, until

from elasticstore.agent.config import HEALTH_CHECK_TIMEOUT, MAX_MATMUL_MS, HealthSettings
from elasticstore.agent.forkclient import ForkServer
from elasticstore.agent.healthrun import CheckResult, run_check
from elasticstore.run import UsageError, parse

# -- flags ------------------------------------------------------------------------------------


def test_flags_defaults_spellings_and_environment() -> None:
    assert parse(["t.py"], {}).agent.health == HealthSettings()
    assert not HealthSettings().enabled
    h = parse(["--health-check", "t.py"], {}).agent.health
    assert (h.enabled, h.command, h.timeout, h.max_matmul_ms) == (
        True, None, HEALTH_CHECK_TIMEOUT, MAX_MATMUL_MS)
    assert parse(["t.py"], {"PET_HEALTH_CHECK": "1"}).agent.health.enabled
    h = parse(["--health_check_cmd", "nvidia-smi -L", "--health-check-timeout", "7.5", "t.py"], {}).agent.health
    assert (h.enabled, h.command, h.timeout) == (True, "nvidia-smi -L", 7.5)  # the command implies it
    h = parse(["t.py"], {"PET_HEALTH_CHECK_CMD": "true", "PET_HEALTH_CHECK_TIMEOUT": "3"}).agent.health
    assert (h.enabled, h.command, h.timeout) == (True, "true", 3.0)
    h = parse(["--health-check", "--health-check-t", "9", "--health-check-max", "0", "t.py"], {}).agent.health
    assert (h.timeout, h.max_matmul_ms) == (9.0, 0.0)  # abbreviated, as every flag; 0: no limit


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--health-check", "--health-check-timeout", "0"], "--health-check-timeout"),
        (["--health-check", "--health-check-timeout", "soon"], "--health-check-timeout"),
        (["--health-check", "--health-check-timeout", "nan"], "--health-check-timeout"),
        (["--health-check-timeout", "5"], "--health-check-timeout"),  # no check to bound
        (["--health-check", "--health-check-max-matmul-ms", "-1"], "--health-check-max-matmul-ms"),
        (["--health-check", "--health-check-max-matmul-ms", "inf"], "--health-check-max-matmul-ms"),
        (["--health-check-cmd", "true", "--health-check-max-matmul-ms", "5"],
         "--health-check-max-matmul-ms"),  # no matmul in a command
        (["--health-check-cmd", "  "], "--health-check-cmd"),
    ],
)
def test_bad_flag_values_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(UsageError, match=f"^{flag}: "):
        parse([*argv, "t.py"], {})


def test_bad_flag_value_exits_2_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "elasticstore.run", "--health-check",
                           "--health-check-timeout", "-3", "t.py"],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--health-check-timeout" in lines[0], proc.stderr


# -- one check through a real fork server -----------------------------------------------------


@pytest.fixture(scope="module")
def warm() -> Iterator[ForkServer]:
    server = ForkServer(True, learn=False)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def sig() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A stand-in for the agent's signal wakeup socket pair (read end, write end)."""
    r, w = socket.socketpair()
    try:
        yield r, w
    finally:
        r.close()
        w.close()


ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _check(server: ForkServer, s: HealthSettings, nproc: int, sig_r: socket.socket) -> CheckResult:
    result = run_check(server, s, nproc, ENV, sig_r)
    assert isinstance(result, CheckResult)
    assert_gone(result.pids, 1.0)
    return result


@pytest.mark.slow
def test_default_check_passes_and_costs_little_when_warm(
        warm: ForkServer, sig: tuple[socket.socket, socket.socket]) -> None:
    on = HealthSettings(enabled=True)
    first = _check(warm, on, 2, sig[0])
    assert first.ok, first.reason
    again = _check(warm, on, 2, sig[0])  # the fork server was warm already
    assert again.ok, again.reason
    assert again.detail["processes"] == 2 and len(again.pids) == 2
    print(f"default check, 2 processes forked warm: {first.seconds:.3f}s (after waiting "
          f"{first.warm_wait:.2f}s for the fork server's import of torch), then "
          f"{again.seconds:.3f}s; matmul 512x512 {again.detail['matmul_ms']} ms, all_reduce "
          f"{again.detail['all_reduce_ms']} ms")
    assert again.seconds < 10.0


@pytest.mark.slow
def test_default_check_as_plain_processes(sig: tuple[socket.socket, socket.socket]) -> None:
    """--start-method spawn: ``python -u healthcheck.py``, each importing torch itself."""
    plain = ForkServer(False)
    try:
        result = _check(plain, HealthSettings(enabled=True), 2, sig[0])
    finally:
        plain.close()
    assert result.ok, result.reason
    print(f"default check, 2 fresh interpreters: {result.seconds:.3f}s")


@pytest.mark.slow
def test_default_check_fails_when_too_slow_or_out_of_time(
        warm: ForkServer, sig: tuple[socket.socket, socket.socket]) -> None:
    slow = _check(warm, HealthSettings(enabled=True, max_matmul_ms=1e-6), 2, sig[0])
    assert not slow.ok and "--health-check-max-matmul-ms" in slow.reason, slow.reason
    late = _check(warm, HealthSettings(enabled=True, timeout=0.001), 3, sig[0])
    assert not late.ok and late.reason.startswith("timed out after 0.001s"), late.reason
    print(f"forced failures: {slow.reason!r}; {late.reason!r}")


@pytest.mark.slow
def test_command_check_exit_code_and_output(
        warm: ForkServer, sig: tuple[socket.socket, socket.socket]) -> None:
    ok = _check(warm, HealthSettings(enabled=True, command="test -d /"), 1, sig[0])
    assert ok.ok and ok.reason == "" and ok.detail == {}
    quick = [_check(warm, HealthSettings(enabled=True, command="true"), 1, sig[0]) for _ in range(20)]
    assert all(r.ok for r in quick) and max(r.seconds for r in quick) < 5.0  # none waits out its time
    bad = _check(warm, HealthSettings(enabled=True, command="echo one; echo GPU 3: ECC >&2; exit 4"),
                 1, sig[0])
    assert not bad.ok
    assert "failed with exit code 4: one | GPU 3: ECC" in bad.reason, bad.reason


@pytest.mark.slow
def test_a_signal_during_the_check_kills_its_processes(
        warm: ForkServer, sig: tuple[socket.socket, socket.socket], tmp_path: Any) -> None:
    pidfile = tmp_path / "pid"
    s = HealthSettings(enabled=True, command=f"echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; "
                       "exec sleep 600")
    sent: list[float] = []

    def send() -> None:
        until(pidfile.exists, 30, "the check's command running")
        sent.append(time.monotonic())
        sig[1].send(bytes([signal.SIGTERM]))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    result = run_check(warm, s, 1, ENV, sig[0])
    took = time.monotonic() - sent[0]
    thread.join(5)
    assert result == signal.SIGTERM
    pid = int(pidfile.read_text())
    assert not alive(pid), f"the check's process {pid} outlived the check"
    print(f"signal during the check -> returned, its process gone, in {took:.3f}s")
    assert took < 10.0  # the command would run 600 s


# -- real agents ------------------------------------------------------------------------------


def _events(path: str, host: str, event: str = "health_check") -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["event"] == event and r["host"] == host]


def _status(port: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "elasticstore.cli", "status", "--rdzv-endpoint",
                          f"127.0.0.2:{port}", "--rdzv-id", "job", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


SICK = "echo 'GPU 3: uncorrectable ECC errors' >&2; exit 1"


@pytest.mark.slow
def test_a_sick_node_stays_out_and_the_others_run_without_it(tmp_path: Any) -> None:
    """Three nodes, ``--nnodes 2:3``: two pass the default check, the third's command fails. The
    job starts at world size 2 nodes without it and finishes on both; the sick node says why,
    retries, is shown unhealthy by ``elasticstore status`` (not waiting), and never joins.
    ``last_call_timeout=2``: the first round waits its last call for a third node whatever the
    checks do (30 s by default)."""
    port = free_port()
    logs = str(tmp_path / "logs")
    conf = ["--rdzv-conf", "last_call_timeout=2", "--log-dir", logs]
    events = os.path.join(logs, "job", "events.jsonl")
    with agents(str(tmp_path)) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "2:3", 2, "--health-check", *conf), name="n1")
        n2 = a.start(node_flags("127.0.0.3", port, "2:3", 1, "--health-check", *conf), name="n2")
        n3 = a.start(node_flags("127.0.0.4", port, "2:3", 1, "--health-check-cmd", SICK, *conf),
                     name="n3")
        until(lambda: len(a.inits(0)) == 3, 120, "2 nodes x (2 + 1) workers running")
        assert {s["world"] for s in a.starts()} == {3}
        assert {s["env"]["GROUP_WORLD_SIZE"] for s in a.starts()} == {"2"}
        until(lambda: "retrying in" in a.output(n3), 60, "the sick node's failure line")
        out3 = a.output(n3)
        line = next(ln for ln in out3.splitlines() if "retrying in" in ln)
        assert line.startswith("[elasticstore-run] health check failed: "), out3
        assert line.endswith("failed with exit code 1: GPU 3: uncorrectable ECC errors; "
                             "retrying in 5s"), out3
        for proc, host in ((n1, "127.0.0.2"), (n2, "127.0.0.3")):
            assert "health check passed in" in a.output(proc), a.output(proc)
            checks = _events(events, host)
            assert [c["ok"] for c in checks] == [True], checks
            print(f"{host}: {checks[0]['processes']} process(es), check {checks[0]['seconds']:.3f}s "
                  f"after waiting {checks[0]['warm_wait']:.2f}s for its fork server")
        sick = _events(events, "127.0.0.4")
        assert sick and not any(c["ok"] for c in sick) and "ECC" in sick[0]["reason"], sick
        st = _status(port)
        assert len(st["members"]) == 2 and not any(m["addr"] == "127.0.0.4" for m in st["members"])
        assert not any(n.startswith("127.0.0.4-") for n in st["waiting"]), st["waiting"]
        [u] = st["unhealthy"]
        assert u["addr"] == "127.0.0.4" and u["state"].startswith("unhealthy: ") and "ECC" in u["state"]
        text = subprocess.run([sys.executable, "-m", "elasticstore.cli", "status", "--rdzv-endpoint",
                               f"127.0.0.2:{port}", "--rdzv-id", "job"],
                              capture_output=True, text=True, timeout=60).stdout
        assert any(ln.startswith(f"{u['node']} (127.0.0.4): unhealthy: ") for ln in text.splitlines()), text
        sent = time.monotonic()
        n3.send_signal(signal.SIGTERM)
        assert a.wait(n3, 30) == 128 + signal.SIGTERM, a.output(n3)
        print(f"SIGTERM to the sick node -> exited in {time.monotonic() - sent:.2f}s")
        assert "round " not in a.output(n3)  # it never joined a round
        a.release()
        for proc in (n1, n2):
            assert a.wait(proc, 60) == 0, a.output(proc)


@pytest.mark.slow
def test_checked_again_only_after_its_own_failure_and_a_sick_node_steps_aside(tmp_path: Any) -> None:
    """Node 2's worker fails in the first round; its check (healthy until its worker started)
    then fails, and it steps aside: node 1, whose round ended elsewhere (no check), forms the
    next round alone at once, without waiting the join timeout for node 2 to come back. Node 1
    checked itself once, node 2 twice. Once node 1 finished, node 2 sees the run closed and
    exits instead of retrying forever."""
    port = free_port()
    logs = str(tmp_path / "logs")
    conf = ["--max-restarts", "1", "--rdzv-conf", "last_call_timeout=30", "--log-dir", logs]
    events = os.path.join(logs, "job", "events.jsonl")
    sick_after_start = f"test ! -e {tmp_path}/start-0-1.json"
    train = ["--dir", str(tmp_path), "--fail-rank", "1", "--fail-attempt", "0"]
    with agents(str(tmp_path)) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "1:2", 1, "--health-check", *conf), train, name="n1")
        n2 = a.start(node_flags("127.0.0.3", port, "1:2", 1, "--health-check-cmd", sick_after_start,
                                *conf), train, name="n2")
        until(lambda: "retrying in" in a.output(n2), 120, "node 2's check failing after its failure")
        failed_at = time.monotonic()
        until(lambda: len(a.inits(1)) == 1, 60, "node 1 alone in the next round")
        took = time.monotonic() - failed_at
        print(f"node 2 stepped aside -> node 1's next round running in {took:.2f}s")
        assert took < 20.0, "node 1 waited for node 2 to come back"
        a.release()
        assert a.wait(n1, 60) == 0, a.output(n1)
        out1 = a.output(n1)
        assert "no restart spent" in out1 and out1.count("health check passed") == 1, out1
        assert [c["ok"] for c in _events(events, "127.0.0.2")] == [True]
        assert [c["ok"] for c in _events(events, "127.0.0.3")] == [True, False]
        assert a.wait(n2, 90) == 1, a.output(n2)
        assert "while this node was unhealthy" in a.output(n2), a.output(n2)


def _agent_alone(a: Any, port: int, *flags: str) -> subprocess.Popen[bytes]:
    return a.start(node_flags("127.0.0.2", port, "1", 1, "--rdzv-conf", "join_timeout=120", *flags),
                   name="n1")


def _sigterm(a: Any, proc: Any, when: str) -> float:
    """SIGTERM to the agent; how long it took to exit (with 128 + SIGTERM)."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = a.wait(proc, 30)
    took = time.monotonic() - sent
    print(f"SIGTERM {when} -> agent exited in {took:.2f}s")
    assert code == 128 + signal.SIGTERM, a.output(proc)
    return took


@pytest.mark.slow
def test_sigterm_while_backing_off_exits_at_once(tmp_path: Any) -> None:
    port = free_port()
    with agents(str(tmp_path)) as a:
        n1 = _agent_alone(a, port, "--health-check-cmd", "false")
        # the second wait (10 s): the signal lands with 9 s or more of it left, whatever the
        # load (the first, 5 s, left too little margin over a loaded machine's exit time)
        until(lambda: "retrying in 10s" in a.output(n1), 60, "the second failure line")
        took = _sigterm(a, n1, "during the back-off")
        assert "got SIGTERM while unhealthy: not joining" in a.output(n1)
        assert took < 7.0  # the signal did not wait for the back-off


@pytest.mark.slow
def test_sigterm_during_the_check_exits_at_once_and_kills_it(tmp_path: Any) -> None:
    port = free_port()
    pidfile = tmp_path / "check.pid"
    hang = f"echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; exec sleep 600"
    with agents(str(tmp_path)) as a:
        n1 = _agent_alone(a, port, "--health-check-cmd", hang)
        until(pidfile.exists, 60, "the check's command running")
        pid = int(pidfile.read_text())
        took = _sigterm(a, n1, "during the check")
        assert "got SIGTERM during the health check" in a.output(n1)
        assert not alive(pid), "the check's process outlived the agent"
        assert took < 10.0  # the check itself would run 600 s


@pytest.mark.slow
def test_a_check_that_keeps_failing_gives_up_after_the_join_timeout(tmp_path: Any) -> None:
    """``--health-check-cmd`` that always fails, ``join_timeout=6``: checks until 6 s after the
    first began (the last wait cut to end then), then exit 1 with a message naming the check and
    its last output, instead of retrying every 60 s without end."""
    port = free_port()
    cmd = "echo 'GPU 0: fell off the bus' >&2; exit 3"
    with agents(str(tmp_path)) as a:
        started = time.monotonic()
        n1 = a.start(node_flags("127.0.0.2", port, "1", 1, "--rdzv-conf", "join_timeout=6",
                                "--health-check-cmd", cmd), name="n1")
        code = a.wait(n1, 40)
        took = time.monotonic() - started
        out = a.output(n1)
    print(f"a node failing its check, join_timeout=6: exited {code} after {took:.1f}s")
    assert code == 1, out
    assert "health check failed: " in out and "retrying in" in out, out
    last = out.strip().splitlines()[-2]
    assert last.startswith("[elasticstore-run] HealthCheckFailed: health check " + repr(cmd)), out
    assert re.search(r"failed [2-9] time\(s\) in 6s \(join_timeout\): not joining; last: ", last), last
    assert last.endswith("failed with exit code 3: GPU 0: fell off the bus"), last
    assert "round " not in out
