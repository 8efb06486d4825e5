"""Schedulers as an input layer: a scheduler's environment gives the flags a command line leaves
out, before anything starts; a flag (or its ``PET_<FLAG>`` variable) always wins.

:func:`parse_args` parses the command line once, notes which flags it named, and fills the others
from the scheduler found in the environment (Slurm: ``slurm.py``); the launcher then parses the
result exactly as if those flags had been typed. :func:`finish` does what the scheduler needs
when the launcher exits (Slurm: requeue a preempted job). Nothing below the command layer knows
of either.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from ..rendezvous import registry
from .slurm import SlurmError, SlurmJob, flag_values, requeue_if_preempted

__all__ = ["SchedulerError", "finish", "parse_args"]

SchedulerError = SlurmError

_DESTS = ("nnodes", "rdzv_id", "rdzv_endpoint", "local_addr", "rdzv_backend", "standalone",
          "master_addr", "master_port", "node_rank")


class _Unset:
    def __repr__(self) -> str:
        return "<not given>"


_UNSET = _Unset()


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str],
               environ: Mapping[str, str]) -> tuple[argparse.Namespace, list[str]]:
    """``argv`` parsed by ``parser``, the flags it leaves out (and no ``PET_<FLAG>`` gives) taken
    from the scheduler's environment; and the notices that say what was taken. Raises
    :class:`SchedulerError` when the environment is not what the scheduler sets."""
    args = parser.parse_args(list(argv), argparse.Namespace(**dict.fromkeys(_DESTS, _UNSET)))
    given = {d for d in _DESTS if getattr(args, d) is not _UNSET
             or (d != "standalone" and environ.get("PET_" + d.upper()) is not None)}
    for dest in _DESTS:
        if getattr(args, dest) is _UNSET:
            setattr(args, dest, parser.get_default(dest))
    if not args.standalone:  # a switch: PET_STANDALONE=0 is not a request
        given.discard("standalone")
    job = SlurmJob.from_environ(environ)
    if job is None:
        return args, []
    backend = None
    if args.rdzv_backend is not None:
        try:
            backend = registry.backend(str(args.rdzv_backend)).label
        except ValueError:
            backend = str(args.rdzv_backend)  # the launcher names the bad value
    values, notices = flag_values(job, frozenset(given), backend)
    for dest, value in values.items():
        setattr(args, dest, value)
    return args, notices


def finish(rc: int, environ: Mapping[str, str], prog: str = "elasticstore-run") -> int:
    """The launcher's exit code ``rc``, after what the scheduler needs at exit (Slurm: a preempted
    requeueable job is requeued when the launcher exits non-zero); says what it did."""
    requeue_if_preempted(rc, environ, lambda said: print(f"[{prog}] {said}", file=sys.stderr, flush=True))
    return rc
