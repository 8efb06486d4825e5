"""A simulated rendezvous node for the tests (one process; its own loopback address).

Usage: ``python rdzv_node.py JSON`` with keys backend, endpoint, run_id, min, max, addr, conf,
rounds (how many rounds to take part in), rejoin_at_once (join the next round at once; gated
agents first wait for a line on stdin), after ("stay": wait for stdin to close, then shut
down; "shutdown": shut down at once; "close": set_closed then shut down), put (a key to set in
each round's worker store). Prints one JSON line per event: ``round``, ``waiting``, ``error``,
``done``. Between rounds it checks ``num_nodes_waiting()`` every 10 ms, as torch's agent does.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def emit(**fields: Any) -> None:
    print(json.dumps({**fields, "t": time.time()}), flush=True)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    params = RendezvousParameters(
        cfg["backend"], cfg["endpoint"], cfg["run_id"], cfg["min"], cfg["max"], cfg["addr"],
        **cfg.get("conf", {}),
    )
    handler = get_rendezvous_handler(params)
    emit(ev="ready")
    if cfg.get("gate"):  # start the rendezvous together with the other gated agents
        sys.stdin.readline()
    try:
        for n in range(cfg.get("rounds", 1)):
            info = handler.next_rendezvous()
            boot = info.bootstrap_store_info
            rnd = getattr(handler, "round").round
            stale = rnd > 1 and info.store.check([f"stale/{rnd - 1}"])
            info.store.set(f"stale/{rnd}", "1")  # must not be seen by the next round's workers
            emit(ev="round", round=rnd, rank=info.rank,
                 world=info.world_size, boot=f"{boot.master_addr}:{boot.master_port}",
                 stale=stale, node=getattr(handler, "node_id", ""))
            if n + 1 == cfg.get("rounds", 1):
                break
            if cfg.get("rejoin_at_once"):  # as torch's agent after its workers failed
                if cfg.get("gate"):  # once told (every node is in the round: workers started)
                    sys.stdin.readline()
                continue
            deadline = time.monotonic() + 60
            while handler.num_nodes_waiting() == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError("num_nodes_waiting stayed 0 for 60 s")
                time.sleep(0.01)
            emit(ev="waiting", n=handler.num_nodes_waiting())
    except Exception as exc:  # reported to the test, which checks the message
        emit(ev="error", type=type(exc).__name__, msg=str(exc))
        handler.shutdown()
        sys.exit(3)
    after = cfg.get("after", "stay")
    if after == "stay":
        sys.stdin.read()
    elif after == "close":
        handler.set_closed()
    emit(ev="done", closed=handler.is_closed())
    handler.shutdown()


if __name__ == "__main__":
    main()
