"""One suite for the Store API, run unchanged against every kind in ``store_kinds.KINDS``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import spawned
import pytest
import store_kinds as sk
import torch.distributed as dist
from paths import HELPERS

SHORT = timedelta(seconds=1)
SLACK = 1.0  # seconds a timeout may overrun


def _wait_for_waiters(opened: sk.Opened, count: int) -> None:
    """When the kind can show it, waits until ``count`` calls are blocked server-side."""
    if opened.server is not None:
        spawned.wait_until(
            lambda: opened.server.stats()["waiters"] >= count, 10, f"{count} server-side waiter(s)"
        )


def _assert_times_out(call: Callable[[], object], seconds: float) -> None:
    start = time.monotonic()
    # torch's own tests and users' code recognise a timeout by the word in the message.
    with pytest.raises(dist.DistStoreError, match="[Tt]imeout"):
        call()
    elapsed = time.monotonic() - start
    assert seconds * 0.9 <= elapsed <= seconds + SLACK, f"timed out after {elapsed:.3f}s"


# -- set / get -----------------------------------------------------------------------------------


def test_set_get_str_and_bytes(opened: sk.Opened) -> None:
    store = opened.store
    store.set("s", "text")
    store.set("b", b"\x00\x01\xff binary")
    store.set("u", "héllo")
    store.set("empty", b"")
    assert store.get("s") == b"text"
    assert store.get("b") == b"\x00\x01\xff binary"
    assert store.get("u") == "héllo".encode()
    assert store.get("empty") == b""
    store.set("s", "overwritten")
    assert store.get("s") == b"overwritten"


def test_large_value(opened: sk.Opened) -> None:
    value = bytes(range(256)) * 4096  # 1 MiB
    opened.store.set("big", value)
    assert opened.store.get("big") == value


def test_get_waits_for_a_key_set_by_another_client(opened: sk.Opened) -> None:
    other = opened.new_client()
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(opened.store.get("later")))
    waiter.start()
    _wait_for_waiters(opened, 1)
    other.set("later", "value")
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert got == [b"value"]


def test_get_timeout_then_usable(opened: sk.Opened) -> None:
    store = opened.store
    store.set_timeout(SHORT)
    assert store.timeout == SHORT
    _assert_times_out(lambda: store.get("missing"), SHORT.total_seconds())
    store.set("after", "ok")
    assert store.get("after") == b"ok"


# -- add ---------------------------------------------------------------------------------------


def test_add(opened: sk.Opened) -> None:
    store = opened.store
    assert store.add("counter", 5) == 5
    assert store.add("counter", -7) == -2
    assert store.add("counter", 0) == -2
    assert store.get("counter") == b"-2"
    store.set("preset", "40")
    assert store.add("preset", 2) == 42
    assert store.add("big", 2**62) == 2**62


def test_add_on_a_non_integer_raises(opened: sk.Opened) -> None:
    opened.require(sk.ADD_WRONG_TYPE)
    store = opened.store
    store.set("text", "abc")
    with pytest.raises((dist.DistStoreError, ValueError)):
        store.add("text", 1)
    assert store.get("text") == b"abc"


# Refused by the native server's rule (an optional '-' and ASCII digits, nothing else: what
# std::from_chars accepts); Python's int() and torch's std::stoll accept several of them.
NOT_DECIMAL = [" 7 ", "7 ", " 7", "+7", "1_000", "", "-", "0x10", "1e3", "7\n", "\u0663"]
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)


def test_add_refuses_a_value_that_is_not_strict_decimal(opened: sk.Opened) -> None:
    opened.require(sk.ADD_WRONG_TYPE)
    opened.require(sk.STRICT_ADD)
    store = opened.store
    for i, raw in enumerate(NOT_DECIMAL):
        store.set(f"loose{i}", raw)
        with pytest.raises(dist.DistStoreError):
            store.add(f"loose{i}", 1)
        assert store.get(f"loose{i}") == raw.encode(), f"{raw!r} was overwritten"
    store.set("zeros", "007")
    assert store.add("zeros", 1) == 8
    store.set("negzero", "-0")
    assert store.add("negzero", 1) == 1


def test_add_stays_within_int64(opened: sk.Opened) -> None:
    opened.require(sk.ADD_WRONG_TYPE)
    opened.require(sk.STRICT_ADD)
    store = opened.store
    store.set("max", str(INT64_MAX))
    with pytest.raises(dist.DistStoreError):
        store.add("max", 1)
    assert store.get("max") == str(INT64_MAX).encode()
    assert store.add("max", -1) == INT64_MAX - 1
    store.set("min", str(INT64_MIN))
    with pytest.raises(dist.DistStoreError):
        store.add("min", -1)
    assert store.add("min", 0) == INT64_MIN
    store.set("past", str(INT64_MAX + 1))  # not an int64 even before adding
    with pytest.raises(dist.DistStoreError):
        store.add("past", 0)
    assert store.add("sum", 2**62) == 2**62
    with pytest.raises(dist.DistStoreError):
        store.add("sum", 2**62)  # 2**63 overflows
    with pytest.raises(TypeError):  # not an int64 amount (pybind11's TypeError, for all kinds)
        store.add("sum", 2**63)
    assert store.get("sum") == str(2**62).encode()


def test_counter_threads_each_with_own_client(opened: sk.Opened) -> None:
    clients = [opened.new_client() for _ in range(4)]
    results: list[list[int]] = [[] for _ in clients]

    def run(i: int) -> None:
        results[i] = [clients[i].add("tc", 1) for _ in range(100)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert sorted(v for r in results for v in r) == list(range(1, 401))
    assert opened.store.get("tc") == b"400"


# -- compare_set -------------------------------------------------------------------------------


def test_compare_set(opened: sk.Opened) -> None:
    store = opened.store
    # Missing key, non-empty expected: nothing set; torch's stores return `expected`.
    assert store.compare_set("cas", "nope", "x") == b"nope"
    assert not store.check(["cas"])
    # Missing key, empty expected: created.
    assert store.compare_set("cas", "", "first") == b"first"
    assert store.get("cas") == b"first"
    # Match: swapped, returns the new value.
    assert store.compare_set("cas", "first", "second") == b"second"
    # Mismatch: unchanged, returns the current value.
    assert store.compare_set("cas", "first", "third") == b"second"
    assert store.get("cas") == b"second"
    assert store.compare_set("cas", b"second", b"\x00bin") == b"\x00bin"


# -- wait / check ------------------------------------------------------------------------------


def test_wait_and_check(opened: sk.Opened) -> None:
    store = opened.store
    store.set("w1", "1")
    store.set("w2", "2")
    store.wait(["w1", "w2"])
    store.wait(["w1"], timedelta(seconds=5))
    assert store.check(["w1", "w2"])
    assert not store.check(["w1", "absent"])
    assert store.check([])


def test_wait_timeout_then_usable(opened: sk.Opened) -> None:
    store = opened.store
    store.set("present", "1")
    _assert_times_out(lambda: store.wait(["present", "absent"], SHORT), SHORT.total_seconds())
    store.set_timeout(SHORT)
    _assert_times_out(lambda: store.wait(["absent"]), SHORT.total_seconds())
    store.set("absent", "now")
    store.wait(["present", "absent"])


WAKERS: dict[str, Callable[[dist.Store, str], object]] = {
    "set": lambda s, k: s.set(k, "v"),
    "add": lambda s, k: s.add(k, 1),
    "compare_set": lambda s, k: s.compare_set(k, "", "v"),
    "append": lambda s, k: s.append(k, "v"),
    "multi_set": lambda s, k: s.multi_set([k], ["v"]),
}


@pytest.mark.parametrize("op", sorted(WAKERS))
def test_waiter_woken_by(opened: sk.Opened, op: str) -> None:
    if op == "add":
        opened.require(sk.WAKE_BY_ADD)
    other = opened.new_client()
    done = threading.Event()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            opened.store.wait(["wake", "already"], timedelta(seconds=20))
            done.set()
        except BaseException as exc:  # reported below
            errors.append(exc)

    opened.store.set("already", "1")
    waiter = threading.Thread(target=wait)
    waiter.start()
    _wait_for_waiters(opened, 1)
    assert not done.is_set()
    WAKERS[op](other, "wake")
    assert done.wait(timeout=10), f"wait() not woken by {op}"
    waiter.join(timeout=10)
    assert not errors


# -- keys ----------------------------------------------------------------------------------------


def test_num_keys_and_delete_key(opened: sk.Opened) -> None:
    store = opened.store
    base = store.num_keys()  # some stores hold keys of their own: compare differences
    store.set("d1", "1")
    store.set("d2", "2")
    assert store.num_keys() == base + 2
    assert store.delete_key("d1") is True
    assert store.delete_key("d1") is False
    assert store.num_keys() == base + 1
    assert not store.check(["d1"])
    store.set_timeout(SHORT)
    _assert_times_out(lambda: store.get("d1"), SHORT.total_seconds())


def test_list_keys(opened: sk.Opened) -> None:
    opened.require(sk.LIST_KEYS)
    store = opened.store
    store.set("lk/a", "1")
    store.set("lk/b", "2")
    keys = store.list_keys()
    assert {"lk/a", "lk/b"} <= set(keys)
    store.delete_key("lk/a")
    assert "lk/a" not in store.list_keys()


def test_append(opened: sk.Opened) -> None:
    store = opened.store
    store.append("ap", "po")
    store.append("ap", b"ta")
    store.append("ap", "to")
    assert store.get("ap") == b"potato"


def test_multi_set_and_multi_get(opened: sk.Opened) -> None:
    store = opened.store
    store.multi_set(["m1", "m2", "m3"], ["a", b"\x00b", ""])
    assert store.multi_get(["m3", "m1", "m2"]) == [b"", b"a", b"\x00b"]
    assert store.multi_get([]) == []


def test_multi_get_timeout_then_usable(opened: sk.Opened) -> None:
    store = opened.store
    store.set("mg", "1")
    store.set_timeout(SHORT)
    _assert_times_out(lambda: store.multi_get(["mg", "mg-missing"]), SHORT.total_seconds())
    assert store.multi_get(["mg"]) == [b"1"]


def test_has_extended_api(opened: sk.Opened) -> None:
    assert opened.store.has_extended_api() is True


def test_clone(opened: sk.Opened) -> None:
    store = opened.store
    clone = store.clone()
    store.set("cl", "1")
    assert clone.get("cl") == b"1"
    clone.set("cl2", "2")
    assert store.get("cl2") == b"2"
    # A clone blocking in one thread does not hold up the original.
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(clone.get("cl3")))
    waiter.start()
    _wait_for_waiters(opened, 1)
    assert store.add("cl-counter", 1) == 1
    store.set("cl3", "3")
    waiter.join(timeout=10)
    assert got == [b"3"]


# -- queues and barrier --------------------------------------------------------------------------


def test_queue(opened: sk.Opened) -> None:
    opened.require(sk.QUEUES)
    store = opened.store
    assert store.queue_len("q") == 0
    store.queue_push("q", "a")
    store.queue_push("q", b"b")
    assert store.queue_len("q") == 2
    assert store.queue_pop("q") == b"a"
    assert store.queue_pop("q", block=False) == b"b"
    with pytest.raises(dist.QueueEmptyError):
        store.queue_pop("q", block=False)
    store.set_timeout(SHORT)
    _assert_times_out(lambda: store.queue_pop("q"), SHORT.total_seconds())
    store.queue_push("q", "c")
    assert store.queue_pop("q") == b"c"


def test_check_counts_a_non_empty_queue(opened: sk.Opened) -> None:
    """torch's stores count a queue with items as a key: check() is true for it, and false
    again once it is drained."""
    opened.require(sk.QUEUES)
    store = opened.store
    assert not store.check(["cq"])
    store.queue_push("cq", "item")
    assert store.check(["cq"])
    store.set("plain", "1")
    assert store.check(["cq", "plain"])
    assert store.queue_pop("cq") == b"item"
    assert not store.check(["cq"])


def test_a_non_empty_queue_is_a_key_for_wait_and_check(opened: sk.Opened) -> None:
    """torch's stores (TCPStore, HashStore) treat a queue with items as a key for wait() and
    check(); it holds no value, so the key count and delete_key() leave it out."""
    opened.require(sk.QUEUES)
    store = opened.store
    store.set_timeout(SHORT)
    base = store.num_keys()
    store.queue_push("foo", "1")
    store.queue_push("foo", "2")
    assert store.check(["foo"])
    store.wait(["foo"])
    store.wait(["foo"], SHORT)
    store.set("plain", "p")
    store.wait(["foo", "plain"], SHORT)
    assert store.num_keys() == base + 1  # "plain" only
    assert store.delete_key("foo") is False  # no value under that name: the queue stays
    assert store.queue_len("foo") == 2
    assert store.check(["foo"])
    assert store.queue_pop("foo") == b"1"
    assert store.queue_pop("foo") == b"2"
    assert not store.check(["foo"])
    _assert_times_out(lambda: store.wait(["foo"], SHORT), SHORT.total_seconds())
    store.set("foo", "value")  # a value and a queue share the name, each untouched by the other
    store.queue_push("foo", "3")
    assert store.get("foo") == b"value"
    assert store.delete_key("foo") is True
    assert store.queue_len("foo") == 1
    store.wait(["foo"], SHORT)


def test_wait_and_check_on_many_keys(opened: sk.Opened) -> None:
    """More names than etcd takes in one transaction (128 operations), queues among them."""
    store = opened.store
    keys = [f"many{i}" for i in range(150)]
    for key in keys:
        store.set(key, "1")
    store.wait(keys, timedelta(seconds=10))
    assert store.check(keys)
    assert not store.check([*keys, "many-missing"])
    if sk.QUEUES not in opened.kind.lacks:
        store.queue_push("many-queue", "item")
        store.wait([*keys, "many-queue"], timedelta(seconds=10))
        assert store.check(["many-queue", *keys])


def test_get_of_a_name_only_a_queue_holds(opened: sk.Opened) -> None:
    """A queue holds no value: get() waits for one (HashStore, elasticstore.Store, EtcdStore).
    torch's TCPStore client sends WAIT (which the queue satisfies) and then GET, answered with
    an empty value by torch's server, and by ours on that protocol."""
    opened.require(sk.QUEUES)
    store = opened.store
    store.set_timeout(SHORT)
    store.queue_push("gq", "item")
    if sk.GET_WAITS_FOR_A_VALUE in opened.kind.lacks:
        assert store.get("gq") == b""
        assert store.multi_get(["gq"]) == [b""]
    else:
        _assert_times_out(lambda: store.get("gq"), SHORT.total_seconds())
        _assert_times_out(lambda: store.multi_get(["gq"]), SHORT.total_seconds())
    assert store.queue_pop("gq", block=False) == b"item"  # the connection is still usable
    store.set("gq", "v")
    assert store.get("gq") == b"v"


def test_wait_woken_by_queue_push(opened: sk.Opened) -> None:
    opened.require(sk.QUEUES)
    other = opened.new_client()
    done: list[bool] = []
    waiter = threading.Thread(
        target=lambda: done.append(opened.store.wait(["wk"], timedelta(seconds=10)) is None))
    waiter.start()
    _wait_for_waiters(opened, 1)
    other.queue_push("wk", "pushed")
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert done == [True]


def test_queue_pop_woken_by_push(opened: sk.Opened) -> None:
    opened.require(sk.QUEUES)
    other = opened.new_client()
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(opened.store.queue_pop("wq")))
    waiter.start()
    _wait_for_waiters(opened, 1)
    other.queue_push("wq", "pushed")
    waiter.join(timeout=10)
    assert got == [b"pushed"]


def test_queue_empty_error_on_a_torch_without_its_own(opened: sk.Opened) -> None:
    """torch < 2.8 has no ``dist.QueueEmptyError``: our stores still raise a DistStoreError of
    that name for a non-blocking pop of an empty queue (in a process where torch lacks it)."""
    if opened.kind.name not in ("elasticstore", "etcd"):
        pytest.skip("only elasticstore's own Python code raises it")
    code = (
        "import json, sys\n"
        "import torch.distributed as dist\n"
        "del dist.QueueEmptyError  # as on torch < 2.8\n"
        f"sys.path.insert(0, {HELPERS!r})\n"
        "import store_kinds\n"
        "store = store_kinds.connect(json.loads(sys.argv[1]))\n"
        "try:\n"
        "    store.queue_pop('empty', block=False)\n"
        "except dist.DistStoreError as exc:\n"
        "    print(type(exc).__name__, hasattr(dist, 'QueueEmptyError'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(opened.spec)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["QueueEmptyError", "False"], out.stderr[-2000:]


def test_barrier_threads(opened: sk.Opened) -> None:
    opened.require(sk.BARRIER)
    clients = [opened.store] + [opened.new_client() for _ in range(2)]
    passed: list[int] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        clients[i].barrier("bar", len(clients), timedelta(seconds=20))
        with lock:
            passed.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(clients))]
    for t in threads:
        t.start()
    _wait_for_waiters(opened, 2)
    assert passed == []
    run(0)
    for t in threads:
        t.join(timeout=10)
    assert sorted(passed) == [0, 1, 2]


def test_barrier_withdraws_an_arrival_that_timed_out(opened: sk.Opened) -> None:
    """A participant that timed out is no longer counted: a lone retry is not released with
    it (the native server withdraws a timed-out waiter), and two live participants are."""
    opened.require(sk.BARRIER_WITHDRAWS)
    store, other = opened.store, opened.new_client()
    short = timedelta(seconds=0.5)
    _assert_times_out(lambda: store.barrier("wd", 2, short), short.total_seconds())
    _assert_times_out(lambda: other.barrier("wd", 2, short), short.total_seconds())
    generations: list[int] = []
    waiter = threading.Thread(
        target=lambda: generations.append(other.barrier("wd", 2, timedelta(seconds=20))))
    waiter.start()
    _wait_for_waiters(opened, 1)
    generations.append(store.barrier("wd", 2, timedelta(seconds=20)))
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert generations == [0, 0]  # the first generation released, for both
    assert store.barrier("wd", 1) == 1  # reusable: the next generation


# -- other processes -----------------------------------------------------------------------------


@pytest.mark.slow
def test_counter_contention_across_processes(opened: sk.Opened) -> None:
    opened.require(sk.MULTIPROCESS)
    n, m = 4, 200
    children = [spawned.spawn("adds", opened.spec, "contended", m, "go") for _ in range(n)]
    opened.store.set("go", "1")
    results = spawned.join(children, timeout=120)
    assert opened.store.get("contended") == str(n * m).encode()
    # Every add saw a distinct value: each increment was applied exactly once.
    assert sorted(v for r in results for v in r) == list(range(1, n * m + 1))


@pytest.mark.slow
def test_get_and_wait_in_another_process_woken(opened: sk.Opened) -> None:
    opened.require(sk.MULTIPROCESS)
    store = opened.store
    child = spawned.spawn("blocked_then_report", opened.spec)
    try:
        store.wait(["ready/get"], timedelta(seconds=60))
        _wait_for_waiters(opened, 1)
        store.set("xkey", "from-parent")
        assert store.get("report/get") == b"from-parent"
        store.wait(["ready/wait"])
        _wait_for_waiters(opened, 1)
        store.add("ykey", 1)
        assert store.get("report/wait") == b"woken"
    finally:
        results = spawned.join([child], timeout=60)
    assert results == [["from-parent", "woken"]]
