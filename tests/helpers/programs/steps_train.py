"""A training script for the store-host failover tests and the nemesis: every step is a gloo
all_reduce across the round's world (a step counts only once every rank of the group took part),
and each completed step is recorded with the time interval it took.

Records in ``--dir``: ``steps-<pid>.jsonl``, one line per completed step: the run id, the
attempt (the round), the group's store (``MASTER_ADDR:MASTER_PORT``: one per group), the world
size, the rank, the step's number in the group and its interval (``t0``: before the all_reduce,
``t1``: after it, wall clock), the node (``ELASTICSTORE_TEST_NODE``) and its incarnation (``STEPS_INCARNATION``: how
many times the test started that node before). Trains until the file ``release`` exists in ``--dir`` (a MAX all_reduce: every rank of a
group stops at one step). With ``STEPS_TERM_DELAY`` set in its environment (the agent's), a
worker that gets SIGTERM lingers that many seconds before it exits (a save-on-SIGTERM handler),
and one whose collective fails (a peer lost) waits for that SIGTERM instead of exiting at once
(as a worker stuck in a collective).
"""

import json
import os
import signal
import sys
import time


def main() -> None:
    directory = sys.argv[sys.argv.index("--dir") + 1]
    delay = float(os.environ.get("STEPS_TERM_DELAY") or 0)
    if delay > 0:
        def linger(*_: object) -> None:
            time.sleep(delay)
            os._exit(143)

        signal.signal(signal.SIGTERM, linger)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = {"run": os.environ.get("TORCHELASTIC_RUN_ID"),
             "attempt": int(os.environ.get("ELASTICSTORE_ATTEMPT")
                            or os.environ["TORCHELASTIC_RESTART_COUNT"]),
             "restarts": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
             "store": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
             "world": world, "rank": rank, "host": os.environ.get("ELASTICSTORE_TEST_NODE", ""),
             "incarnation": int(os.environ.get("STEPS_INCARNATION") or 0)}
    release = os.path.join(directory, "release")
    with open(os.path.join(directory, f"steps-{os.getpid()}.jsonl"), "a", buffering=1) as out:
        for step in range(1 << 30):
            flag = torch.tensor([1.0 if os.path.exists(release) else 0.0])
            t0 = time.time()
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            except Exception:
                if delay > 0:  # stuck as in a collective until the agent stops it (SIGTERM)
                    time.sleep(600)
                raise
            out.write(json.dumps(dict(group, step=step, t0=t0, t1=time.time())) + "\n")
            if flag.item() > 0:
                break
            time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
