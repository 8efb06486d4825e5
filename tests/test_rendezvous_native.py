"""The rendezvous on the native store, with real processes: each simulated node on its own
loopback address (127.0.0.2, ...); the rendezvous server is hosted by this test process."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rdzv_procs import Agents  # noqa: E402
from rdzv_scenarios import SCENARIOS  # noqa: E402

import elasticstore  # noqa: E402

pytestmark = pytest.mark.slow

FAST = {"last_call_timeout": 0.3, "join_timeout": 30, "lease_ttl": 2}


@pytest.fixture
def agents() -> Iterator[Callable[..., Agents]]:
    with elasticstore.StoreServer("127.0.0.1", 0) as server:

        def make(lo: int, hi: int, **conf: Any) -> Agents:
            return Agents(backend="elasticstore", endpoint=server.address, run_id="job",
                          min=lo, max=hi, conf={**FAST, **conf})

        yield make


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_native(agents: Callable[..., Agents], scenario: Callable[..., None]) -> None:
    scenario(agents)


def test_lost_rendezvous_server_fails_every_agent_naming_it() -> None:
    server = elasticstore.StoreServer("127.0.0.1", 0)
    try:
        with Agents(backend="elasticstore", endpoint=server.address, run_id="job", min=2, max=2,
                    conf=FAST) as group:
            nodes = group.start_together(["127.0.0.2", "127.0.0.3"], rounds=2)
            for a in nodes:
                a.expect("round")
            lost_at = time.time()
            server.close()
            for a in nodes:
                err = a.expect("error", 15)
                assert err["type"] == "RendezvousConnectionError", err
                assert server.address in err["msg"]
                print(f"rendezvous server lost -> agent error: {err['t'] - lost_at:.2f}s")
                assert err["t"] - lost_at < 10
    finally:
        server.close()
