"""A hypothesis state machine drives a real server (``elasticstore._C.Server``) through the native
client (``elasticstore.Store``, several connections) and compares every answer with a plain Python
model of the store: values, counters, compare-and-set, queues, deletes, session-bound (ephemeral)
keys deleted when their connection closes, and the revision every change is stamped with (checked
through ``stats()`` and ``watch``)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import timedelta

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)
from torch.distributed import QueueEmptyError  # noqa: E402

from elasticstore import Store, StoreError, _C  # noqa: E402

KEYS = st.sampled_from(["a", "b", "c", "n", "p/x", "p/y"])
QUEUES = st.sampled_from(["q1", "q2"])
VALUES = st.binary(max_size=6) | st.sampled_from([b"0", b"-3", b"12", b"x"])
CLIENTS = st.integers(0, 2)  # 2 is the connection that reconnects (ephemeral keys die with it)
INT64 = re.compile(rb"-?[0-9]+\Z")
TIMEOUT = timedelta(seconds=10)


@dataclass
class Event:
    revision: int
    kind: str
    key: str
    value: bytes


@dataclass
class Model:
    values: dict[str, bytes] = field(default_factory=dict)
    owner: dict[str, int] = field(default_factory=dict)  # key -> client session bound to it
    queues: dict[str, list[bytes]] = field(default_factory=dict)
    history: list[Event] = field(default_factory=list)
    revision: int = 0

    def record(self, kind: str, key: str, value: bytes = b"") -> None:
        self.revision += 1
        self.history.append(Event(self.revision, kind, key, value))

    def set(self, key: str, value: bytes, owner: int | None) -> None:
        self.values[key] = value
        if owner is None:
            self.owner.pop(key, None)
        else:
            self.owner[key] = owner
        self.record("set", key, value)

    def delete(self, key: str) -> bool:
        if key not in self.values:
            return False
        del self.values[key]
        self.owner.pop(key, None)
        self.record("delete", key)
        return True


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.server = _C.Server("127.0.0.1", 0, log_level="off")
        self.server.start()
        self.clients = [self._connect() for _ in range(3)]
        self.model = Model()

    def _connect(self) -> Store:
        return Store("127.0.0.1", self.server.port, timeout=TIMEOUT)

    def teardown(self) -> None:
        for c in self.clients:
            c.close()
        self.server.stop()

    # ---- values ----
    @rule(c=CLIENTS, key=KEYS, value=VALUES, ephemeral=st.booleans())
    def set(self, c: int, key: str, value: bytes, ephemeral: bool) -> None:
        self.clients[c].set(key, value, ephemeral=ephemeral)
        self.model.set(key, value, c if ephemeral else None)

    @rule(c=CLIENTS, key=KEYS)
    def try_get(self, c: int, key: str) -> None:
        assert self.clients[c].try_get(key) == self.model.values.get(key)

    @rule(c=CLIENTS, key=KEYS, delta=st.integers(-5, 5))
    def add(self, c: int, key: str, delta: int) -> None:
        cur = self.model.values.get(key, b"0")
        if not INT64.match(cur):
            with pytest.raises(StoreError):
                self.clients[c].add(key, delta)
            return
        new = int(cur) + delta
        assert self.clients[c].add(key, delta) == new
        self.model.values[key] = str(new).encode()  # ADD keeps the key's binding
        self.model.record("set", key, str(new).encode())

    @rule(c=CLIENTS, key=KEYS, expected=VALUES, desired=VALUES, use_current=st.booleans(),
          ephemeral=st.booleans())
    def compare_set(self, c: int, key: str, expected: bytes, desired: bytes, use_current: bool,
                    ephemeral: bool) -> None:
        if use_current:
            expected = self.model.values.get(key, b"")
        swapped, value = self.clients[c].compare_set_ex(key, expected, desired, ephemeral=ephemeral)
        cur = self.model.values.get(key)
        swaps = cur == expected if cur is not None else expected == b""
        assert swapped == swaps
        if swaps:
            self.model.set(key, desired, c if ephemeral else None)
        assert value == self.model.values.get(key)

    @rule(c=CLIENTS, key=KEYS, value=VALUES)
    def append(self, c: int, key: str, value: bytes) -> None:
        self.clients[c].append(key, value)
        new = self.model.values.get(key, b"") + value
        self.model.values[key] = new  # APPEND keeps the key's binding
        self.model.record("set", key, new)

    @rule(c=CLIENTS, keys=st.lists(KEYS, min_size=1, max_size=3, unique=True), value=VALUES)
    def multi_set(self, c: int, keys: list[str], value: bytes) -> None:
        self.clients[c].multi_set(keys, [value] * len(keys))
        for k in keys:
            self.model.set(k, value, None)

    @rule(c=CLIENTS, key=KEYS)
    def delete(self, c: int, key: str) -> None:
        assert self.clients[c].delete_key(key) == self.model.delete(key)

    @rule(c=CLIENTS, prefix=st.sampled_from(["", "p/", "a", "z"]))
    def list_keys(self, c: int, prefix: str) -> None:
        assert self.clients[c].list_keys(prefix) == sorted(
            k for k in self.model.values if k.startswith(prefix)
        )

    # ---- queues ----
    @rule(c=CLIENTS, queue=QUEUES, value=VALUES)
    def queue_push(self, c: int, queue: str, value: bytes) -> None:
        self.clients[c].queue_push(queue, value)
        self.model.queues.setdefault(queue, []).append(value)

    @rule(c=CLIENTS, queue=QUEUES)
    def queue_pop(self, c: int, queue: str) -> None:
        items = self.model.queues.get(queue, [])
        if not items:
            with pytest.raises(QueueEmptyError):
                self.clients[c].queue_pop(queue, block=False)
            return
        assert self.clients[c].queue_pop(queue, block=False) == items.pop(0)

    @rule(c=CLIENTS, queue=QUEUES)
    def queue_len(self, c: int, queue: str) -> None:
        assert self.clients[c].queue_len(queue) == len(self.model.queues.get(queue, []))

    # ---- sessions ----
    @rule()
    def reconnect(self) -> None:
        """Client 2's connection closes: every key still bound to it is deleted (a DELETE each)."""
        self.clients[2].close()
        for key in sorted(k for k, o in self.model.owner.items() if o == 2):
            self.model.delete(key)
        self.clients[2] = self._connect()
        deadline = time.monotonic() + 10
        while self.clients[0].stats()["revision"] != self.model.revision:
            assert time.monotonic() < deadline, "the closed session's keys were not deleted"
            time.sleep(0.005)

    # ---- watch ----
    @precondition(lambda self: self.model.history)
    @rule(c=CLIENTS, data=st.data())
    def watch(self, c: int, data: st.DataObject) -> None:
        ev = data.draw(st.sampled_from(self.model.history))
        after = data.draw(st.integers(0, ev.revision - 1))
        want = next(e for e in self.model.history if e.revision > after and e.key == ev.key)
        got = self.clients[c].watch(ev.key, after_version=after, timeout=TIMEOUT)
        assert (got.kind, got.key, got.version) == (want.kind, want.key, want.revision)
        if want.kind == "set":
            assert got.value == want.value

    # ---- invariants ----
    @invariant()
    def revision_and_counts(self) -> None:
        stats = self.clients[0].stats()
        assert stats["revision"] == self.model.revision
        assert stats["keys"] == len(self.model.values) == self.clients[1].num_keys()
        assert stats["queues"] == sum(1 for q in self.model.queues.values() if q)


StoreMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, print_blob=True
)
test_store_matches_model = StoreMachine.TestCase
