"""Concurrent clients (threads, each with its own connection) doing set/get/add/compare-and-set on
a few keys of a real server; the history, with invoke/complete times, must be linearizable. The
checker is tested first on histories known to be (and not to be) linearizable, so it can fail."""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta

import pytest
from linearizability import Op, check_history, check_ops

from elasticstore import Store, StoreError, _C


def op(kind: str, args: tuple, result: object, t0: float, t1: float, key: str = "k") -> Op:
    return Op(key, kind, args, result, t0, t1)


# ---- the checker on known histories ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "history"),
    [
        ("read of a value never written", [op("get", (), b"9", 0, 1)]),
        ("read of nothing after a completed write",
         [op("set", (b"1",), None, 0, 10), op("get", (), None, 20, 30)]),
        ("stale read", [op("set", (b"1",), None, 0, 10), op("set", (b"2",), None, 20, 30),
                        op("get", (), b"1", 40, 50)]),
        ("new then old value while the write is pending",
         [op("set", (b"1",), None, 0, 100), op("get", (), b"1", 10, 20),
          op("get", (), None, 30, 40)]),
        ("two adds returning the same total",
         [op("add", (1,), 1, 0, 10), op("add", (1,), 1, 5, 15)]),
        ("two swaps from the same expected value",
         [op("set", (b"0",), None, 0, 1), op("cas", (b"0", b"1"), (True, b"1"), 2, 10),
          op("cas", (b"0", b"2"), (True, b"2"), 3, 11)]),
        ("a lost update", [op("add", (1,), 1, 0, 10), op("add", (1,), 2, 20, 30),
                           op("get", (), b"1", 40, 50)]),
    ],
)
def test_checker_rejects_non_linearizable(name: str, history: list[Op]) -> None:
    assert not check_ops(history), name


@pytest.mark.parametrize(
    ("name", "history"),
    [
        ("empty", []),
        ("overlapping write and read of either value",
         [op("set", (b"1",), None, 0, 100), op("get", (), None, 10, 20),
          op("get", (), b"1", 30, 40)]),
        ("concurrent adds in either order",
         [op("add", (1,), 2, 0, 10), op("add", (1,), 1, 5, 15), op("get", (), b"2", 20, 30)]),
        ("one of two concurrent swaps wins",
         [op("cas", (b"", b"a"), (False, b"b"), 0, 10), op("cas", (b"", b"b"), (True, b"b"), 0, 10)]),
        ("add on text is an error", [op("set", (b"x",), None, 0, 1), op("add", (1,), "error", 2, 3)]),
    ],
)
def test_checker_accepts_linearizable(name: str, history: list[Op]) -> None:
    assert check_ops(history), name


def test_checker_search_is_bounded_on_wide_concurrency() -> None:
    # 14 fully concurrent adds with distinct results: 14! orders, memoization keeps it small.
    ops = [op("add", (1,), i + 1, 0, 100) for i in range(14)]
    t0 = time.monotonic()
    assert check_ops(ops)
    assert not check_ops([*ops, op("get", (), b"3", 200, 300)])
    assert time.monotonic() - t0 < 20


# ---- a real server ----------------------------------------------------------------------------------
KEYS = ["x", "y", "z"]


def _client(port: int, seed: int, n_ops: int, out: list[Op], errors: list[BaseException]) -> None:
    rng = random.Random(seed)
    try:
        with Store("127.0.0.1", port, timeout=timedelta(seconds=30)) as store:
            for _ in range(n_ops):
                key = rng.choice(KEYS)
                kind = rng.choice(["set", "get", "get", "add", "cas"])
                if kind == "set":
                    args: tuple = (str(rng.randint(0, 5)).encode(),)
                elif kind == "add":
                    args = (rng.randint(1, 3),)
                elif kind == "cas":
                    args = (rng.choice([b"", b"0", b"1", b"2", b"3"]), str(rng.randint(0, 5)).encode())
                else:
                    args = ()
                t0 = time.monotonic_ns()
                if kind == "set":
                    result: object = store.set(key, args[0])
                elif kind == "get":
                    result = store.try_get(key)
                elif kind == "add":
                    try:
                        result = store.add(key, args[0])
                    except StoreError:
                        result = "error"
                else:
                    result = tuple(store.compare_set_ex(key, *args))
                out.append(Op(key, kind, args, result, t0, time.monotonic_ns()))
    except BaseException as e:  # noqa: BLE001 (reported by the test)
        errors.append(e)


@pytest.mark.parametrize("round_", range(6))
def test_concurrent_history_is_linearizable(round_: int) -> None:
    server = _C.Server("127.0.0.1", 0, log_level="off")
    server.start()
    try:
        histories: list[list[Op]] = [[] for _ in range(8)]
        errors: list[BaseException] = []
        threads = [
            threading.Thread(target=_client, args=(server.port, 1000 * round_ + i, 250, h, errors))
            for i, h in enumerate(histories)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        ops = [o for h in histories for o in h]
        assert len(ops) == 8 * 250
        # The clients really overlapped (else the check would be trivial).
        by_time = sorted(ops, key=lambda o: o.invoke)
        overlaps = sum(1 for a, b in zip(by_time, by_time[1:]) if b.invoke < a.complete)
        assert overlaps > len(ops) // 10, overlaps
        verdict = check_history(ops)
        assert verdict == {k: True for k in verdict}, verdict
        # The same history with one read changed to a value never written must fail.
        i = next(i for i, o in enumerate(ops) if o.kind == "get")
        bad = ops[i]
        ops[i] = Op(bad.key, "get", (), b"never", bad.invoke, bad.complete)
        assert not check_history(ops)[bad.key]
    finally:
        server.stop()
