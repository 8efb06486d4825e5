"""Replicas of sharded snapshots between two agents' endpoints (``elasticstore.replicas``), real
sockets on loopback, real snapshot files: what lands where, what is kept, who is refused.

- ``peek`` reads the identity that ``fileformat`` writes (and their constants agree).
- A sender's newest complete step lands in the receiver's ``replicas/`` under its writers' global
  ranks, byte for byte, renamed into place (no temporary file left); two steps are kept; a step
  taken again replaces the sender's newer files (another history). A step not complete on every
  local rank is not sent.
- A wrong token, or (without a token) an address that is not the predecessor's: nothing lands.
- Replicated (DDP) state is not replicated.
- Replicas from before a resume to an older step are dropped once this node took a step again.
- Three services form their ring through a round's store, and send the step their schedule
  names (``schedule.py``): none before the leader's floor, then that one, committed once placed
  everywhere (the hold files say so); a round of one node removes its hold.
- Two nodes that place different steps for one floor: a new floor further ahead, said once; the
  receivers keep the committed step besides their two newest.
- A file its worker takes for a newer step while it is sent is withdrawn, never placed, also when
  it is rewritten after ``sendfile`` returned (the bytes leave when the receiver reads them).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import agent_nodes
import pytest
import torch

from elasticstore.replicas import Receiver, Sender
from elasticstore.train.snapshots import fileformat
from elasticstore.train.snapshots.hold import HOLD_NAME
from elasticstore.train.snapshots.identity import Identity
from elasticstore.train.snapshots.peek import HEADER, MAGIC, NAME, peek

HOST = "127.0.0.1"


def write(area: str, step: int, local: int, rank: int, world: int, fill: float,
          sharded: bool = True) -> str:
    """A complete snapshot file as a worker leaves it (written under a temporary name, renamed)."""
    ident = Identity(step, rank, world, False, sharded).to_dict()
    enc = fileformat.prepare({"w": torch.full((1000,), fill), "note": "x"}, ident)
    buf = fileformat.Buffer(os.path.join(area, fileformat.tmp_name(local)))
    fileformat.encode(enc, step, buf)
    path = os.path.join(area, fileformat.snapshot_name(step, local))
    buf.rename(path)
    buf.close()
    return path


def until(cond: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    return agent_nodes.until(cond, timeout, what)


def held(receiver: Receiver) -> list[str]:
    return sorted(os.listdir(receiver.dir))


def _holds_only(receiver: Receiver, steps: set[int], fills: dict[int, float]) -> bool:
    """The receiver holds replicas of ``steps`` only (and of each step of ``fills`` both local
    ranks, the last one's tensor filled with that value: its newest copy)."""
    names = [n for n in held(receiver) if n.startswith("step-")]  # not a transfer's temporary
    if any(int(n[5:17]) not in steps for n in names):
        return False
    for step, fill in fills.items():
        path = os.path.join(receiver.dir, f"step-{step:012d}.local-3.snap")
        if f"step-{step:012d}.local-2.snap" not in names or not os.path.exists(path):
            return False
        try:
            _, _, state = fileformat.read_snapshot(path)
        except (OSError, ValueError):
            return False  # being replaced
        if not torch.equal(state["w"], torch.full((1000,), fill)):
            return False
    return True


def hold(area: str) -> Any:
    """The area's hold file (None: none)."""
    try:
        with open(os.path.join(area, HOLD_NAME)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


@pytest.fixture
def areas(tmp_path: Path) -> Iterator[tuple[str, str]]:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    yield str(a), str(b)


def test_peek_reads_what_fileformat_writes(tmp_path: Path) -> None:
    assert (MAGIC, HEADER.format, NAME.pattern) == (
        fileformat._MAGIC, fileformat._HEADER.format, fileformat._NAME.pattern)
    path = write(str(tmp_path), 123456789, 1, 5, 8, 1.0)
    got = peek(path)
    assert (got.step, got.rank, got.world_size, got.sharded, got.replicated) == (
        123456789, 5, 8, True, False)
    assert got.size == os.path.getsize(path) and 64 < got.used <= got.size
    junk = tmp_path / "junk"
    junk.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="not a snapshot"):
        peek(str(junk))


def test_newest_step_lands_by_global_rank_and_two_are_kept(areas: tuple[str, str]) -> None:
    a, b = areas
    receiver = Receiver(b, HOST, "secret")
    sender = Sender(a, 2, "node-a", "secret", HOST)
    try:
        write(a, 1, 0, 2, 4, 1.0)
        write(a, 1, 1, 3, 4, 1.5)
        write(a, 2, 0, 2, 4, 2.0)  # step 2 is not complete on this node yet: step 1 goes
        sender.set_target((HOST, receiver.port))
        until(lambda: held(receiver) == ["step-000000000001.local-2.snap",
                                         "step-000000000001.local-3.snap"], "step 1")
        for local, rank in ((0, 2), (1, 3)):
            with open(os.path.join(a, fileformat.snapshot_name(1, local)), "rb") as f, \
                    open(os.path.join(receiver.dir, f"step-000000000001.local-{rank}.snap"),
                         "rb") as g:
                mine, replica = f.read(), g.read()
            assert replica == mine[:len(replica)]  # the bytes in use (not the spare room)
            assert len(replica) == peek(os.path.join(a, fileformat.snapshot_name(1, local))).used
        write(a, 2, 1, 3, 4, 2.5)
        until(lambda: len(held(receiver)) == 4, "step 2")
        write(a, 3, 0, 2, 4, 3.0)
        write(a, 3, 1, 3, 4, 3.5)
        until(lambda: [n[:17] for n in held(receiver)] == ["step-000000000002"] * 2 +
              ["step-000000000003"] * 2, "steps 2 and 3 only")
        # the workers went back to step 1 and take step 2 again: the sender's step 3 is gone
        for step in (2, 3):
            for local in (0, 1):
                os.unlink(os.path.join(a, fileformat.snapshot_name(step, local)))
        write(a, 2, 0, 2, 4, 9.0)
        write(a, 2, 1, 3, 4, 9.5)
        # A pass of the sender between the unlinks and the new files finds step 1 the newest
        # complete step and may send it again (rightly: it is the workers' newest then); the
        # receiver then keeps it beside the new step 2 (two kept). Step 3, of the other
        # history, is gone either way.
        until(lambda: _holds_only(receiver, {1, 2}, {2: 9.5}), "step 2 again")
        assert [n for n in held(receiver) if n.startswith("step-000000000002")] == [
            "step-000000000002.local-2.snap", "step-000000000002.local-3.snap"]
        again = 5 if any(n.startswith("step-000000000001") for n in held(receiver)) else 4
        until(lambda: sender.sent == again, "the sender's count")  # it counts once acknowledged
        assert receiver.received == again
        assert sender.last_bytes == sum(
            peek(os.path.join(a, fileformat.snapshot_name(2, i))).used for i in (0, 1))
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("case", ["wrong token", "not the predecessor", "replicated state"])
def test_nothing_lands_unless_it_should(areas: tuple[str, str], case: str) -> None:
    a, b = areas
    token = "" if case == "not the predecessor" else "secret"
    receiver = Receiver(b, HOST, token)
    sender = Sender(a, 1, "node-a", "other" if case == "wrong token" else token, HOST)
    try:
        receiver.allow({"127.0.0.9"})
        write(a, 4, 0, 0, 2, 1.0, sharded=case != "replicated state")
        sender.set_target((HOST, receiver.port))
        time.sleep(1.0)
        assert held(receiver) == [] and sender.sent == 0
        if case == "not the predecessor":
            receiver.allow({HOST})
            until(lambda: held(receiver) == ["step-000000000004.local-0.snap"], "step 4")
    finally:
        sender.close()
        receiver.close()


def test_replicas_from_before_a_resume_are_dropped(areas: tuple[str, str]) -> None:
    """This node's round 5 resumed from step 5 and its workers took step 6 again: the replicas
    of steps >= 6 from before round 5 (another history) are removed, and refused when they come
    later; step 8 written in round 5 is taken."""
    a, b = areas
    receiver = Receiver(b, HOST, "secret")
    sender = Sender(a, 1, "node-a", "secret", HOST)
    try:
        receiver.new_round(5)
        sender.new_round(4, time.time_ns() + 10**12)  # every file is from before that round
        write(a, 7, 0, 1, 2, 7.0)
        sender.set_target((HOST, receiver.port))
        until(lambda: held(receiver) == ["step-000000000007.local-1.snap"], "step 7")
        receiver.own_written(5, 6)
        assert held(receiver) == []
        os.unlink(os.path.join(a, fileformat.snapshot_name(7, 0)))
        write(a, 8, 0, 1, 2, 8.0)
        time.sleep(1.0)
        assert held(receiver) == [] and sender.sent == 1
        sender.new_round(5, 0)  # the same file, now said to be of round 5
        until(lambda: held(receiver) == ["step-000000000008.local-1.snap"], "step 8", 10)
    finally:
        sender.close()
        receiver.close()


def test_a_ring_of_three_agents_through_the_rounds_store(tmp_path: Path) -> None:
    """Three services publish their endpoints in one round's store (no token: each takes its
    predecessor's address only): the leader's floor is the step after its newest, which nobody
    sends; then node i's files of that step land on node (i + 1) % 3 and it is committed (every
    hold file says so); in the next round of one node there is no ring, no hold, and what arrived
    stays; a round whose other node never publishes does not hold the caller up."""
    import threading

    import torch.distributed as dist

    from elasticstore.replicas import ReplicaService

    store = dist.HashStore()
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    areas = [str(tmp_path / f"n{i}") for i in range(3)]
    for area in areas:
        os.mkdir(area)
    services = [ReplicaService(area, 1, host, "") for area, host in zip(areas, hosts)]
    try:
        rounds = [threading.Thread(target=s.new_round, args=(store, 0, i, 3))
                  for i, s in enumerate(services)]
        for t in rounds:
            t.start()
        for t in rounds:
            t.join(30)
        for i, area in enumerate(areas):
            write(area, 1, 0, i, 3, float(i))
        # the leader's newest is step 1: the floor is 2, and step 1 is sent by nobody
        until(lambda: all(hold(a) == {"committed": None, "floor": 2} for a in areas), "floor 2")
        time.sleep(0.5)
        assert all(held(s.receiver) == [] for s in services)
        for i, area in enumerate(areas):
            write(area, 2, 0, i, 3, float(i))
        for i in range(3):
            until(lambda i=i: held(services[(i + 1) % 3].receiver) ==
                  [f"step-000000000002.local-{i}.snap"], f"node {i}'s file on node {(i + 1) % 3}")
        until(lambda: all(hold(a) == {"committed": 2, "floor": 3} for a in areas), "2 committed")
        services[0].new_round(store, 1, 0, 1)
        assert services[0].sender._target is None and hold(areas[0]) is None
        assert held(services[0].receiver) == ["step-000000000002.local-2.snap"]
        # a round whose other node never publishes: the agent is not held up (a thread looks)
        started = time.monotonic()
        services[1].new_round(store, 2, 1, 2)
        assert time.monotonic() - started < 2.0 and services[1].sender._target is None
    finally:
        for s in services:
            s.close()


def test_a_file_taken_for_a_newer_step_mid_copy_is_withdrawn(areas: tuple[str, str]) -> None:
    """The sender's peer here is a plain socket speaking the wire: once the header came, the
    worker's reuse of the file is played (renamed away to a temporary name, rewritten); the
    bytes sent are then not the snapshot that was announced, and the sender withdraws them
    (commit false) instead of having them placed."""
    import socket
    import threading

    from elasticstore.replicas.wire import PREAMBLE, recv_exact, recv_frame, send_frame

    a, _ = areas
    path = write(a, 6, 0, 0, 2, 6.0)
    server = socket.create_server((HOST, 0))
    server.settimeout(20)
    seen: dict[str, Any] = {}

    def serve() -> None:
        deadline = time.monotonic() + 20
        conn, _ = server.accept()
        with conn:
            conn.sendall(PREAMBLE + os.urandom(32))
            head = recv_frame(conn, deadline)
            os.rename(path, os.path.join(a, fileformat.tmp_name(0)))  # the worker takes it
            send_frame(conn, {"ok": True}, deadline)
            recv_exact(conn, sum(head["sizes"]), deadline)
            send_frame(conn, {"received": True}, deadline)
            seen["commit"] = recv_frame(conn, deadline).get("commit")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sender = Sender(a, 1, "node-a", "", HOST)
    try:
        sender.set_target((HOST, server.getsockname()[1]))
        thread.join(30)
        assert seen == {"commit": False} and sender.sent == 0
    finally:
        sender.close()
        server.close()


def test_a_file_rewritten_after_sendfile_returned_is_withdrawn(areas: tuple[str, str]) -> None:
    """``sendfile`` hands the file's pages to the socket: the receiver reads what they hold when
    it reads. The peer (a plain socket speaking the wire) reads nothing until the sender has long
    returned from ``sendfile``, then plays the worker's reuse of the file (renamed away, rewritten
    in place), then reads: the sender, told every byte was read only now, withdraws them."""
    import socket
    import threading

    from elasticstore.replicas.wire import PREAMBLE, recv_exact, recv_frame, send_frame

    a, _ = areas
    path = write(a, 6, 0, 0, 2, 6.0)
    with open(path, "rb") as f:
        original = f.read()
    server = socket.create_server((HOST, 0))
    server.settimeout(20)
    seen: dict[str, Any] = {}

    def serve() -> None:
        deadline = time.monotonic() + 20
        conn, _ = server.accept()
        with conn:
            conn.sendall(PREAMBLE + os.urandom(32))
            head = recv_frame(conn, deadline)
            send_frame(conn, {"ok": True}, deadline)
            time.sleep(0.5)  # the sender's sendfile returned: its bytes wait in the socket
            tmp = os.path.join(a, fileformat.tmp_name(0))
            os.rename(path, tmp)  # the worker takes the file, and writes into the same memory
            with open(tmp, "r+b") as f:
                f.write(b"\x55" * len(original))
            got = recv_exact(conn, sum(head["sizes"]), deadline)
            seen["rewritten"] = got != original[:len(got)]
            send_frame(conn, {"received": True}, deadline)
            seen["commit"] = recv_frame(conn, deadline).get("commit")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sender = Sender(a, 1, "node-a", "", HOST)
    try:
        sender.set_target((HOST, server.getsockname()[1]))
        thread.join(30)
        assert seen["commit"] is False and sender.sent == 0, seen
    finally:
        sender.close()
        server.close()
