"""EtcdStore.watch over kept-open streams (``stores/etcd/watch.py``) and channels shared by the
stores of a process (``_POOL`` in ``stores/etcd/client.py``), on a real etcd member: a caller
looping on ``after_version = event.version`` reads one stream, sees every change in order (the
changes of one transaction included), and ``close()`` still ends a watch blocked in another
thread."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import etcd_cluster
import pytest

import elasticstore
from elasticstore import StoreError, StoreTimeoutError
from elasticstore.stores.etcd import client as etcd_client, watch as etcd_watch

T5 = timedelta(seconds=5)


@pytest.fixture
def store(etcd: etcd_cluster.Cluster) -> Iterator[elasticstore.EtcdStore]:
    with elasticstore.EtcdStore(etcd.endpoints, prefix=f"/test/{uuid.uuid4().hex}",
                                timeout=T5) as st:
        yield st


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the watch streams opened (the real method runs)."""
    opened: list[int] = []
    real = etcd_client.Connection.watch_stream

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(etcd_client.Connection, "watch_stream", counted)
    return opened


def test_a_watch_loop_reads_one_stream_and_sees_every_change(
    store: elasticstore.EtcdStore, streams: list[int]
) -> None:
    store.set("run/a", "0")
    base = store.watch("run/", after_version=0, timeout=T5, prefix=True).version
    count = 300  # written before the loop reads them: etcd serves the stream from its history
    for i in range(count):
        store.set(f"run/k{i}", str(i))
    t0 = time.monotonic()
    after, seen = base, []
    for _ in range(count):
        ev = store.watch("run/", after_version=after, timeout=T5, prefix=True)
        assert ev.version > after
        after = ev.version
        seen.append(ev.key)
    elapsed = time.monotonic() - t0
    assert seen == [f"run/k{i}" for i in range(count)]
    assert len(streams) == 1, f"{len(streams)} streams for {count + 1} events"
    # A stream per event waits for etcd's catch-up loop (100 ms) each time: 30 s here.
    assert elapsed < 10, f"{count} events in {elapsed:.1f}s"


def test_changes_of_one_transaction_all_reach_the_loop(store: elasticstore.EtcdStore) -> None:
    store.set("tx/0", "start")
    first = store.watch("tx/", after_version=0, timeout=T5, prefix=True)
    store.multi_set(["tx/a", "tx/b"], ["1", "2"])  # one revision, two events
    a = store.watch("tx/", after_version=first.version, timeout=T5, prefix=True)
    b = store.watch("tx/", after_version=a.version, timeout=T5, prefix=True)
    assert (a.key, b.key) == ("tx/a", "tx/b") and a.version == b.version
    with pytest.raises(StoreTimeoutError, match="no change"):
        store.watch("tx/", after_version=b.version, timeout=timedelta(seconds=0.3), prefix=True)


def test_a_watch_from_an_earlier_revision_or_another_key_opens_its_own_stream(
    store: elasticstore.EtcdStore, streams: list[int]
) -> None:
    store.set("p/x", "1")
    store.set("p/x", "2")
    first = store.watch("p/x", after_version=0, timeout=T5)
    second = store.watch("p/x", after_version=first.version, timeout=T5)
    assert (first.value, second.value) == (b"1", b"2")
    again = store.watch("p/x", after_version=0, timeout=T5)  # back in time: a new stream
    assert again.value == b"1" and len(streams) == 2
    store.set("p/y", "3")
    other = store.watch("p/y", after_version=0, timeout=T5)
    assert other.value == b"3" and len(streams) == 3
    # A call after a timeout continues the same stream.
    with pytest.raises(StoreTimeoutError):
        store.watch("p/y", after_version=other.version, timeout=timedelta(seconds=0.2))
    store.set("p/y", "4")
    assert store.watch("p/y", after_version=other.version, timeout=T5).value == b"4"
    assert len(streams) == 3


def test_close_ends_a_watch_blocked_in_another_thread(etcd: etcd_cluster.Cluster) -> None:
    prefix = f"/test/{uuid.uuid4().hex}"
    keep = elasticstore.EtcdStore(etcd.endpoints, prefix=prefix, timeout=T5)
    st = elasticstore.EtcdStore(etcd.endpoints, prefix=prefix, timeout=T5)
    assert st._c()._channel(0) is keep._c()._channel(0)  # one channel per endpoint and process
    ended: list[BaseException] = []

    def blocked() -> None:
        try:
            st.watch("never", timeout=timedelta(seconds=30))
        except BaseException as exc:  # what close() made it raise
            ended.append(exc)

    thread = threading.Thread(target=blocked, daemon=True)
    thread.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    st.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - t0 < 3
    assert isinstance(ended[0], StoreError), ended
    # The other store of the process (same channel) works on.
    keep.set("k", "v")
    assert keep.get("k") == b"v"
    keep.close()


def test_a_cursor_nobody_reads_gives_up_its_stream(
    store: elasticstore.EtcdStore, streams: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(etcd_watch, "MAX_BUFFERED", 5)
    store.set("b/0", "0")
    first = store.watch("b/", after_version=0, timeout=T5, prefix=True)
    for i in range(1, 20):
        store.set(f"b/{i}", str(i))
    time.sleep(0.5)  # the reader buffers 5, then stops
    after, seen = first.version, []
    for _ in range(19):
        ev = store.watch("b/", after_version=after, timeout=T5, prefix=True)
        after = ev.version
        seen.append(ev.key)
    assert seen == [f"b/{i}" for i in range(1, 20)]  # none lost: a new stream from there
    assert len(streams) == 2


def test_a_forked_child_makes_its_own_channel(etcd: etcd_cluster.Cluster) -> None:
    """A child forked after its parent opened a store works with stores of its own, and the
    parent's go on (the channel pool is per process: a child never uses a parent's channel)."""
    prefix = f"/test/{uuid.uuid4().hex}"
    parent = elasticstore.EtcdStore(etcd.endpoints, prefix=prefix, timeout=T5)
    parent.set("f", "1")
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 when its own store works
        code = 1
        try:
            with elasticstore.EtcdStore(etcd.endpoints, prefix=prefix, timeout=T5) as st:
                code = 0 if st.get("f") == b"1" else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    status = None
    try:
        while status is None and time.monotonic() < deadline:
            done, code = os.waitpid(pid, os.WNOHANG)
            status = code if done else None
            time.sleep(0.05)
    finally:
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert status == 0, f"child status {status}"
    assert parent.get("f") == b"1"  # the parent's channel still works
    parent.close()
