"""torchrun's ``--logs-specs NAME``: a ``LogsSpecs`` class, the ``NAME`` entry point of the
``torchrun.logs_specs`` group, decides where each local rank's stdout, stderr and error file go.

As torch's: the class is built once per launcher with ``(log_dir, redirects, tee,
local_ranks_filter)`` (``build``); each round, before its workers start, ``reify`` is called with
the variables torch's agent hands it (one dict per local rank, ``TORCH_KEYS``), and its
``LogsDest`` places each worker's files: a stream whose path is ``""`` goes to the console, any
other path is written (``os.devnull``: dropped), and a stream in ``tee_stdouts``/``tee_stderrs``
goes to the console too; the worker's ``TORCHELASTIC_ERROR_FILE`` is what ``reify`` set, else
``error_files[local rank]``, and that file is read when the worker fails;
``filtered_stdout``/``filtered_stderr`` take the teed lines that match
``--duplicate-std{out,err}-filters``. The agent writes these files itself (``logs.rank_output``).
"""

from __future__ import annotations

import dataclasses
import os
from importlib import metadata
from typing import Any

from .config import AgentSettings
from .logs import RankDest
from .workers import WorkerSpec

__all__ = ["GROUP", "TORCH_KEYS", "build", "find", "reify"]

GROUP = "torchrun.logs_specs"
# The variables of a worker that torch's agent passes to LogsSpecs.reify (LocalElasticAgent).
TORCH_KEYS = ("RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
              "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
              "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "LOCAL_RANK",
              "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")  # the first: --virtual-local-rank only
_ERROR = "TORCHELASTIC_ERROR_FILE"


def find(name: str) -> metadata.EntryPoint:
    """The entry point ``name`` of the ``torchrun.logs_specs`` group; ``LookupError`` if none."""
    found = list(metadata.entry_points(group=GROUP, name=name))
    if not found:
        raise LookupError(f"{name!r}: no entry point of that name in the {GROUP} group (torchrun: "
                          f"\"Could not find entrypoint under '{GROUP}[{name}]' key\")")
    return found[0]


def build(name: str, log_dir: str | None, redirects: str, tee: str,
          local_ranks_filter: frozenset[int] | None) -> Any:
    """The ``LogsSpecs`` object, built as torchrun builds it (``-r``/``-t`` as torch's ``Std``)."""
    from torch.distributed.elastic.multiprocessing.api import LogsSpecs, Std

    cls = find(name).load()
    if not (isinstance(cls, type) and issubclass(cls, LogsSpecs)):
        raise TypeError(f"{name!r} ({cls!r}) is not a subclass of torch's LogsSpecs")
    return cls(log_dir=log_dir, redirects=Std.from_str(redirects), tee=Std.from_str(tee),
               local_ranks_filter=set(local_ranks_filter) if local_ranks_filter else None)


def _truncate(path: str) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644))


def reify(s: AgentSettings, specs: list[WorkerSpec]) -> list[WorkerSpec]:
    """The round's workers with the files ``s.logs_specs.reify`` gives them (``specs`` unchanged
    without ``--logs-specs``)."""
    if s.logs_specs is None:
        return specs
    keys = TORCH_KEYS if s.virtual_local_rank else TORCH_KEYS[:-2] + TORCH_KEYS[-1:]
    envs = {w.local_rank: {k: w.env[k] for k in keys if k in w.env} for w in specs}
    dest = s.logs_specs.reify(envs)
    filtered = {}
    for stream, path in (("stdout", dest.filtered_stdout), ("stderr", dest.filtered_stderr)):
        if s.duplicate_filters.get(stream) and path:
            _truncate(path)  # torch's: opened "w" once per round
            filtered[stream] = path
    out = []
    for w in specs:
        local, env = w.local_rank, dict(w.env)
        env.pop(_ERROR, None)
        env.update(envs[local])
        error_file = dest.error_files.get(local, "")
        if _ERROR not in envs[local]:
            env[_ERROR] = "" if error_file == os.devnull else error_file
        tee = frozenset(s for s, paths in (("stdout", dest.tee_stdouts), ("stderr", dest.tee_stderrs))
                        if local in paths)
        rank_dest = RankDest(stdout=dest.stdouts.get(local, ""), stderr=dest.stderrs.get(local, ""),
                             tee=tee, filtered=filtered)
        own = error_file if error_file and error_file != os.devnull else w.error_file
        out.append(dataclasses.replace(w, env=env, error_file=own, dest=rank_dest))
    return out
