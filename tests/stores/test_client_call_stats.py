"""The store client's call statistics (``elasticstore.client_call_stats``) and the agent's
``elasticstore_store_client_*`` metrics: real servers on loopback, a real etcd, a real agent.

The counters are process-wide and only grow: each scenario compares a snapshot taken before its
calls with one taken after; those that count exactly run in a fresh process of their own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid
from datetime import timedelta
from typing import Any

import pytest
from agent_nodes import agents, free_port, until

import elasticstore
from elasticstore import (
    QueueEmptyError,
    StoreError,
    StoreNetworkError,
    StoreServer,
    StoreTimeoutError,
    _C,
    client_call_stats,
)
from elasticstore.stores.call_stats import CLIENT_CALL_BUCKETS, CLIENT_CALL_OUTCOMES
from paths import HELPERS

Key = tuple[str, str]  # (backend, op)


class Delta:
    def __init__(self) -> None:
        self.calls = dict.fromkeys(CLIENT_CALL_OUTCOMES, 0)
        self.seconds = 0.0
        self.buckets = [0] * (len(CLIENT_CALL_BUCKETS) + 1)

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __repr__(self) -> str:
        return f"Delta({self.calls}, {self.seconds:.6f}s, {self.buckets})"


def snap() -> dict[Key, elasticstore.ClientCallStats]:
    return {(s.backend, s.op): s for s in client_call_stats()}


def diff(before: dict[Key, elasticstore.ClientCallStats],
         after: dict[Key, elasticstore.ClientCallStats]) -> dict[Key, Delta]:
    out: dict[Key, Delta] = {}
    for key, now in after.items():
        d = Delta()
        old = before.get(key)
        for outcome in CLIENT_CALL_OUTCOMES:
            d.calls[outcome] = now.calls[outcome] - (old.calls[outcome] if old else 0)
        d.seconds = now.seconds - (old.seconds if old else 0.0)
        d.buckets = [n - (old.buckets[i] if old else 0) for i, n in enumerate(now.buckets)]
        if d.total:
            out[key] = d
    return out


def calls(d: dict[Key, Delta], backend: str) -> dict[str, dict[str, int]]:
    """op -> the outcomes with a nonzero count."""
    return {op: {o: n for o, n in v.calls.items() if n}
            for (b, op), v in d.items() if b == backend}


def check_histograms(d: dict[Key, Delta]) -> None:
    for key, v in d.items():
        assert sum(v.buckets) == v.total, (key, v)
        assert all(n >= 0 for n in v.buckets) and v.seconds >= 0, (key, v)
        # The total time lies between the bounds of the buckets the calls fell in.
        low = sum(n * (CLIENT_CALL_BUCKETS[i - 1] if i else 0.0) for i, n in enumerate(v.buckets))
        assert low - 1e-9 <= v.seconds, (key, v)
        if v.buckets[-1] == 0:  # none above the last bound
            high = sum(n * b for n, b in zip(v.buckets, CLIENT_CALL_BUCKETS))
            assert v.seconds <= high + 1e-9, (key, v)


def bucket_of(seconds: float) -> int:
    return next((i for i, b in enumerate(CLIENT_CALL_BUCKETS) if seconds <= b),
                len(CLIENT_CALL_BUCKETS))


def run_isolated(scenario: str) -> None:
    """Runs ``scenario`` (a function of this module) in a fresh Python process, where no thread
    that another test left behind can call a store between the two snapshots."""
    here = os.path.dirname(os.path.abspath(__file__))
    module = os.path.splitext(os.path.basename(__file__))[0]
    code = (f"import sys; sys.path[:0] = [{here!r}, {HELPERS!r}]; import {module} as m; "
            f"m.{scenario}()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=90, cwd=here)
    assert out.returncode == 0, f"{scenario} failed:\n{out.stdout}\n{out.stderr}"


def test_shape() -> None:
    assert CLIENT_CALL_OUTCOMES == ("ok", "timeout", "network", "error")
    assert list(CLIENT_CALL_BUCKETS) == sorted(CLIENT_CALL_BUCKETS)
    assert CLIENT_CALL_BUCKETS[0] == 50e-6 and CLIENT_CALL_BUCKETS[-1] == 60.0
    for s in client_call_stats():
        assert set(s.calls) == set(CLIENT_CALL_OUTCOMES)
        assert len(s.buckets) == len(CLIENT_CALL_BUCKETS) + 1 and s.total > 0


def test_native_counts_each_operation_and_outcome() -> None:
    run_isolated("native_counts_each_operation_and_outcome")


def native_counts_each_operation_and_outcome() -> None:
    before = snap()
    server = StoreServer()
    st = elasticstore.Store(server.host, server.port, timeout=timedelta(seconds=1))
    try:
        for i in range(3):
            st.set(f"k{i}", "v")
        for _ in range(5):
            st.add("n", 1)
        assert st.compare_set_ex("k0", "v", "w") == (True, b"w")
        assert st.get("k1") == b"v"
        assert st.multi_get(["k0", "k1"]) == [b"w", b"v"]
        t0 = time.monotonic()
        with pytest.raises(StoreTimeoutError):
            st.wait(["missing"], timedelta(seconds=0.2))
        waited = time.monotonic() - t0
        with pytest.raises(StoreError, match="ADD"):  # an error reply: "k2" is not a counter
            st.add("k2", 1)
        with pytest.raises(StoreError, match="exceeds the limit"):  # refused, never sent
            st.set("x" * (_C.MAX_KEY_BYTES + 1), "v")
        with pytest.raises(QueueEmptyError):  # an empty queue: "ok", as the C++ client sees it
            st.queue_pop("q", block=False)
        served = diff(before, snap())
        server.close()
        for _ in range(2):  # the first may fail on the old socket, the second must reconnect
            with pytest.raises(StoreNetworkError):
                st.add("n", 1)
    finally:
        st.close()
        server.close()
    d = diff(before, snap())
    check_histograms(d)
    native = calls(served, "native")
    assert native == {
        "connect": {"ok": 1}, "set": {"ok": 3}, "add": {"ok": 5, "error": 1},
        "compare_set": {"ok": 1}, "get": {"ok": 1}, "multi_get": {"ok": 1},
        "wait": {"timeout": 1}, "queue_pop": {"ok": 1},
    }, native
    after = calls(d, "native")
    assert after["add"] == {"ok": 5, "error": 1, "network": 2}
    assert after["connect"]["ok"] == 1 and after["connect"]["network"] >= 1
    assert not calls(d, "etcd")
    wait = d[("native", "wait")]
    assert wait.buckets[bucket_of(wait.seconds)] == 1 and 0.2 <= wait.seconds <= waited + 0.01
    assert CLIENT_CALL_BUCKETS[bucket_of(wait.seconds)] >= 0.2


def test_native_closed_client_counts_a_network_failure() -> None:
    run_isolated("native_closed_client_counts_a_network_failure")


def native_closed_client_counts_a_network_failure() -> None:
    with StoreServer() as server:
        c = _C.Client(server.host, server.port, connect_timeout=5.0, timeout=5.0)
        before = snap()
        c.ping()
        c.close()
        with pytest.raises(StoreNetworkError, match="closed"):
            c.ping()
    assert calls(diff(before, snap()), "native") == {"ping": {"ok": 1, "network": 1}}


def test_native_counters_from_many_threads() -> None:
    run_isolated("native_counters_from_many_threads")


def native_counters_from_many_threads() -> None:
    """4 threads on stores of their own and 2 on one shared store (its call mutex contended),
    while a reader checks that every counter only grows."""
    threads_own, threads_shared, per_thread = 4, 2, 300
    total = (threads_own + threads_shared) * per_thread
    with StoreServer() as server:
        shared = elasticstore.Store(server.host, server.port, timeout=timedelta(seconds=10))
        before = snap()
        stop = threading.Event()
        problems: list[str] = []

        def reader() -> None:
            last = snap()
            for _ in range(100_000):  # bounded; ends when the writers are done
                if stop.is_set():
                    return
                now = snap()
                for key, s in now.items():
                    old = last.get(key)
                    if old is None:
                        continue
                    grew = all(s.calls[o] >= old.calls[o] for o in CLIENT_CALL_OUTCOMES) and all(
                        a >= b for a, b in zip(s.buckets, old.buckets)) and s.seconds >= old.seconds
                    if not grew:
                        problems.append(f"{key}: {old} -> {s}")
                last = now
                time.sleep(0.001)

        def writer(own: bool) -> None:
            st = shared.clone() if own else shared
            try:
                for _ in range(per_thread):
                    st.add("n", 1)
            except Exception as exc:  # reported below
                problems.append(repr(exc))
            finally:
                if own:
                    st.close()

        watcher = threading.Thread(target=reader)
        watcher.start()
        workers = [threading.Thread(target=writer, args=(i < threads_own,))
                   for i in range(threads_own + threads_shared)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(60)
        stop.set()
        watcher.join(10)
        assert not watcher.is_alive() and not any(t.is_alive() for t in workers)
        assert shared.add("n", 0) == total
        shared.close()
    assert not problems, problems[:5]
    d = diff(before, snap())
    check_histograms(d)
    assert calls(d, "native") == {"add": {"ok": total + 1}, "connect": {"ok": threads_own}}


def test_etcd_store_feeds_the_same_numbers() -> None:
    run_isolated("etcd_store_feeds_the_same_numbers")


def etcd_store_feeds_the_same_numbers() -> None:
    import etcd_cluster

    with etcd_cluster.running(1) as cluster:
        before = snap()
        st = elasticstore.EtcdStore(cluster.endpoints, prefix=f"/test/{uuid.uuid4().hex}",
                                    timeout=timedelta(seconds=1))
        try:
            st.set("a", "1")
            assert st.add("a", 2) == 3
            assert st.compare_set("a", "3", "4") == b"4"  # counted once, as compare_set
            assert st.get("a") == b"4"
            with pytest.raises(StoreTimeoutError):
                st.wait(["missing"], timedelta(seconds=0.2))
            with pytest.raises(QueueEmptyError):  # "ok", as for the native client
                st.queue_pop("q", block=False)
            cluster.stop()
            with pytest.raises(StoreNetworkError):
                st.add("a", 1)
        finally:
            st.close()
    d = diff(before, snap())
    check_histograms(d)
    assert calls(d, "etcd") == {
        "connect": {"ok": 1}, "set": {"ok": 1}, "add": {"ok": 1, "network": 1},
        "compare_set": {"ok": 1}, "get": {"ok": 1}, "wait": {"timeout": 1},
        "queue_pop": {"ok": 1},
    }
    assert not calls(d, "native")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_agent_metrics_export_the_counters_at_scrape_time() -> None:
    pytest.importorskip("prometheus_client")
    from elasticstore.agent.metrics import AgentMetrics

    port = free_port("127.0.0.1")
    metrics = AgentMetrics(port)
    try:
        with StoreServer() as server, elasticstore.Store(server.host, server.port) as st:
            for _ in range(3):
                st.add("n", 1)
            first = samples(scrape(port))
            st.add("n", 1)
            second = samples(scrape(port))
    finally:
        metrics.close()
    add = frozenset({("backend", "native"), ("op", "add")})

    def get(s: dict[Any, float], name: str, **labels: str) -> float:
        return s[(name, add | frozenset(labels.items()))]

    ok1 = get(first, "elasticstore_store_client_calls_total", outcome="ok")
    assert ok1 >= 3 and get(second, "elasticstore_store_client_calls_total", outcome="ok") == ok1 + 1
    assert get(second, "elasticstore_store_client_calls_total", outcome="timeout") >= 0
    for s in (first, second):
        count = get(s, "elasticstore_store_client_call_seconds_count")
        assert count == sum(get(s, "elasticstore_store_client_calls_total", outcome=o)
                            for o in CLIENT_CALL_OUTCOMES)
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in s.items()
                         if k[0] == "elasticstore_store_client_call_seconds_bucket"
                         and add <= k[1])
        assert [le for le, _ in buckets] == [*CLIENT_CALL_BUCKETS, float("inf")]
        cumulative = [v for _, v in buckets]
        assert cumulative == sorted(cumulative) and cumulative[-1] == count
        assert get(s, "elasticstore_store_client_call_seconds_sum") > 0


WORKER = textwrap.dedent("""
    import os, sys, time
    d = sys.argv[1]
    open(os.path.join(d, "ready"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(d, "release")) and time.monotonic() < deadline:
        time.sleep(0.05)
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_elasticstore_run_serves_the_store_client_metrics(tmp_path: Any) -> None:
    """A 1-node job: the agent's rendezvous calls show on its --metrics-port."""
    pytest.importorskip("prometheus_client")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    mport = free_port("127.0.0.1")
    with agents(str(tmp_path)) as a:
        proc = a.start(["--standalone", "--nproc-per-node", "1", "--metrics-port", str(mport)],
                       [str(tmp_path)], name="agent", script=str(script))
        until(lambda: os.path.exists(tmp_path / "ready") or proc.poll() is not None, 60,
              "the worker started")
        assert proc.poll() is None, a.output(proc)
        text = scrape(mport)
        a.release()
        assert a.wait(proc, 60) == 0, a.output(proc)
    s = samples(text)
    ok = {dict(k[1])["op"]: v for k, v in s.items()
          if k[0] == "elasticstore_store_client_calls_total"
          and dict(k[1]).get("backend") == "native" and dict(k[1])["outcome"] == "ok"}
    assert ok.get("connect", 0) >= 1 and sum(ok.values()) >= 3, text
    counts = {dict(k[1])["op"]: v for k, v in s.items()
              if k[0] == "elasticstore_store_client_call_seconds_count"}
    assert counts and all(v > 0 for v in counts.values()), text
    assert "# TYPE elasticstore_store_client_call_seconds histogram" in text

