"""The receiving side of replicas: a small TCP endpoint in the agent that places its ring
predecessor's newest sharded snapshot files in ``<area>/replicas/``, where restore reads them.

One transfer at a time, on one thread. The files are written under temporary names (reserved
first: a memory file system without room refuses the transfer, never a half-written file), each
checked once complete (a snapshot, sharded, of the announced step: ``peek``), and renamed into
place only when the sender commits them. They are named by their writer's global rank
(``replica_name``), so replicas of two senders never collide at one step of one world.

What is kept, per sender (an agent's random id): the files of its two newest steps, and those of
the step the latest transfer says to keep (``keep``: the schedule's committed step, which every
survivor of a node loss restores from; ``schedule.py``). A step that
arrives replaces that sender's files of the same or newer steps (its workers went back to an
older step: what it had sent past it is of another history). Other senders' files older than
the step that arrived are removed: a node that left the ring (lost, or the ring changed) keeps
its newest files here until the current predecessor has sent a newer step.

Another history: when a round resumes from an older step, the steps after it are taken again,
and a replica of one of them from before the resume is not the state of the new one. Each file
is kept with the round it was written in (the sender says it; a round other than this node's
current one counts as "before"). Once this node's own workers wrote step ``m`` in this round
(``own_written``), the replicas from before this round of step ``m`` or later are removed, and
such a replica that arrives later is refused. Until then they stay: they are what this round's
restore may need.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from ..train.snapshots.peek import peek, replica_name
from .wire import (MAX_FILE_BYTES, MAX_FILES, NONCE_BYTES, PREAMBLE, CHUNK, IDLE_S, ReplicaError,
                   deadline_for, mac, recv_frame, send_frame)

__all__ = ["KEEP_STEPS", "REPLICAS", "Receiver"]

REPLICAS = "replicas"  # sharded_restore.REPLICAS
KEEP_STEPS = 2  # steps kept per sender
HELLO_S = 10.0  # from a connection to its header (the transfer's own limit starts then)
CLOSE_S = 5.0
_TMP = ".tmp.replica."


def _ip(text: str) -> str:
    addr = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


class Receiver:
    """Serves ``<area>/replicas/`` on ``host`` (a free port: ``port``). ``token``: the run's
    ("": none; then only the addresses given to ``allow`` may send)."""

    def __init__(self, area: str, host: str, token: str,
                 log: Callable[[str], None] = lambda _: None) -> None:
        self.dir = os.path.join(area, REPLICAS)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self._token, self._log = token, log
        self._allowed: frozenset[str] = frozenset()
        self._owner: dict[str, tuple[str, int, int]] = {}  # name -> (sender, step, round; -1)
        self._lock = threading.Lock()  # _owner and the round: the sender's thread reports too
        self._attempt: int | None = None  # this node's round
        self._own_min: int | None = None  # the oldest step its workers wrote in it
        self.received = 0  # transfers placed
        self._stop = threading.Event()
        self._conn: socket.socket | None = None  # the transfer in progress
        self._said: set[str] = set()  # peers whose failure was said
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._sock = socket.create_server((host, 0), family=family)
        except OSError:  # a name for another interface: every interface (a token, or the allowlist)
            dual = socket.has_dualstack_ipv6()
            self._sock = socket.create_server(
                ("", 0), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual)
        self._sock.settimeout(0.2)
        self.port = int(self._sock.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, name="replica-receiver", daemon=True)
        self._thread.start()

    def new_round(self, attempt: int) -> None:
        with self._lock:
            self._attempt, self._own_min = attempt, None

    def own_written(self, attempt: int, step: int) -> None:
        """This node's workers wrote ``step`` in round ``attempt``: the replicas from before it,
        of that step or later, are of another history (module doc)."""
        with self._lock:
            if attempt != self._attempt or (self._own_min is not None and self._own_min <= step):
                return
            self._own_min = step
            for name, (_, st, written) in list(self._owner.items()):
                if st >= step and written != attempt:
                    self._remove(name)

    def allow(self, addresses: set[str]) -> None:
        """Without a token: the peer addresses that may send (the ring predecessor's)."""
        self._allowed = frozenset(_ip(a) for a in addresses)

    def close(self) -> None:
        """Stops at once, a transfer in progress too (its temporary files are removed)."""
        self._stop.set()
        _shut(self._conn)
        self._thread.join(CLOSE_S)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conn = conn
            with conn:
                try:
                    self._handle(conn, _ip(peer[0]))
                    self._said.discard(peer[0])
                except Exception as err:  # the endpoint serves on, whatever one transfer did
                    if not self._stop.is_set() and peer[0] not in self._said:
                        self._said.add(peer[0])  # once per peer until one of its transfers works
                        self._log(f"[elasticstore-run] replica from {peer[0]} not taken: {err}")
            self._conn = None

    def _handle(self, conn: socket.socket, peer: str) -> None:
        deadline = time.monotonic() + HELLO_S
        if not self._token and peer not in self._allowed:
            raise ReplicaError(f"{peer} is not this node's ring predecessor (no token is set)")
        nonce = os.urandom(NONCE_BYTES)
        conn.settimeout(IDLE_S)
        conn.sendall(PREAMBLE + nonce)
        head = recv_frame(conn, deadline)
        sender, step, sizes = head.get("sender"), head.get("step"), head.get("sizes")
        written, keep = head.get("attempt"), head.get("keep", -1)
        if self._token and not (isinstance(head.get("mac"), str) and
                                _equal(head["mac"], mac(self._token, nonce))):
            send_frame(conn, {"ok": False, "error": "authentication failed"}, deadline)
            raise ReplicaError("the sender did not prove the run's token")
        why = _bad_header(sender, step, sizes, written, keep)
        if why is None:
            assert isinstance(sizes, list)
            why = self._no_room(sum(sizes))
        if why is not None:
            send_frame(conn, {"ok": False, "error": why}, deadline)
            raise ReplicaError(why)
        assert isinstance(sender, str) and isinstance(step, int) and isinstance(sizes, list)
        assert isinstance(written, int) and isinstance(keep, int)
        send_frame(conn, {"ok": True}, deadline)
        tmps: list[str] = []
        try:
            deadline = deadline_for(sum(sizes))
            for size in sizes:
                tmps.append(os.path.join(self.dir, f"{_TMP}{uuid.uuid4().hex}"))
                _receive_file(conn, tmps[-1], size, deadline)
            send_frame(conn, {"received": True}, deadline)  # the sender checks its files now
            if recv_frame(conn, deadline).get("commit") is not True:
                return  # a file was taken for a newer step while sent: nothing to say
            try:
                with self._lock:
                    self._place(sender, step, written, tmps, keep)
            except ValueError as err:
                send_frame(conn, {"ok": False, "error": str(err)}, deadline)
                raise
            send_frame(conn, {"ok": True}, deadline)
        finally:
            for tmp in tmps:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass

    def _no_room(self, total: int) -> str | None:
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize
        return None if total <= free else f"no room: {total} bytes, {free} free in {self.dir}"

    def _place(self, sender: str, step: int, written: int, tmps: list[str], keep: int) -> None:
        """Checks the files, renames them into place, applies what is kept (module doc)."""
        if written != self._attempt or written < 0:
            written = -1  # before this node's round
            if self._own_min is not None and step >= self._own_min:
                raise ValueError(f"step {step} was written before this round's resume, which "
                                 f"took step {self._own_min} again here: another history")
        names = []
        for tmp in tmps:
            found = peek(tmp)
            if not found.sharded or found.step != step:
                raise ValueError(f"{found} is not a sharded snapshot of step {step}")
            names.append(replica_name(step, found.rank))
        if len(set(names)) != len(names):
            raise ValueError(f"step {step}: two files of one rank")
        for name, (who, st, _) in list(self._owner.items()):
            if who == sender and st >= step:
                self._remove(name)
        for tmp, name in zip(tmps, names):
            os.rename(tmp, os.path.join(self.dir, name))
            self._owner[name] = (sender, step, written)
        steps = sorted({st for who, st, _ in self._owner.values() if who == sender}, reverse=True)
        for name, (who, st, _) in list(self._owner.items()):
            if (who == sender and st not in steps[:KEEP_STEPS] and st != keep) or \
                    (who != sender and st < step):
                self._remove(name)
        self.received += 1

    def _remove(self, name: str) -> None:
        self._owner.pop(name, None)
        try:
            os.unlink(os.path.join(self.dir, name))
        except FileNotFoundError:
            pass


def _shut(conn: socket.socket | None) -> None:
    """Ends a transfer blocked on ``conn`` (from another thread)."""
    if conn is not None:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _bad_header(sender: object, step: object, sizes: object, written: object,
                keep: object) -> str | None:
    if not (isinstance(sender, str) and 0 < len(sender) <= 64):
        return f"a sender id that is not a short string: {sender!r:.80}"
    if type(step) is not int or step < 0:
        return f"a step that is not an integer >= 0: {step!r:.80}"
    if type(written) is not int or written < -1:
        return f"a round that is not an integer >= -1: {written!r:.80}"
    if type(keep) is not int or keep < -1:
        return f"a step to keep that is not an integer >= -1: {keep!r:.80}"
    if not (isinstance(sizes, list) and 0 < len(sizes) <= MAX_FILES and
            all(type(s) is int and 64 <= s <= MAX_FILE_BYTES for s in sizes)):
        return f"file sizes that are not 1 to {MAX_FILES} integers in [64, {MAX_FILE_BYTES}]"
    return None


def _receive_file(conn: socket.socket, path: str, size: int, deadline: float) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC now, not a bus error for a reader later
        buf = bytearray(min(CHUNK, size))
        view, got = memoryview(buf), 0
        while got < size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReplicaError("the replica transfer ran past its time limit")
            conn.settimeout(min(left, IDLE_S))
            k = conn.recv_into(view, min(len(buf), size - got))
            if k == 0:
                raise ReplicaError(f"the sender closed the connection ({got} of {size} bytes)")
            done = 0
            while done < k:
                done += os.write(fd, view[done:k])
            got += k
    finally:
        os.close(fd)
