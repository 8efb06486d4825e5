"""pytest-benchmark entry points of ``rendezvous.py`` (join-to-ranks time, ours against torch's
c10d dynamic rendezvous on TCPStore). Not collected by default (the file name does not start with
``test_``): run ``python -m pytest benchmarks/rendezvous_bench.py --benchmark-only``."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rendezvous  # noqa: E402

AGENTS = [8, 64, 256]


@pytest.mark.parametrize("agents", AGENTS)
@pytest.mark.parametrize("peer", (rendezvous.PEERS[0], rendezvous.TUNED) + rendezvous.PEERS[1:])
def test_join_to_ranks(benchmark, peer: str, agents: int) -> None:  # type: ignore[no-untyped-def]
    benchmark.group = f"rendezvous join x{agents}"
    secs = benchmark.pedantic(rendezvous.join_time, args=(peer, agents, 150.0),
                              rounds=1, iterations=1)
    benchmark.extra_info.update(seconds=secs, finished=secs is not None)


@pytest.mark.parametrize("agents", [256, 1024])
def test_shutdown_while_waiting(benchmark, agents: int) -> None:  # type: ignore[no-untyped-def]
    benchmark.group = f"rendezvous shutdown x{agents}"
    secs = benchmark.pedantic(rendezvous.shutdown_time, args=(agents, 150.0),
                              rounds=1, iterations=1)
    benchmark.extra_info.update(seconds=secs, finished=secs is not None)
