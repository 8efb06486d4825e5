"""A worker for the platform contracts (run unchanged under torchrun and elasticstore-run).

``--dir D --mode M``; writes ``start-<restart>-<rank>`` (its pid) to D, then by mode:
- ``timer``: torch's file timer (``TORCHELASTIC_TIMER_FILE``): rank 0 of the first attempt
  overruns ``expires(after=1)`` and is killed by the launcher's timer server; the next attempt
  stays within its timer and writes ``done-<restart>-<rank>``.
- ``raise``: rank 0 raises ``RuntimeError("boom from rank 0")`` under ``@record``; the others
  wait to be stopped.
- ``sleep``: every rank sleeps until stopped.
"""

import os
import sys
import time

from torch.distributed.elastic import timer
from torch.distributed.elastic.multiprocessing.errors import record

args = sys.argv[1:]
out = args[args.index("--dir") + 1]
mode = args[args.index("--mode") + 1]
rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def _mark(name: str) -> None:
    with open(os.path.join(out, f"{name}-{restart}-{rank}"), "w") as f:
        f.write(str(os.getpid()))


@record
def main() -> None:
    _mark("start")
    if mode == "timer":
        timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
        if restart == 0 and rank == 0:
            with timer.expires(after=1):
                time.sleep(60)  # the timer server kills this process long before
        else:
            with timer.expires(after=60):
                time.sleep(0.2)
        _mark("done")
    elif mode == "raise":
        if rank == 0:
            raise RuntimeError("boom from rank 0")
        time.sleep(60)
    else:
        time.sleep(120)


if __name__ == "__main__":
    main()
