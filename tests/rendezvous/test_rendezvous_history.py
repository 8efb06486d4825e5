"""A ring watcher whose store's watch history moved past it (more changes than the server's
history holds, e.g. the beats of a large run over hours) still notices its successor's loss."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

import elasticstore

HISTORY_EVENTS = 65_536  # kWatchHistoryEvents (docs/protocol.md)


def test_ring_watcher_behind_the_history_still_sees_a_loss() -> None:
    with elasticstore.StoreServer("127.0.0.1", 0) as server:
        # lease_ttl 1: the ring watcher's watch times out every 0.5 s and watches again from
        # the revision it started at; failover off: only the ring tells of the loss.
        handlers = [get_rendezvous_handler(RendezvousParameters(
            "elasticstore", server.address, "hist", 2, 2, "127.0.0.1", lease_ttl=1,
            last_call_timeout=0.1, join_timeout=30, failover=False)) for _ in range(2)]
        try:
            with ThreadPoolExecutor(2) as pool:
                infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
            assert sorted(i.world_size for i in infos) == [2, 2]
            with elasticstore.Store("127.0.0.1", server.port) as flood:
                n = HISTORY_EVENTS + 1000  # one request: as many changes as the history holds
                flood.multi_set(["flood"] * n, [b"x"] * n)
            time.sleep(1.5)  # every ring watcher's watch timed out and watched again since
            survivor, lost = handlers
            lost.shutdown()
            deadline = time.monotonic() + 10
            while survivor.num_nodes_waiting() == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert survivor.num_nodes_waiting() > 0, "the ring watcher missed the loss"
        finally:
            for h in handlers:
                h.shutdown()

