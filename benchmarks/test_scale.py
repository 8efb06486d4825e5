"""Throughput with N client processes, connect storm, barrier, server memory."""

import pytest

import groups
import machine
import memory
import throughput


@pytest.mark.section("throughput")
def test_throughput(benchmark, peer, fresh_server, sizes, tput_clients):
    benchmark.group = f"throughput {tput_clients} clients"
    st = benchmark.pedantic(
        throughput.throughput, args=(peer.name, fresh_server, tput_clients, sizes, "pytest/tput"),
        rounds=1, iterations=1,
    )
    assert st["ops"] > 0
    benchmark.extra_info.update(ops_per_s=st["ops_per_s"], p50_us=st["p50_ns"] / 1e3,
                                p99_us=st["p99_ns"] / 1e3,
                                server_cpu_us_per_op=st["server_cpu_us_per_op"])


def _group(benchmark, fn, peer, srv, n, kind, sizes, label):
    if kind not in peer.barriers:
        pytest.skip(f"{peer.name} has no {kind} barrier")
    why = machine.fd_room(n, sizes)
    if why:
        pytest.skip(why)
    benchmark.group = f"{label} {n}"
    r = benchmark.pedantic(fn, args=(peer.name, srv, n, kind, sizes, f"pytest/{label}"),
                           rounds=1, iterations=1)
    assert r["seconds"] > 0
    benchmark.extra_info.update(r)


@pytest.mark.section("storm")
def test_connect_storm(benchmark, peer, fresh_server, sizes, storm_clients, barrier_kind):
    _group(benchmark, groups.connect_storm, peer, fresh_server, storm_clients, barrier_kind,
           sizes, "connect storm")


@pytest.mark.section("barrier")
def test_barrier(benchmark, peer, fresh_server, sizes, barrier_size, barrier_kind):
    _group(benchmark, groups.barrier_time, peer, fresh_server, barrier_size, barrier_kind,
           sizes, "barrier")


def test_memory(benchmark, peer, sizes):
    if peer.skip("memory"):
        pytest.skip(peer.skip("memory"))
    if not peer.measure_memory:
        pytest.skip(f"{peer.name} shares its server with another row")
    benchmark.group = "server memory"
    mm = benchmark.pedantic(memory.memory, args=(peer.name, sizes), rounds=1, iterations=1)
    benchmark.extra_info.update({k: v for k, v in mm.items()})
