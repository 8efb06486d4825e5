"""Barrier and queues of :class:`~elasticstore.EtcdStore` (a part of it, over ``txn``).

Barrier, as the native server's (``csrc/server/kv_blocking.cpp``): ``{prefix}/sys/barrier/{key}`` holds
``"{generation} {arrived} {world_size}"`` (never bound to a lease). An arrival is one exactly-once
transaction: the ``world_size``-th arrival releases the generation (the generation goes up and
the count back to 0) and returns at once; the others wait (a watch) for the generation to move.
An arrival whose wait timed out is withdrawn by a second transaction, unless the generation was
released meanwhile (then the call returns that generation: it was released). A ``world_size``
that differs from the one of arrivals in progress is refused. Unlike the native server, etcd
cannot withdraw the arrival of a process killed while it waited: it stays counted.

Queues: each item is a key of its own, ``{prefix}/q/{key}\\0{uuid}``, popped oldest first (by
create revision) with an exactly-once delete. As in torch's stores, ``wait`` and ``check`` count
a name as present while a key of that name exists or its queue holds items: one snapshot counts
both, and a wait watches both from that snapshot's revision + 1.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

from etcd3 import etcdrpc

from ...errors import QueueEmptyError, StoreError, StoreTimeoutError, WatchCompactedError
from ..api import Key, Timeout, Value
from .base import DELETE, PUT, Reread, deadline as deadline_of, range_end, to_bytes
from .txn import _GONE, EtcdTxnPart, _op_range


MAX_TXN_OPS = 128  # etcd's default --max-txn-ops: operations in one transaction


def _barrier_state(kv: Any) -> tuple[int, int, int]:
    """(generation, arrived, world_size) of a barrier record (a missing one: all 0)."""
    if kv is None:
        return 0, 0, 0
    try:
        generation, arrived, world_size = (int(f) for f in kv.value.split(b" "))
    except ValueError:
        raise StoreError(f"barrier: unreadable barrier record {kv.value[:40]!r}") from None
    return generation, arrived, world_size


def _barrier_value(generation: int, arrived: int, world_size: int) -> bytes:
    return f"{generation} {arrived} {world_size}".encode()


class EtcdSyncPart(EtcdTxnPart):
    """Barrier and queues of :class:`~elasticstore.EtcdStore` (see the module doc)."""

    def barrier(self, key: Key, world_size: int, timeout: Timeout = None) -> int:  # type: ignore[override]
        """Blocks until ``world_size`` participants reached barrier ``key``; returns the
        generation released (0, 1, 2, ...; reusable). See the module doc."""
        n = int(world_size)
        if n < 1:
            raise ValueError("barrier: world_size must be >= 1")
        record = self._sys + b"barrier/" + to_bytes(key)

        def arrive(kv: Any) -> tuple[tuple[Any, ...], tuple[int, bool]]:
            generation, arrived, size = _barrier_state(kv)
            if arrived > 0 and size != n:
                raise StoreError(f"barrier {self._name(record)!r}: world_size mismatch: {n} "
                                 f"given, {size} in progress")
            if arrived + 1 >= n:
                return ("put", _barrier_value(generation + 1, 0, n)), (generation, True)
            return ("put", _barrier_value(generation, arrived + 1, n)), (generation, False)

        (generation, released), _ = self._rmw(record, arrive, "barrier")
        if released:
            return generation
        try:
            self._wait([record], lambda kvs: record in kvs and
                       _barrier_state(kvs[record])[0] > generation,
                       timeout, f"barrier(generation {generation}, {n} participants)")
            return generation
        except StoreTimeoutError:
            def withdraw(kv: Any) -> tuple[tuple[Any, ...] | None, bool]:
                now, arrived, size = _barrier_state(kv)
                if now != generation:
                    return None, True  # released before the withdrawal: passed
                return ("put", _barrier_value(now, max(arrived - 1, 0), size)), False

            if self._rmw(record, withdraw, "barrier withdrawal")[0]:
                return generation
            raise

    # -- presence: a key, or a queue holding items (torch's rule for wait and check) -------------

    def _presence(self, keys: list[Key], deadline: float | None, what: str) -> tuple[list[bool], int]:
        """Whether each name is present, in one snapshot, and that snapshot's revision: two
        counts per name, at most ``MAX_TXN_OPS`` per transaction; the transactions after the
        first read at its revision."""
        pairs = [(self._k(k), self._qkey(k)) for k in keys]
        step, revision, counts = MAX_TXN_OPS // 2, 0, []
        for i in range(0, max(len(pairs), 1), step):
            ops = []
            for key, base in pairs[i:i + step]:
                ops.append(_op_range(key, count_only=True, revision=revision))
                ops.append(_op_range(base, range_end=range_end(base), count_only=True,
                                     revision=revision))
            reply = self._txn(deadline, what, success=ops)
            revision = revision or int(reply.header.revision)
            counts += [r.response_range.count for r in reply.responses]
        present = [counts[2 * i] + counts[2 * i + 1] > 0 for i in range(len(keys))]
        return present, revision

    def _wait_present(self, keys: list[Key], timeout: Timeout, what: str) -> None:
        """Until a snapshot shows every name present; between reads, watches the missing ones
        (key and queue) from the read's revision + 1, and reads again when one appears."""
        timeout = self.timeout if timeout is None else timeout
        deadline, start = deadline_of(timeout), time.monotonic()
        missing: list[Key] = list(keys)
        while True:
            try:
                present, revision = self._presence(keys, deadline, what)
                missing = [k for k, here in zip(keys, present) if not here]
                if not missing:
                    return
                creates = []
                for k in dict.fromkeys(missing):
                    base = self._qkey(k)
                    creates.append(etcdrpc.WatchCreateRequest(key=self._k(k),
                                                              start_revision=revision + 1))
                    creates.append(etcdrpc.WatchCreateRequest(
                        key=base, range_end=range_end(base), start_revision=revision + 1))
                for events in self._stream(creates, deadline):
                    if any(ev.type != DELETE for ev in events):
                        break  # one appeared: read all again
            except (Reread, WatchCompactedError):
                continue
            except StoreTimeoutError:
                secs = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
                raise StoreTimeoutError(
                    f"EtcdStore.{what}: keys {[str(k) for k in missing]} not ready after "
                    f"{time.monotonic() - start:.3f}s (timeout {secs}s)") from None

    # -- queues ----------------------------------------------------------------------------------

    def _qkey(self, key: Key) -> bytes:
        return self._q + to_bytes(key) + b"\x00"

    def queue_push(self, key: Key, value: Value) -> None:  # type: ignore[override]
        """Appends ``value`` (an item key of its own: a retried push cannot duplicate it)."""
        item = self._qkey(key) + uuid.uuid4().hex.encode()
        self._c().kv("Put", etcdrpc.PutRequest(key=item, value=to_bytes(value)),
                     self._op_deadline(), "queue_push")

    def queue_len(self, key: Key) -> int:  # type: ignore[override]
        base = self._qkey(key)
        request = etcdrpc.RangeRequest(key=base, range_end=range_end(base), count_only=True)
        return int(self._c().kv("Range", request, self._op_deadline(), "queue_len").count)

    def queue_pop(self, key: Key, block: bool = True, timeout: Timeout = None) -> bytes:  # type: ignore[override]
        """Pops the oldest value (a transaction deleting the oldest item). Blocking (the
        default) waits up to ``timeout``; otherwise raises ``QueueEmptyError`` at once."""
        base = self._qkey(key)
        timeout = self.timeout if timeout is None else timeout
        deadline, start = deadline_of(timeout), time.monotonic()
        R = etcdrpc.RangeRequest
        while True:
            request = R(key=base, range_end=range_end(base), limit=1,
                        sort_order=R.ASCEND, sort_target=R.CREATE)
            reply = self._c().kv("Range", request, deadline, "queue_pop")
            if reply.kvs:
                popped, _ = self._rmw(reply.kvs[0].key, lambda kv: (
                    (("delete",), kv.value) if kv is not None else (None, _GONE)), "queue_pop")
                if popped is not _GONE:
                    return popped  # type: ignore[no-any-return]
                continue
            if not block:
                raise QueueEmptyError(f"queue {key!r} is empty")
            create = etcdrpc.WatchCreateRequest(key=base, range_end=range_end(base),
                                                start_revision=reply.header.revision + 1)
            try:
                for events in self._stream([create], deadline):
                    if any(ev.type == PUT for ev in events):
                        break
            except (Reread, WatchCompactedError):
                continue
            except StoreTimeoutError:
                raise StoreTimeoutError(
                    f"EtcdStore.queue_pop: queue {key!r} empty after "
                    f"{time.monotonic() - start:.3f}s (timeout {timeout})") from None
