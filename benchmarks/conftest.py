"""pytest-benchmark suites: every measure of report.py, parametrized over the peers.

    python -m pytest benchmarks/ --benchmark-only                 small counts (a minute or two)
    python -m pytest benchmarks/ --benchmark-only --bench-full    the report's counts
    ... --bench-peers elasticstore,tcpstore                       a subset of peers

torch's client does a reverse DNS lookup per connect; unless --bench-real-dns, the run re-executes
itself with no_rdns.so preloaded (see no_rdns.c). The measurements are the ones report.py uses
(latency.py, throughput.py, groups.py, memory.py, pingpong.py). Per-op latencies are timed by
pytest-benchmark itself (one call per round) with p50/p99 added to extra_info; the
multi-process measures run once per test and put their figures in extra_info. No thresholds.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402

import cbuild  # noqa: E402
import latency  # noqa: E402
import measures  # noqa: E402
import peers  # noqa: E402
import procs  # noqa: E402
from peers import PEERS  # noqa: E402


def pytest_addoption(parser):
    g = parser.getgroup("elasticstore benchmarks")
    g.addoption("--bench-full", action="store_true", help="full counts (default: quick counts)")
    g.addoption("--bench-peers", default=",".join(PEERS), help="comma-separated peer names")
    g.addoption("--bench-real-dns", action="store_true",
                help="do not preload no_rdns.so (see no_rdns.c and report.py --real-dns)")


def pytest_configure(config):
    if not config.getoption("--bench-real-dns"):
        argv = sys.argv
        if os.path.basename(os.path.dirname(os.path.abspath(argv[0]))) == "pytest":
            argv = ["-m", "pytest"] + argv[1:]  # python -m pytest
        cbuild.reexec_without_rdns(argv)
    procs.install_sigterm_handler()
    config.addinivalue_line(
        "markers", "section(name): the report section a test measures (a peer may skip it)")


def pytest_sessionfinish(session, exitstatus):
    procs.cleanup()


def _sizes(config) -> measures.Sizes:
    return measures.FULL if config.getoption("--bench-full") else measures.QUICK


def pytest_generate_tests(metafunc):
    sz = _sizes(metafunc.config)
    names = [n for n in metafunc.config.getoption("--bench-peers").split(",") if n]
    for n in names:
        if n not in PEERS:
            raise pytest.UsageError(f"unknown peer {n!r}; peers: {', '.join(PEERS)}")
    params = {
        "peer_name": names,
        "tput_clients": list(sz.tput_clients),
        "storm_clients": list(sz.storm_clients),
        "barrier_size": list(sz.barrier_sizes),
        "barrier_kind": sorted({kind for p in PEERS.values() for kind in p.barriers}),
    }
    for name, values in params.items():
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, values, scope="session" if name == "peer_name" else None)


@pytest.fixture(scope="session")
def sizes(pytestconfig) -> measures.Sizes:
    return _sizes(pytestconfig)


@pytest.fixture(scope="session")
def peer(peer_name):
    why = peers.missing(peer_name) or peers.probe(PEERS[peer_name])
    if why:
        pytest.skip(f"{peer_name}: {why}")
    return PEERS[peer_name]


@pytest.fixture(scope="session")
def server(peer):
    """One server process per peer for the latency suite."""
    srv = peer.start_server()
    yield srv
    srv.close()


@pytest.fixture
def fresh_server(request, peer):
    """A server process for one test (multi-client measures: earlier clients do not weigh).
    Skips the test first, with the reason, when the peer is not measured in its section."""
    mark = request.node.get_closest_marker("section")
    if mark:
        callspec = getattr(request.node, "callspec", None)
        why = peer.skip(mark.args[0], callspec.params.get("tput_clients", 0) if callspec else 0)
        if why:
            pytest.skip(why)
    srv = peer.start_server()
    yield srv
    srv.close()


@pytest.fixture(scope="session")
def client(peer, server, sizes):
    return peer.connect(server.host, server.port, sizes.op_timeout)


@pytest.fixture
def make_op(peer, sizes):
    def make(store, op, prefix):
        return latency.make_op(store, op, prefix, peer.native_api, sizes.op_timeout)

    return make
