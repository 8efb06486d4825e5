"""The heartbeat board in one process: ``elasticstore.train.heartbeat``/``section`` write it, the
agent's ``HangWatch`` judges it (steady timeout, sections, the first beat, a script that never
beats), and the straggler measure of ``elasticstore status``."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

import elasticstore.train.heartbeats as hb
from elasticstore.agent.hangs import HangWatch, waits_on_peers
from elasticstore.agent.progress import PeerProgress, local_progress, open_section, public
from elasticstore.agent.workers import Worker, WorkerSpec
from elasticstore.ops.stragglers import rank_rows
from elasticstore.train import heartbeat, section


@pytest.fixture
def board(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[HangWatch, Worker]]:
    watch = HangWatch(str(tmp_path), 1, 0.3, 0.3, "node")
    watch.new_round(0, multi_node=False)
    env = watch.env(0)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(hb, "_slot", None)
    monkeypatch.setattr(hb, "_off_pid", None)
    a, b = socket.socketpair()
    spec = WorkerSpec(0, 0, [], env, "script", str(tmp_path / "error.json"), None)
    worker = Worker(spec, os.getpid(), a, time.monotonic())
    try:
        yield watch, worker
    finally:
        slot = hb._slot
        if slot is not None and slot.stacks is not None:
            import faulthandler

            faulthandler.unregister(hb.STACK_SIGNAL)
            slot.stacks.close()
        watch.close()
        a.close()
        b.close()


def _judge(watch: HangWatch, worker: Worker) -> str | None:
    silent = watch._silence(worker, time.monotonic_ns())
    return silent.why if silent is not None else None


def test_steady_timeout_counts_from_the_last_beat(board: tuple[HangWatch, Worker]) -> None:
    watch, worker = board
    heartbeat()
    assert _judge(watch, worker) is None
    time.sleep(0.4)
    why = _judge(watch, worker)
    assert why is not None and why.startswith("no heartbeat for") and "step 1" in why
    heartbeat()
    assert _judge(watch, worker) is None
    view = watch.slot(0)
    assert view is not None and view.beats == 2 and view.pid == os.getpid()
    assert view.flags & 1  # faulthandler registered for the stack dump


def test_sections_have_their_own_timeout(board: tuple[HangWatch, Worker]) -> None:
    watch, worker = board
    heartbeat()
    with section("checkpoint"):  # no timeout: never judged
        time.sleep(0.4)
        assert _judge(watch, worker) is None
    assert _judge(watch, worker) is None  # leaving a section is a sign of life
    with section("eval", timeout=0.2):
        time.sleep(0.3)
        why = _judge(watch, worker)
        assert why is not None and "section 'eval'" in why and "0.2s" in why
    with pytest.raises(ValueError, match="timeout"):
        with section("bad", timeout=0):
            pass


def test_the_first_beat_is_awaited_only_from_a_script_known_to_beat(
        board: tuple[HangWatch, Worker]) -> None:
    watch, worker = board
    time.sleep(0.4)
    assert _judge(watch, worker) is None  # never beat: never judged
    watch.beating_seen = True  # a worker of this agent beat before (e.g. the last round)
    why = _judge(watch, worker)
    assert why is not None and why.startswith("no first heartbeat")


def test_a_rank_that_never_beats_is_judged_only_while_no_rank_of_the_job_beat(
        board: tuple[HangWatch, Worker]) -> None:
    watch, worker = board
    watch.beating_seen = True
    time.sleep(0.4)
    assert _judge(watch, worker) is not None  # nobody beat in this round: start-up hung
    watch.progressed = True  # another rank (here or on another node) beat in this round
    assert _judge(watch, worker) is None


def test_progress_entries_carry_long_sections_to_the_other_nodes(
        board: tuple[HangWatch, Worker]) -> None:
    watch, _ = board
    heartbeat()
    view = watch.slot(0)
    assert view is not None
    assert local_progress(0, [(0, view)], 0.05, time.monotonic_ns())["sections"] == []
    with section("eval"):
        time.sleep(0.1)
        view = watch.slot(0)
        assert view is not None
        assert open_section([(0, view)], time.monotonic_ns()) == \
            "rank 0 is in section 'eval' (no timeout)"
        entry = local_progress(4, [(0, view)], 0.05, time.monotonic_ns())
    assert entry["beaten"] and [(s["rank"], s["name"], s["until"]) for s in entry["sections"]] == [
        (0, "eval", None)]
    with section("save", timeout=0.3):
        time.sleep(0.06)
        view = watch.slot(0)
        assert view is not None
        timed = local_progress(4, [(0, view)], 0.05, time.monotonic_ns())
    records = [{"host": "n2", "progress": public(entry)}]
    peers = PeerProgress(lambda: records)
    assert peers.open_section(4) == "rank 0 on n2 is in section 'eval' (no timeout)"
    assert peers.beaten(4) and peers.open_section(3) is None and not peers.beaten(3)
    records[0]["progress"] = public(timed)
    peers = PeerProgress(lambda: records)
    assert "section 'save' (" in (peers.open_section(4) or "")
    time.sleep(0.3)
    assert peers.open_section(4) is None  # expired: the verdict is no longer held

    def lost() -> list[dict[str, Any]]:
        raise ConnectionError("the store is gone")

    assert PeerProgress(lost).open_section(4) is None  # a store that fails: nothing known


def test_step_and_work_times_are_reported(board: tuple[HangWatch, Worker]) -> None:
    watch, worker = board
    for _ in range(4):
        with section("compute"):
            time.sleep(0.02)
        time.sleep(0.01)
        heartbeat()
    report = watch.report_due([worker])
    assert report is not None
    r = report["0"]
    assert r["step"] == 4 and 0.025 < r["step_seconds"] < 0.2 and 0.015 < r["work_seconds"] < 0.15
    assert watch.report_due([worker]) is None  # not due again before REPORT_EVERY_S


def test_heartbeat_is_a_noop_without_the_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hb.BOARD_ENV, raising=False)
    monkeypatch.setattr(hb, "_slot", None)
    monkeypatch.setattr(hb, "_off_pid", None)
    t0 = time.perf_counter()
    for _ in range(10_000):
        heartbeat()
    with section("x", timeout=1):
        pass
    assert hb._slot is None
    print(f"heartbeat() without an agent: {(time.perf_counter() - t0) / 10_000 * 1e9:.0f} ns")


def test_stacks_waiting_in_a_collective_are_told_apart() -> None:
    waiting = ('Current thread 0x1 (most recent call first):\n  File "/x/torch/distributed/'
               'distributed_c10d.py", line 3 in all_reduce\n  File "train.py", line 9 in main\n')
    hung = 'Current thread 0x1 (most recent call first):\n  File "train.py", line 4 in load\n'
    assert waits_on_peers(waiting) and not waits_on_peers(hung) and not waits_on_peers("")


def test_stragglers_are_compared_with_the_other_ranks() -> None:
    def rec(**ranks: float) -> dict[str, Any]:
        return {"ranks": {r[1:]: {"step": 10, "step_seconds": 1.0, "work_seconds": w}
                          for r, w in ranks.items()}}

    rows = rank_rows({"a": rec(r0=0.1, r1=0.2)}, ["a"])
    assert [r["straggler"] for r in rows] == [False, True] and rows[1]["ratio"] == 2.0
    rows = rank_rows({"a": rec(r0=0.1, r1=0.1), "b": rec(r2=0.1, r3=0.12)}, ["a", "b"])
    assert not any(r["straggler"] for r in rows)
    rows = rank_rows({"a": {"ranks": {"0": {"step": 3, "step_seconds": 0.5, "work_seconds": None},
                                      "1": {"step": 3, "step_seconds": 1.0}}}}, ["a"])
    assert rows[0]["measure"] == "step" and rows[1]["straggler"]
    assert rank_rows({"a": {"ranks": "junk"}}, ["a"]) == [] and rank_rows({}, ["a"]) == []
