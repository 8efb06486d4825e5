"""Latency per operation from one Python client on one connection, and wait wake-up time."""

import pytest

import latency
import measures
import pingpong


def _percentiles(benchmark) -> None:
    stats = getattr(benchmark, "stats", None)
    data = getattr(getattr(stats, "stats", None), "data", None)
    if data:  # pytest-benchmark's timer is perf_counter (seconds)
        st = measures.summarize([int(x * 1e9) for x in data])
        benchmark.extra_info.update(p50_us=st["p50_ns"] / 1e3, p99_us=st["p99_ns"] / 1e3)


@pytest.mark.parametrize("op", [op for op in latency.OPS if op != "wait"])
def test_op(benchmark, peer, client, sizes, op, make_op):
    if op not in peer.ops:
        pytest.skip(f"{peer.name} has no {op}")
    fn = make_op(client, op, f"pytest/lat/{op}")
    benchmark.group = f"latency {op}"
    benchmark.pedantic(fn, rounds=sizes.lat_iters, warmup_rounds=sizes.lat_warmup, iterations=1)
    _percentiles(benchmark)


def test_wait_wakeup(benchmark, peer, server, client, sizes):
    benchmark.group = "latency wait wake-up"
    st = benchmark.pedantic(
        latency.wait_wakeup, args=(peer.name, client, server.host, server.port, "pytest/wake", sizes),
        rounds=1, iterations=1,
    )
    assert st["n"] > 0
    benchmark.extra_info.update(p50_us=st["p50_ns"] / 1e3, p99_us=st["p99_ns"] / 1e3, n=st["n"])


def test_pingpong(benchmark, sizes):
    """The physical limit: raw TCP round trip on loopback (C++)."""
    benchmark.group = "latency ping-pong"
    res = benchmark.pedantic(
        pingpong.pingpong, args=(sizes.pingpong_iters, sizes.pingpong_iters // 10),
        rounds=1, iterations=1,
    )
    assert res["p50_ns"] > 0
    benchmark.extra_info.update(p50_us=res["p50_ns"] / 1e3, p99_us=res["p99_ns"] / 1e3,
                                floor_from=res["floor_from"])
