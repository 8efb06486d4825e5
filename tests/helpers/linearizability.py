"""A linearizability checker for histories of single-key register operations (set, get, add,
compare-and-set), after Wing & Gong's search with Lowe's memoization, as in porcupine/Knossos.

A history is a list of :class:`Op`: what was invoked (``kind``, ``args``), what it returned
(``result``), and when it was invoked and completed (monotonic times from one clock). It is
linearizable when some total order of the operations (1) respects real time: an op that completed
before another was invoked comes first, and (2) replayed on a sequential register from "missing"
gives every op the result it got. Linearizability is local (Herlihy & Wing): a multi-key history is
linearizable iff each key's sub-history is, so :func:`check_history` checks key by key.

The search walks the history's call/return events in time order, linearizing a pending call when
the model accepts its result and backtracking at a return whose call could not be placed; a
(set-of-linearized-ops, register-state) pair already explored is not explored again, which keeps
histories of a few hundred concurrent ops cheap.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

State = bytes | None  # the register's value; None: the key is missing
_INT64 = re.compile(rb"-?[0-9]+\Z")


@dataclass(frozen=True)
class Op:
    key: str
    kind: str  # "set" (args: value), "get", "add" (args: delta), "cas" (args: expected, desired)
    args: tuple[Any, ...]
    result: Any  # set: None; get: bytes | None; add: int (or "error"); cas: (swapped, value | None)
    invoke: float
    complete: float


def step(state: State, op: Op) -> tuple[bool, State]:
    """The sequential register: whether ``op`` could return ``op.result`` in ``state``, and the
    state after it."""
    if op.kind == "set":
        return True, op.args[0]
    if op.kind == "get":
        return op.result == state, state
    if op.kind == "add":
        cur = b"0" if state is None else state
        if not _INT64.match(cur):
            return op.result == "error", state
        new = int(cur) + op.args[0]
        return op.result == new, str(new).encode()
    if op.kind == "cas":
        expected, desired = op.args
        swaps = state == expected if state is not None else expected == b""
        after = desired if swaps else state
        return op.result == (swaps, after), after
    raise ValueError(f"unknown operation {op.kind!r}")


class _Entry:
    __slots__ = ("op_id", "is_call", "time", "match", "prev", "next")

    def __init__(self, op_id: int, is_call: bool, time: float) -> None:
        self.op_id = op_id
        self.is_call = is_call
        self.time = time
        self.match: _Entry | None = None  # a call's return
        self.prev: _Entry | None = None
        self.next: _Entry | None = None


def _lift(e: _Entry) -> None:
    """Removes a call and its return from the list."""
    e.prev.next = e.next  # type: ignore[union-attr]
    if e.next is not None:
        e.next.prev = e.prev
    r = e.match
    assert r is not None
    r.prev.next = r.next  # type: ignore[union-attr]
    if r.next is not None:
        r.next.prev = r.prev


def _unlift(e: _Entry) -> None:
    r = e.match
    assert r is not None
    r.prev.next = r  # type: ignore[union-attr]
    if r.next is not None:
        r.next.prev = r
    e.prev.next = e  # type: ignore[union-attr]
    if e.next is not None:
        e.next.prev = e


def check_ops(ops: list[Op], initial: State = None) -> bool:
    """Whether one key's history is linearizable, starting from ``initial``."""
    for op in ops:
        if op.complete < op.invoke:
            raise ValueError(f"{op} completes before it is invoked")
    events: list[_Entry] = []
    for i, op in enumerate(ops):
        call, ret = _Entry(i, True, op.invoke), _Entry(i, False, op.complete)
        call.match = ret
        events += [call, ret]
    # Calls before returns at equal times: such ops count as concurrent (the permissive reading).
    events.sort(key=lambda e: (e.time, 0 if e.is_call else 1))
    head = _Entry(-1, True, float("-inf"))
    prev = head
    for e in events:
        prev.next, e.prev = e, prev
        prev = e

    state: State = initial
    linearized = 0  # bitset of op ids
    seen: set[tuple[int, State]] = set()
    stack: list[tuple[_Entry, State]] = []
    entry = head.next
    while head.next is not None:
        assert entry is not None
        if entry.is_call:
            ok, new_state = step(state, ops[entry.op_id])
            key = (linearized | (1 << entry.op_id), new_state)
            if ok and key not in seen:
                seen.add(key)
                stack.append((entry, state))
                state, linearized = new_state, key[0]
                _lift(entry)
                entry = head.next
            else:
                entry = entry.next
        else:  # a return whose call is not linearized yet: undo the last choice
            if not stack:
                return False
            entry, state = stack.pop()
            linearized &= ~(1 << entry.op_id)
            _unlift(entry)
            entry = entry.next
    return True


def check_history(ops: list[Op]) -> dict[str, bool]:
    """Per key: whether its sub-history is linearizable."""
    by_key: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        by_key[op.key].append(op)
    return {key: check_ops(sub) for key, sub in by_key.items()}
