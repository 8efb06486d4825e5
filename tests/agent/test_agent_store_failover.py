"""The node hosting the rendezvous store is lost (its agent SIGKILLed with its workers): the
survivors agree on the next host, the job goes on at the smaller size and finishes; a node started
later with the same command line, and the old host coming back, join the moved store as members.

Three simulated nodes on 127.0.0.2-4, one ``--rdzv-endpoint`` list naming all three, 2 workers
each. The failover path never waits for the last call (a round after a loss forms once the
survivors are back); the last call is shortened here only for the later scale-up rounds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from agent_nodes import agents, assert_gone, events, free_port, tree, until
from step_log import STEPS_TRAIN, formed_since, groups, overlaps, trained_since

pytestmark = pytest.mark.slow
XDIST_PER_TEST = True  # each test starts its own agents on its own ports: they run side by side

ADDRS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def _flags(addr: str, port: int, nnodes: str, *extra: str) -> list[str]:
    endpoints = ",".join(f"{a}:{port}" for a in ADDRS)
    return ["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-endpoint", endpoints,
            "--local-addr", addr, "--rdzv-id", "job", "--max-restarts", "0", *extra]


def test_store_host_lost_survivors_go_on_and_late_nodes_find_the_new_host(tmp_path: object) -> None:
    port = free_port()
    conf = ["--rdzv-conf", "last_call_timeout=2"]
    with agents(str(tmp_path)) as a:
        logs = [os.path.join(str(tmp_path), f"logs-{i + 1}") for i in range(len(ADDRS))]
        nodes = [a.start(_flags(addr, port, "2:4", *conf, "--log-dir", logs[i]), name=f"n{i + 1}")
                 for i, addr in enumerate(ADDRS)]
        until(lambda: a.world_ready(6) is not None, 180, "3 nodes x 2 workers running")
        host_workers = [s["pid"] for s in a.starts() if s["world"] == 6 and s["env"]["GROUP_RANK"] == "0"]
        assert len(host_workers) == 2
        killed_at = time.time()
        os.kill(nodes[0].pid, signal.SIGKILL)  # the agent hosting the store; its workers follow
        assert_gone(host_workers, 5.0)
        until(lambda: a.world_ready(4, killed_at) is not None, 60, "survivors at world size 4")
        att = a.world_ready(4, killed_at)
        assert att is not None
        print(f"store host lost -> survivors past init_process_group at world size 4: "
              f"{max(a.inits(att).values()) - killed_at:.3f}s")
        moved = f"the rendezvous store moved from {ADDRS[0]}:{port} to {ADDRS[1]}:{port} (epoch 2)"
        for proc in nodes[1:]:
            assert moved in a.output(proc), a.output(proc)
        # elasticstore status, given the same endpoint list, reads the moved store and shows it.
        endpoints = ",".join(f"{addr}:{port}" for addr in ADDRS)
        host = _status(endpoints)["host"]
        assert (host["endpoint"], host["epoch"], host["previous"]) == (
            f"{ADDRS[1]}:{port}", 2, f"{ADDRS[0]}:{port}"), host
        assert host["node"].startswith(ADDRS[1] + "-") and time.time() - host["since"] < 120
        text = subprocess.run([sys.executable, "-m", "elasticstore.cli", "status", "--rdzv-endpoint",
                               endpoints, "--rdzv-id", "job"], capture_output=True, text=True,
                              timeout=60).stdout
        assert f"store host: {ADDRS[1]}:{port}" in text and f"took over from {ADDRS[0]}:{port}" in text, text

        # The old host comes back with the same command line: a member of the moved store, which
        # stays where it is; then a fourth node, started later with the same command line.
        back_at = time.time()
        back = a.start(_flags(ADDRS[0], port, "2:4", *conf), name="n1-back")
        until(lambda: a.world_ready(6, back_at) is not None, 120, "the old host taken in as a member")
        st = _status(endpoints)
        assert (st["host"]["endpoint"], st["host"]["epoch"]) == (f"{ADDRS[1]}:{port}", 2), st["host"]
        assert sorted(m["addr"] for m in st["members"]) == sorted(ADDRS), st["members"]
        fourth_at = time.time()
        fourth = a.start(_flags("127.0.0.5", port, "2:4", *conf), name="n4")
        until(lambda: a.world_ready(8, fourth_at) is not None, 120, "a fourth node taken in")
        assert _status(endpoints)["host"]["epoch"] == 2
        a.release()
        for proc in (*nodes[1:], back, fourth):
            assert a.wait(proc, 90) == 0, a.output(proc)
        for proc in nodes[1:]:
            assert "restart 1/0" not in a.output(proc)  # a lost host spends no restart
        for log_dir in logs[1:]:
            (event,) = [e for e in events(log_dir) if e["event"] == "store_moved"]
            assert (event["previous"], event["endpoint"], event["epoch"]) == (
                f"{ADDRS[0]}:{port}", f"{ADDRS[1]}:{port}", 2)


def _status(endpoints: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "elasticstore.cli", "status", "--rdzv-endpoint",
                          endpoints, "--rdzv-id", "job", "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


# -- issue 26 A: the switch at once, one host per epoch, a restarted host, a silent host ----------

def _steps_flags(addr: str, port: int, nnodes: str, *extra: str) -> list[str]:
    return _flags(addr, port, nnodes, "--rdzv-conf", "join_timeout=40", *extra)


def _start_steps(a: Any, i: int, port: int, nnodes: str, workdir: str, name: str | None = None,
                 term_delay: float = 0.0, conf: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    env = {"ELASTICSTORE_TEST_NODE": ADDRS[i], "STEPS_TERM_DELAY": str(term_delay)}
    return a.start(_steps_flags(ADDRS[i], port, nnodes, *conf), ["--dir", workdir],
                   name=name or f"n{i + 1}", env=env, script=STEPS_TRAIN)


def _finish(a: Any, procs: list[subprocess.Popen[bytes]], workdir: str) -> None:
    a.release()
    for proc in procs:
        assert a.wait(proc, 90) == 0, a.output(proc)
    bad = overlaps(groups(workdir))
    assert not bad, "two groups trained at once: " + "; ".join(
        f"{x.describe()} | {y.describe()}" for x, y in bad)


def test_slow_stopping_first_candidate_still_hosts_next(tmp_path: object) -> None:
    """Issue 26 A1: the first candidate's workers take 15 s to exit on SIGTERM; it serves the
    next epoch at once (not after stopping them), so the third node is not passed over to host a
    second store of the same epoch: one round of world size 4, exit 0."""
    workdir, port = str(tmp_path), free_port()
    with agents(workdir) as a:
        nodes = [_start_steps(a, i, port, "2:3", workdir, term_delay=15.0 if i == 1 else 0.0)
                 for i in range(3)]
        until(lambda: trained_since(workdir, 0, 6), 180, "3 nodes x 2 workers training")
        killed_at = time.time()
        os.kill(nodes[0].pid, signal.SIGKILL)
        until(lambda: trained_since(workdir, killed_at, 4), 60, "the survivors training at world size 4")
        for proc in nodes[1:]:
            out = a.output(proc)
            assert f"moved from {ADDRS[0]}:{port} to {ADDRS[1]}:{port} (epoch 2)" in out, out
        _finish(a, nodes[1:], workdir)


def test_host_restarted_early_joins_the_survivors(tmp_path: object) -> None:
    """Issue 26 A2: the host is SIGKILLed and restarted 1 s later with the same command line while
    the first candidate still stops its workers (12 s here: the window must outlast the restarted
    agent's start on a loaded machine): it must not host a fresh store and train
    alone beside the survivors; it joins them (or waits) and the job finishes, exit 0."""
    workdir, port = str(tmp_path), free_port()
    conf = ("--rdzv-conf", "last_call_timeout=2")
    with agents(workdir) as a:
        nodes = [_start_steps(a, i, port, "1:3", workdir, term_delay=12.0 if i == 1 else 0.0,
                              conf=conf) for i in range(3)]
        until(lambda: trained_since(workdir, 0, 6), 180, "3 nodes x 2 workers training")
        killed_at = time.time()
        os.kill(nodes[0].pid, signal.SIGKILL)
        time.sleep(1.0)
        back = _start_steps(a, 0, port, "1:3", workdir, name="n1-back", conf=conf)
        until(lambda: trained_since(workdir, killed_at + 1, 6), 90, "all three nodes training again")
        out = a.output(back)
        assert "world size 2;" not in out, out  # never a group of its own
        _finish(a, [*nodes[1:], back], workdir)


def test_silent_host_noticed_within_store_timeout(tmp_path: object) -> None:
    """Issue 26 A3: the host (agent and workers) SIGSTOPped; with store_timeout=5 the survivors
    train again at world size 4 within ~10 s (not after the round watch's 60 s slice). Then
    SIGCONTed, the old host sees the newer store and joins it as a member (it does not wait out
    its join_timeout on a store that can form no round): world size 6 again, all exit 0."""
    workdir, port = str(tmp_path), free_port()
    with agents(workdir) as a:
        nodes = [_start_steps(a, i, port, "2:3", workdir, conf=("--rdzv-conf", "store_timeout=5"))
                 for i in range(3)]
        until(lambda: trained_since(workdir, 0, 6), 180, "3 nodes x 2 workers training")
        stopped = tree(nodes[0].pid)
        stopped_at = time.time()
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            until(lambda: trained_since(workdir, stopped_at, 4), 25,
                  "the survivors training at world size 4 (store_timeout=5)")
            took = trained_since(workdir, stopped_at, 4).first - stopped_at  # type: ignore[union-attr]
            print(f"silent host -> survivors training at world size 4: {took:.1f}s")
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    pass
        back_at = time.time()
        until(lambda: trained_since(workdir, back_at, 6), 60, "the old host back as a member (world size 6)")
        print(f"old host SIGCONTed -> training at world size 6: "
              f"{trained_since(workdir, back_at, 6).first - back_at:.1f}s")  # type: ignore[union-attr]
        assert "(epoch 2)" in a.output(nodes[0]), a.output(nodes[0])
        _finish(a, nodes, workdir)


def _one_worker(a: Any, i: int, port: int, workdir: str, name: str,
                join_timeout: int = 40) -> subprocess.Popen[bytes]:
    endpoints = ",".join(f"{addr}:{port}" for addr in ADDRS)
    flags = ["--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-endpoint", endpoints,
             "--local-addr", ADDRS[i], "--rdzv-id", "job", "--max-restarts", "10", "--rdzv-conf",
             f"last_call_timeout=1,join_timeout={join_timeout},store_timeout=10"]
    return a.start(flags, ["--dir", workdir], name=name, script=STEPS_TRAIN,
                   env={"ELASTICSTORE_TEST_NODE": ADDRS[i], "STEPS_TERM_DELAY": ""})


def _signal_tree(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def test_node_that_gave_its_store_up_still_tells_a_restart_the_run_is_alive(tmp_path: object) -> None:
    """A node that hosted the store and gave it up (SIGSTOPped while the others moved on, then
    continued) listens as a follower again: with the store's host silent, the first entry's node
    restarted finds the run alive there and waits for the host, instead of hosting a fresh run
    (round 1 again) beside the job. Before, its follower had become its store and was never
    restored: after a few switches no node said the run was alive. Only the restart is checked:
    with n1 killed and the host of epoch 3 stopped, the node that gave its store up holds no
    majority of the last round alone, and whether the job goes on after the host is continued is
    not asked here (1 worker per node; 35-90 s)."""
    workdir, port = str(tmp_path), free_port()

    def hosts(i: int, epoch: int) -> bool:
        return f"hosts the store now, at {ADDRS[i]}:{port} (epoch {epoch})" in a.output(nodes[i])

    with agents(workdir) as a:
        nodes = [_one_worker(a, i, port, workdir, f"n{i + 1}") for i in range(3)]
        until(lambda: trained_since(workdir, 0, 3), 180, "3 nodes training")
        # The first entry's node (the host) killed and restarted: the first of n2 and n3 in the
        # last round's rank order (the order they joined in) hosts epoch 2.
        killed_at = time.time()
        os.kill(nodes[0].pid, signal.SIGKILL)
        nodes[0].wait(30)
        nodes[0] = _one_worker(a, 0, port, workdir, "n1-back")
        until(lambda: formed_since(workdir, killed_at, 3), 90, "n1 back: world size 3")
        gave_up = until(lambda: next((i for i in (1, 2) if hosts(i, 2)), None), 30,
                        "the host of epoch 2")
        host = 3 - gave_up
        # The host of epoch 2 stopped: the other one hosts epoch 3; the stopped one, continued,
        # gives its store up and joins.
        stopped = tree(nodes[gave_up].pid)
        stopped_at = time.time()
        _signal_tree(stopped, signal.SIGSTOP)
        try:
            until(lambda: formed_since(workdir, stopped_at, 2), 60, "two nodes training at world size 2")
        finally:
            _signal_tree(stopped, signal.SIGCONT)
        back_at = time.time()
        until(lambda: formed_since(workdir, back_at, 3), 60, "the stopped node back as a member")
        assert hosts(host, 3), a.output(nodes[host])
        assert f"to {ADDRS[host]}:{port} (epoch 3)" in a.output(nodes[gave_up]), a.output(nodes[gave_up])
        # The host silent and n1 restarted: only the node that gave its store up may tell n1 that
        # the run is alive; the host is continued once n1 has either waited or trained.
        silent = tree(nodes[host].pid)
        _signal_tree(silent, signal.SIGSTOP)
        try:
            os.kill(nodes[0].pid, signal.SIGKILL)
            nodes[0].wait(30)
            restarted_at = time.time()
            nodes[0] = _one_worker(a, 0, port, workdir, "n1-again")
            until(lambda: "waiting for the next host" in a.output(nodes[0])
                  or trained_since(workdir, restarted_at) is not None, 60, "n1 restarted")
            fresh = [g for g in groups(workdir) if g.last > restarted_at and g.attempt == 0]
            assert not fresh, f"a fresh run beside the job: {fresh[0].describe()}"
            assert "waiting for the next host" in a.output(nodes[0]), a.output(nodes[0])
        finally:
            _signal_tree(silent, signal.SIGCONT)
        bad = overlaps(groups(workdir))
        assert not bad, f"two groups trained at once: {bad[0][0].describe()} | {bad[0][1].describe()}"


def test_host_restarted_while_the_others_are_frozen_waits_for_them(tmp_path: object) -> None:
    """The old host restarted (same command line) while every other node is frozen (SIGSTOP:
    a paused VM, a partition): their endpoints accept connections but answer nothing. It must
    not host a fresh run (round 1 again, world size 1) under the live run id; it waits for
    them, and once they are continued the job trains again with it, at a later round. Before,
    nothing answering was taken for no run at all (1 worker per node; ~40-90 s)."""
    workdir, port = str(tmp_path), free_port()
    with agents(workdir) as a:
        nodes = [_one_worker(a, i, port, workdir, f"n{i + 1}") for i in range(3)]
        until(lambda: trained_since(workdir, 0, 3), 180, "3 nodes training")
        frozen = tree(nodes[1].pid) + tree(nodes[2].pid)
        _signal_tree(frozen, signal.SIGSTOP)
        try:
            os.kill(nodes[0].pid, signal.SIGKILL)
            nodes[0].wait(30)
            restarted_at = time.time()
            nodes[0] = _one_worker(a, 0, port, workdir, "n1-back")
            until(lambda: "do(es) not answer" in a.output(nodes[0])
                  or formed_since(workdir, restarted_at) is not None, 90, "n1 restarted")
            time.sleep(3.0)  # a fresh run would form at once (min_nodes 1)
            fresh = formed_since(workdir, restarted_at)
            assert fresh is None, f"a fresh run beside the frozen job: {fresh.describe()}"
        finally:
            _signal_tree(frozen, signal.SIGCONT)
        back_at = time.time()
        until(lambda: formed_since(workdir, back_at, 3), 90, "the job training again at world size 3")
        assert formed_since(workdir, back_at, 3).attempt > 0  # type: ignore[union-attr]
        bad = overlaps(groups(workdir))
        assert not bad, f"two groups trained at once: {bad[0][0].describe()} | {bad[0][1].describe()}"


def test_majority_lost_at_once_closes_the_run_instead_of_starting_it_afresh(tmp_path: object) -> None:
    """The host and a second node SIGKILLed at once and restarted (a supervisor): the survivor
    hosts the next epoch but the quorum rule (a majority of the last round) cannot be met, the
    restarted nodes being new members. After join_timeout the survivor closes the run, saying
    why, and everyone exits non-zero: no fresh run (round 1 again, its records lost) forms
    under the run id once the survivor is gone. Before, the survivor timed out without closing
    the run; the nemesis (seed s2) then saw restarted nodes start the run afresh (1 worker per
    node; ~40-80 s)."""
    workdir, port = str(tmp_path), free_port()
    with agents(workdir) as a:
        nodes = [_one_worker(a, i, port, workdir, f"n{i + 1}", join_timeout=15) for i in range(3)]
        until(lambda: trained_since(workdir, 0, 3), 180, "3 nodes training")
        for n in nodes[:2]:
            os.kill(n.pid, signal.SIGKILL)
        for n in nodes[:2]:
            n.wait(30)
        killed_at = time.time()
        # The restarted nodes would wait longer than the survivor: they outlive its store.
        nodes[:2] = [_one_worker(a, i, port, workdir, f"n{i + 1}-back", join_timeout=45)
                     for i in range(2)]
        codes = [n.wait(120) for n in nodes]
        assert all(c != 0 for c in codes), codes
        fresh = formed_since(workdir, killed_at)
        assert fresh is None, f"a fresh run after the majority was lost: {fresh.describe()}"
        assert "more than half of round" in a.output(nodes[2]), a.output(nodes[2])
