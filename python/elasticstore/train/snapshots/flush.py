"""The newest snapshot of a node written to the checkpoint directory at once, when the job is
signalled to stop (Slurm's preemption or time limit): not at the next periodic checkpoint.

Workers and the agent meet in the node's snapshot area (``ELASTICSTORE_SNAPSHOT_DIR``):

- A worker's ``Snapshots`` with a ``checkpoint_dir`` records, at its first snapshot, where its
  disk checkpoints go (``checkpoint_mark.py``).
- The agent, stopped by a signal and once its workers are gone, runs this module as a process
  (``python -m elasticstore.train.snapshots.flush AREA``; the agent takes no code from
  ``train/``) and kills it when the grace period ends (SIGTERM, then SIGKILL).

The process writes the newest complete snapshot of the area (the highest step any local rank
holds) in the format the periodic checkpoints have: replicated state as ``ckpt-<step>.pt``
(``save_checkpoint``: a temporary file renamed), from the rank that writes the checkpoints
(global rank 0 by default: the other nodes write nothing); sharded state as every local rank's
shard of DCP's checkpoint (``dcp_disk.write_shard``: the last rank's part completes the step's
directory and renames it), of the newest step every local rank holds, and of the step before
when that does not complete (the nodes' newest steps may differ by one: one of the two completes
once every node wrote). A step the directory already holds, or older, is not written again.
Killed in the middle, it leaves the previous checkpoints as they were: a replicated write removes
its temporary file on SIGTERM; a temporary file or directory that SIGKILL leaves behind is
ignored by loading and removed by the next save. Each outcome is one line on standard error.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from .checkpoint_mark import Mark, marks

__all__ = ["flush", "main"]

PREFIX = "[elasticstore-run]"


def _say(text: str) -> None:
    print(f"{PREFIX} {text}", file=sys.stderr, flush=True)


def flush(area: str) -> int:
    """Writes the area's newest snapshot to the checkpoint directory; 0 when written or nothing
    was to write, 1 when the write failed."""
    from .fileformat import list_snapshots

    where = marks(area)
    snaps = list_snapshots(area)
    if not where or not snaps:
        _say("at the signal: no snapshot with a checkpoint directory on this node: nothing written")
        return 0
    step = snaps[-1][0]
    files = {lr: p for s, lr, p in snaps if s == step and lr in where}
    if not files:
        _say(f"at the signal: the newest snapshot (step {step}) has no checkpoint directory: "
             "nothing written")
        return 0
    started = time.monotonic()
    try:
        if _sharded(files[min(files)]):
            step, done = _flush_sharded(snaps, where)
        else:
            done = _write(step, files, where)
    except Exception as exc:  # noqa: BLE001 - one line, the previous checkpoints intact
        _say(f"at the signal: writing the snapshot of step {step} failed: {type(exc).__name__}: "
             f"{exc}; the previous checkpoints are intact")
        return 1
    if done:
        _say(f"at the signal: the snapshot of step {step} written to {done} "
             f"({time.monotonic() - started:.1f} s)")
    return 0


def _flush_sharded(snaps: list[tuple[int, int, str]], where: dict[int, Mark]) -> tuple[int, str | None]:
    """Every local rank's shard of the newest step they all hold; when that does not complete
    the checkpoint (another node's ranks are a step behind, or have not written yet), the step
    before too: one of the two completes once every node wrote. (step, the checkpoint completed
    here, or None)."""
    common = set.intersection(*[{s for s, r, _ in snaps if r == lr} for lr in where])
    steps = sorted(common, reverse=True)[:2]
    for step in steps:
        done = _write_sharded(step, {lr: p for s, lr, p in snaps if s == step and lr in where}, where)
        if done is not None:
            return step, done or None
    if steps:
        _say(f"at the signal: this node's shards of step(s) {', '.join(map(str, steps))} written; "
             "the checkpoint completes when the other nodes' shards of a step are written")
    else:
        _say("at the signal: no step of which every local rank holds a sharded snapshot: nothing "
             "written")
    return (steps[0] if steps else -1), None


def _sharded(path: str) -> bool:
    from .fileformat import read_snapshot
    from .identity import Identity

    try:
        return Identity.from_dict(read_snapshot(path, clone=False)[1]).sharded
    except (OSError, ValueError, EOFError, RuntimeError):
        return False


def _write(step: int, files: dict[int, str], where: dict[int, Mark]) -> str | None:
    """Replicated state: the checkpoint written (path), or None when there was nothing to write
    (said why)."""
    from ..checkpoint import list_checkpoints, save_checkpoint
    from .fileformat import read_snapshot
    from .identity import Identity

    first = min(files)
    _, ident_d, _ = read_snapshot(files[first], clone=False)
    ident = Identity.from_dict(ident_d)
    if not ident.replicated:
        _say(f"at the signal: step {step} holds per-rank state: no disk checkpoint is written for it")
        return None
    writers = sorted(lr for lr in where if where[lr].write)
    if not writers:
        return None  # another node writes the replicated checkpoints
    target = where[writers[0]]
    lr = writers[0] if writers[0] in files else first  # replicated: any local rank's copy
    on_disk = list_checkpoints(target.directory)
    if on_disk and on_disk[-1][0] >= step:
        _say(f"at the signal: step {on_disk[-1][0]} is already on disk ({on_disk[-1][1]}); the "
             f"newest snapshot is step {step}: nothing written")
        return None
    got, ident_d, state = read_snapshot(files[lr])
    if got != step:
        raise ValueError(f"{files[lr]} holds step {got}, its name says {step}")
    return save_checkpoint(target.directory, state, step, keep=target.keep, meta=ident_d)


def _write_sharded(step: int, files: dict[int, str], where: dict[int, Mark]) -> str | None:
    """Every local rank's shard of ``step``: the DCP checkpoint's path when this completed it,
    "" when it was complete already (nothing written), None when it is not complete yet."""
    from .dcp_disk import write_shard
    from .fileformat import read_snapshot
    from .identity import Identity

    completed: str | None = None
    for lr, path in sorted(files.items()):
        target = where[lr]
        final = os.path.join(target.directory, f"dcp-step-{step:012d}")
        if os.path.exists(final):
            _say(f"at the signal: {final} is already on disk: nothing written")
            return ""
        got, ident_d, state = read_snapshot(path)
        ident = Identity.from_dict(ident_d)
        if got != step or not ident.sharded:
            raise ValueError(f"{path} holds {ident.describe()}, not sharded state of step {step}")
        done = write_shard(target.directory, step, ident.rank, ident.world_size, state["items"],
                           state["data"], target.keep)
        completed = completed or done
    return completed


def _stop(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds: save_checkpoint removes its temporary file


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python -m elasticstore.train.snapshots.flush SNAPSHOT_AREA", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop)
    return flush(argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
