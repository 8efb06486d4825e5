"""A worker of ``elastic_launch`` with a function entrypoint: ``python -m
elasticstore.launcher.worker PAYLOAD RESULTS`` (forked by the fork server, or a fresh interpreter
for ``start_method="spawn"``).

``PAYLOAD`` (written by the launching process, readable by its user only) holds what
``multiprocessing``'s spawn start method hands a child (``get_preparation_data``: the caller's
``sys.path``, working directory and main module, re-imported here as ``__mp_main__`` so that
functions defined in the caller's script unpickle), then the function and its arguments. The
function runs under torch's ``@record`` (an uncaught exception goes to the error file); what it
returns is written, pickled, to ``RESULTS/<attempt>.<rank>.result`` (renamed into place)."""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any

__all__ = ["main", "result_name"]


def result_name(attempt: int, rank: int) -> str:
    return f"{attempt}.{rank}.result"


def _attempt() -> int:
    """The round this worker belongs to (the agent's ``/worker/attempt_<n>`` store prefix)."""
    text = os.environ.get("ELASTICSTORE_ATTEMPT") or os.environ.get(
        "ELASTICSTORE_PREFIX", "").rpartition("attempt_")[2]
    return int(text) if text.isdigit() else 0


def main(argv: list[str]) -> None:
    payload_path, results = argv[1], argv[2]
    with open(payload_path, "rb") as f:
        payload: dict[str, Any] = pickle.load(f)
    from multiprocessing import spawn

    spawn.prepare(payload["prep"])  # the caller's path, directory and main module
    fn, args = pickle.loads(payload["call"])
    from torch.distributed.elastic.multiprocessing.errors import record

    value = record(fn)(*args)
    rank = int(os.environ["RANK"])
    name = result_name(_attempt(), rank)
    tmp = os.path.join(results, f".{name}.{os.getpid()}")
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    os.replace(tmp, os.path.join(results, name))


if __name__ == "__main__":
    main(list(sys.argv))
