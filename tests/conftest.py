"""Shared fixtures: real servers on loopback, the registry of store kinds, and simulated network
nodes (``net``, for the fault tests)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator

import pytest

# The helper modules (tests/helpers) import by bare name, in every group of tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))

import store_kinds  # noqa: E402
from store_kinds import KINDS, Opened  # noqa: E402

# A shell that starts the suite in the background (``cmd &`` in a script) starts it with SIGINT
# ignored, and every process a test starts would inherit that: the tests that stop a program with
# SIGINT, as a user's Ctrl-C does, need it delivered. Python's own handler here; programs started
# from the tests get the default disposition (a caught signal is reset by exec, an ignored one not).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Parallel runs (pytest-xdist, ``scripts/test`` runs the suite with ``-n``/``--dist loadgroup``):
# a test file's tests stay together on one worker (its module fixtures, e.g. an etcd cluster,
# start once), and every test that builds network namespaces with ``netfaults.py`` (fixed
# TEST-NET addresses per node index) runs on one worker, one at a time.
NETNS_GROUP = "netns"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "xdist_group(name): tests of one group run on one worker")


def _uses_netfaults(path: object, cache: dict[str, bool]) -> bool:
    key = str(path)
    if key not in cache:
        try:
            with open(key) as f:
                cache[key] = "netfaults" in f.read()
        except OSError:
            cache[key] = False
    return cache[key]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One xdist group per file (its tests on one worker), every netfaults user in one group;
    a module that sets ``XDIST_PER_TEST = True`` (long tests that share nothing) gives each of
    its tests a group of its own, so that they spread over the workers."""
    seen: dict[str, bool] = {}
    for item in items:
        isolated = "net" in getattr(item, "fixturenames", ()) or _uses_netfaults(item.path, seen)
        alone = getattr(getattr(item, "module", None), "XDIST_PER_TEST", False)
        group = NETNS_GROUP if isolated else item.nodeid if alone else str(item.path)
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(params=KINDS, ids=[kind.name for kind in KINDS])
def opened(request: pytest.FixtureRequest) -> Iterator[Opened]:
    """A fresh store of each kind (see ``store_kinds.KINDS``)."""
    with request.param.open() as opened:
        yield opened


@pytest.fixture(scope="module")
def etcd() -> Iterator[object]:
    """A one-member etcd cluster (etcd_cluster.Cluster) shared by a test module."""
    import etcd_cluster

    with etcd_cluster.running(1) as cluster:
        yield cluster


@pytest.fixture
def server() -> Iterator[object]:
    import elasticstore

    with elasticstore.StoreServer() as srv:
        yield srv


@pytest.fixture
def store(server: object) -> Iterator[object]:
    import elasticstore

    with elasticstore.Store(
        server.host, server.port, timeout=store_kinds.DEFAULT_TIMEOUT  # type: ignore[attr-defined]
    ) as st:
        yield st


@pytest.fixture
def net() -> Iterator[None]:
    """Skips without root/namespaces/iptables (``netfaults.py``); afterwards checks no namespace
    or veth is left."""
    import netfaults

    reason = netfaults.available()
    if reason is not None:
        pytest.skip(reason)
    try:
        yield
    finally:
        assert netfaults.leftovers() == [], "a namespace or veth was left behind"


# ELASTICSTORE_TEST_CPU=FILE: each test's wall time and the CPU time it cost (this process and
# every child it reaped, with theirs) as a JSON line in FILE, to find where the suite's CPU goes
# (the suite is CPU-bound on 2 cores: its time is its CPU). A child left to another reaper (a
# daemon) is not counted.
_CPU_LOG = os.environ.get("ELASTICSTORE_TEST_CPU")


if _CPU_LOG:
    import json
    import resource
    import time

    def _cpu_now() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> Iterator[None]:
        wall0, cpu0 = time.monotonic(), _cpu_now()
        yield
        line = {
            "test": item.nodeid,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
            "start": round(wall0, 2),
            "wall_s": round(time.monotonic() - wall0, 2),
            "cpu_s": round(_cpu_now() - cpu0, 2),
        }
        with open(_CPU_LOG, "a") as f:
            f.write(json.dumps(line) + "\n")
