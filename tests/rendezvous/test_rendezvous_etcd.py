"""The rendezvous on etcd v3 (``elasticstore-etcd``): the scenarios of the native backend on a
real etcd, liveness by leases (TTL 1 s here); and a 3-member cluster losing a member."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest


import etcd_cluster  # noqa: E402
from rdzv_nodes import Agents  # noqa: E402
from rdzv_scenarios import SCENARIOS  # noqa: E402

pytestmark = pytest.mark.slow

FAST = {"last_call_timeout": 0.3, "join_timeout": 30, "lease_ttl": 1}
_RUNS = itertools.count()


def maker(endpoints: list[str]) -> Callable[..., Agents]:
    run_id = f"job{next(_RUNS)}"

    def make(lo: int, hi: int, **conf: Any) -> Agents:
        return Agents(backend="elasticstore-etcd", endpoint=",".join(endpoints), run_id=run_id,
                      min=lo, max=hi, conf={**FAST, **conf})

    return make


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_etcd(etcd: etcd_cluster.Cluster, scenario: Callable[..., None]) -> None:
    scenario(maker(etcd.endpoints))


def test_three_member_cluster_loses_one_during_the_rendezvous() -> None:
    with etcd_cluster.running(3) as cluster:
        make = maker(cluster.endpoints)
        with make(3, 3) as group:
            lost = cluster.leader()
            nodes = group.start_together(
                [f"127.0.0.{i}" for i in (2, 3, 4)], before_go=lost.kill
            )
            rounds = [a.expect("round", 60) for a in nodes]
            assert [r["rank"] for r in rounds] == [0, 1, 2]
            assert {r["world"] for r in rounds} == {3}

