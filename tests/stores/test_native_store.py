"""Behaviour only elasticstore has: one-round-trip get, compare_set's result, server barrier,
watch, session-bound keys, queues, errors, keep-alive."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from datetime import timedelta

import spawned
import pytest
import torch.distributed as dist

import elasticstore
from elasticstore import (
    Store,
    StoreError,
    StoreNetworkError,
    StoreServer,
    StoreTimeoutError,
    WatchCompactedError,
    WatchEvent,
)
from elasticstore.stores import keepalive

SHORT = timedelta(seconds=1)
SLACK = 1.0


def _spec(server: StoreServer) -> dict[str, object]:
    return {"kind": "elasticstore", "host": server.host, "port": server.port, "timeout": 60.0}


# -- round trips and results ---------------------------------------------------------------------


def test_get_is_one_round_trip(server: StoreServer, store: Store) -> None:
    store.set("k", "v")
    stats = server.stats()
    if "requests" not in stats:
        pytest.fail(
            "C++ side: server.stats() has no 'requests' counter, so one round trip per get "
            f"cannot be asserted (stats: {sorted(stats)})"
        )
    before = stats["requests"]
    for _ in range(10):
        assert store.get("k") == b"v"
    assert server.stats()["requests"] - before == 10


def test_timeout_error_names_keys_and_time(store: Store) -> None:
    store.set_timeout(SHORT)
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        store.get("the-missing-key")
    assert time.monotonic() - start <= SHORT.total_seconds() + SLACK
    message = str(info.value)
    assert "the-missing-key" in message
    assert any(t in message for t in ("1.0", "1 s", "1s", "1000")), message
    with pytest.raises(StoreTimeoutError) as info:
        store.wait(["w-one", "w-two"], timedelta(milliseconds=200))
    assert "w-one" in str(info.value) and "w-two" in str(info.value)
    assert isinstance(info.value, dist.DistStoreError)
    store.set("after", "1")
    assert store.get("after") == b"1"


def test_compare_set_ex(store: Store) -> None:
    assert store.compare_set_ex("c", "x", "y") == (False, None)
    assert store.compare_set_ex("c", "", "a") == (True, b"a")
    assert store.compare_set_ex("c", "a", "b") == (True, b"b")
    assert store.compare_set_ex("c", "a", "z") == (False, b"b")
    assert store.compare_set("c", "b", "d") == b"d"


def test_try_get(store: Store) -> None:
    assert store.try_get("t") is None
    store.set("t", b"\x00v")
    assert store.try_get("t") == b"\x00v"


def test_torch_cxx_names_and_list_keys(store: Store) -> None:
    store.set("ls/b", "1")
    store.set("ls/a", "1")
    store.set("other", "1")
    assert store.getNumKeys() == store.num_keys() == 3
    assert store.list_keys("ls/") == ["ls/a", "ls/b"]
    assert store.list_keys() == ["ls/a", "ls/b", "other"]
    assert store.deleteKey("other") is True
    assert store.delete_key("other") is False
    assert store.has_extended_api() is True


def test_bytes_keys(store: Store) -> None:
    store.set(b"bk", "1")
    assert store.get("bk") == b"1"


def test_wrong_type_and_too_large_keep_the_connection(store: Store) -> None:
    store.set("text", "abc")
    with pytest.raises(StoreError):
        store.add("text", 1)
    with pytest.raises(StoreError):
        store.set("k" * (elasticstore._C.MAX_KEY_BYTES + 1), "v")
    assert store.add("n", 1) == 1
    assert store.get("text") == b"abc"


def test_threads_share_one_store(store: Store) -> None:
    results: list[int] = []
    lock = threading.Lock()

    def run() -> None:
        mine = [store.add("shared", 1) for _ in range(100)]
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == list(range(1, 401))


# -- barrier -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_barrier_reused_across_generations_by_processes(server: StoreServer, store: Store) -> None:
    world, rounds = 3, 5
    children = [spawned.spawn("barrier_rounds", _spec(server), "gen", world, rounds) for _ in range(2)]
    mine = [store.barrier("gen", world, timedelta(seconds=60)) for _ in range(rounds)]
    results = spawned.join(children, timeout=90)
    assert mine == list(range(rounds))
    assert results == [list(range(rounds))] * 2


def test_barrier_timeout_withdraws(store: Store) -> None:
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError):
        store.barrier("lonely", 2, timedelta(milliseconds=300))
    assert time.monotonic() - start <= 0.3 + SLACK
    other = store.clone()
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(other.barrier("lonely", 2, SHORT * 10)))
    t.start()
    # The timed-out participant was withdrawn: two new arrivals complete generation 0.
    assert store.barrier("lonely", 2, SHORT * 10) == 0
    t.join(timeout=10)
    assert got == [0]


def test_barrier_world_size_mismatch(store: Store) -> None:
    other = store.clone()
    t = threading.Thread(
        target=lambda: pytest.raises(StoreTimeoutError, other.barrier, "mm", 3, SHORT)
    )
    t.start()
    try:
        spawned.wait_until(lambda: store.stats()["waiters"] >= 1, 10, "the first participant")
        with pytest.raises(StoreError):
            store.barrier("mm", 2, SHORT)
    finally:
        t.join(timeout=10)


# -- watch ---------------------------------------------------------------------------------------


def test_watch_history_and_timeout(store: Store) -> None:
    start_rev = store.stats()["revision"]
    store.set("wk", "1")
    store.set("wk", "2")
    store.delete_key("wk")
    first = store.watch("wk", after_version=start_rev, timeout=SHORT)
    assert first == WatchEvent("set", "wk", b"1", first.version)
    second = store.watch("wk", after_version=first.version, timeout=SHORT)
    assert (second.kind, second.value) == ("set", b"2")
    third = store.watch("wk", after_version=second.version, timeout=SHORT)
    assert (third.kind, third.key) == ("delete", "wk")
    begin = time.monotonic()
    with pytest.raises(StoreTimeoutError):
        store.watch("wk", after_version=third.version, timeout=timedelta(milliseconds=300))
    assert time.monotonic() - begin <= 0.3 + SLACK


def test_watch_from_now_woken_by_another_client(store: Store) -> None:
    other = store.clone()
    got: list[WatchEvent] = []
    t = threading.Thread(target=lambda: got.append(store.watch("live", timeout=SHORT * 20)))
    t.start()
    spawned.wait_until(lambda: other.stats()["waiters"] >= 1, 10, "the watcher")
    other.set("live", "x")
    t.join(timeout=10)
    assert [(e.kind, e.key, e.value) for e in got] == [("set", "live", b"x")]


@pytest.mark.slow
def test_watch_sees_every_change_of_a_key_and_prefix_in_order(
    server: StoreServer, store: Store
) -> None:
    n = 100
    start = store.stats()["revision"]
    children = [
        spawned.spawn("set_keys", _spec(server), "wkey", n, "go"),
        spawned.spawn("set_prefixed", _spec(server), "wpre", n, "go"),
    ]
    try:
        store.set("go", "1")
        seen_key, seen_prefix = [], []
        last = start
        for _ in range(n):
            event = store.watch("wkey", after_version=last, timeout=timedelta(seconds=60))
            assert event.kind == "set" and event.key == "wkey"
            seen_key.append(event.value)
            last = event.version
        last = start
        for _ in range(n):
            event = store.watch("wpre/", after_version=last, timeout=SHORT * 60, prefix=True)
            seen_prefix.append((event.key, event.value))
            last = event.version
    finally:
        spawned.join(children, timeout=60)
    assert seen_key == [str(i).encode() for i in range(n)]
    assert seen_prefix == [(f"wpre/{i}", str(i).encode()) for i in range(n)]


def test_watch_compacted(store: Store) -> None:
    start = store.stats()["revision"]
    n = elasticstore._C.MAX_KEYS_PER_REQUEST
    keys = [f"c/{i}" for i in range(min(n, 70_000))]
    store.multi_set(keys, ["x"] * len(keys))  # one change per key: overflows the history
    with pytest.raises(WatchCompactedError) as info:
        store.watch("c/", after_version=start, timeout=SHORT, prefix=True)
    oldest = info.value.oldest_revision
    assert start < oldest <= store.stats()["revision"]
    assert isinstance(info.value, StoreError)
    event = store.watch("c/", after_version=oldest, timeout=SHORT, prefix=True)
    assert event.version > oldest and event.kind == "set"


# -- sessions ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ephemeral_key_vanishes_when_owner_is_killed(server: StoreServer, store: Store) -> None:
    child = spawned.spawn("hold_ephemeral", _spec(server), "eph", "eph-ready")
    try:
        store.wait(["eph-ready"], timedelta(seconds=60))
        assert store.get("eph") == b"alive"
        rev = store.stats()["revision"]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        event = store.watch("eph", after_version=rev, timeout=timedelta(seconds=10))
        assert (event.kind, event.key) == ("delete", "eph")
        assert store.try_get("eph") is None
        assert store.get("eph-ready") == b"1"  # not session-bound
    finally:
        spawned.kill_all([child])


def test_ephemeral_key_vanishes_on_close_and_rebinds(server: StoreServer, store: Store) -> None:
    owner = store.clone()
    owner.set("e1", "1", ephemeral=True)
    owner.set("e2", "1", ephemeral=True)
    store.set("e2", "plain")  # a later set without the flag unbinds it
    assert owner.compare_set_ex("e3", "", "x", ephemeral=True) == (True, b"x")
    owner.close()
    spawned.wait_until(lambda: store.try_get("e1") is None, 10, "e1 to vanish")
    assert store.try_get("e3") is None
    assert store.get("e2") == b"plain"


# -- queues --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_blocking_queue_pop_woken_by_another_process(server: StoreServer, store: Store) -> None:
    child = spawned.spawn("push_after", _spec(server), "jobs", "job-1", "go")
    try:
        store.set("go", "1")
        assert store.queue_pop("jobs", timeout=timedelta(seconds=60)) == b"job-1"
    finally:
        spawned.join([child], timeout=60)


def test_queue_pop_timeout_and_nonblocking(store: Store) -> None:
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError):
        store.queue_pop("empty", timeout=timedelta(milliseconds=300))
    assert 0.25 <= time.monotonic() - start <= 0.3 + SLACK
    with pytest.raises(dist.QueueEmptyError):
        store.queue_pop("empty", block=False)
    store.queue_push("empty", "x")
    assert store.queue_len("empty") == 1
    assert store.queue_pop("empty", block=False) == b"x"
    assert store.queue_len("empty") == 0


# -- connections ---------------------------------------------------------------------------------


def test_connect_refused_raises_network_error() -> None:
    with StoreServer() as srv:
        port = srv.port
    start = time.monotonic()
    with pytest.raises(StoreNetworkError) as info:
        Store("127.0.0.1", port, connect_timeout=timedelta(milliseconds=500))
    assert isinstance(info.value, dist.DistNetworkError)
    assert time.monotonic() - start <= 0.5 + SLACK


def test_server_gone_raises_network_error() -> None:
    srv = StoreServer()
    st = Store(srv.host, srv.port, timeout=SHORT * 5, connect_timeout=timedelta(milliseconds=500))
    st.set("a", "1")
    srv.close()
    srv.close()  # idempotent
    start = time.monotonic()
    with pytest.raises(StoreNetworkError):
        st.get("a")  # the client may try to reconnect, within connect_timeout
    assert time.monotonic() - start <= 0.5 + SLACK
    st.close()


def test_server_properties() -> None:
    with StoreServer("127.0.0.1", 0) as srv:
        assert srv.port > 0 and srv.host == "127.0.0.1"
        assert srv.address == f"127.0.0.1:{srv.port}"
        assert repr(srv) == f"StoreServer(127.0.0.1:{srv.port}, running)"
        assert srv.running
        assert srv.config.port == 0
    assert not srv.running
    assert "closed" in repr(srv)
    with pytest.raises(ValueError, match="not a port number"):
        StoreServer(port=70000)
    with pytest.raises(ValueError, match="log_level"):
        StoreServer(log_level="loud")


def test_ipv6_loopback() -> None:
    try:
        srv = StoreServer("::1", 0)
    except (OSError, RuntimeError, dist.DistError) as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with srv, Store("::1", srv.port) as st:
        assert srv.address == f"[::1]:{srv.port}"
        st.set("six", "6")
        assert st.get("six") == b"6"


def test_the_old_module_paths_name_the_same_objects() -> None:
    import elasticstore.call_stats
    import elasticstore.prefix_store
    import elasticstore.server
    import elasticstore.server_limits
    import elasticstore.store
    from elasticstore import stores
    from elasticstore.stores import call_stats
    from elasticstore.stores.native import server, server_limits

    for old, new in ((elasticstore.store, stores.native.store), (elasticstore.server, server),
                     (elasticstore.server_limits, server_limits),
                     (elasticstore.call_stats, call_stats),
                     (elasticstore.prefix_store, stores.prefix)):
        assert old.__all__, old
        for name in old.__all__:
            assert getattr(old, name) is getattr(new, name), (old, name)
    assert elasticstore.store.Store is Store and elasticstore.WatchEvent is stores.WatchEvent


def test_public_names_and_timeout_setting(store: Store) -> None:
    assert set(elasticstore.__all__) <= set(dir(elasticstore))
    assert elasticstore.__version__
    assert store.timeout == timedelta(seconds=30)
    store.set_timeout(timedelta(seconds=2))
    assert store.timeout == timedelta(seconds=2)
    with pytest.raises(TypeError):
        store.set_timeout(5)  # type: ignore[arg-type]
    with store.clone() as clone:
        assert clone.timeout == timedelta(seconds=2)
    assert "open" in repr(store)


def test_closed_store_raises(server: StoreServer) -> None:
    st = Store(server.host, server.port)
    st.close()
    st.close()
    with pytest.raises(StoreError, match="closed"):
        st.get("x")


# -- keep-alive ----------------------------------------------------------------------------------


def test_dropped_store_parks_and_keeps_serving_torch(server: StoreServer) -> None:
    prefix = dist.PrefixStore("ka", Store(server.host, server.port, timeout=SHORT * 10))
    gc.collect()
    # Only torch's C++ PrefixStore holds the store now: it is parked, its connection closed.
    spawned.wait_until(lambda: server.stats()["connections"] == 0, 10, "the parked connection")
    parked = [
        s for s in keepalive.PARKED if isinstance(s, Store) and s.port == server.port
    ]
    assert len(parked) == 1
    # C++ calls still reach the Python methods (reconnecting once).
    prefix.set("a", "1")
    assert prefix.get("a") == b"1"
    assert prefix.add("n", 2) == 2
    assert server.stats()["connections"] == 1
    parked[0].close()
    assert parked[0] not in keepalive.PARKED
    spawned.wait_until(lambda: server.stats()["connections"] == 0, 10, "the connection to close")


def test_closed_store_is_not_parked(server: StoreServer) -> None:
    before = len(keepalive.PARKED)
    with Store(server.host, server.port):
        pass
    gc.collect()
    assert len(keepalive.PARKED) == before
