"""At a signal that stops the job (Slurm's preemption, a time limit, ``scancel``), the node's
newest snapshot goes to the checkpoint directory before the agent exits, within the grace period.

Called by ``SnapshotArea.close`` when the agent stopped for a signal, after its workers stopped
(no worker writes a snapshot any more). The writing is ``train/snapshots/flush.py``, run as a
process of its own (the agent takes no code from ``train/``): it reads the area's newest snapshot
and writes it as a checkpoint (a temporary name, then a rename). When the grace period ends first,
the process gets SIGTERM (its temporary file removed), then SIGKILL after ``KILL_AFTER_S``: the
write is abandoned, the previous checkpoints stay as they were, and the agent says so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from .logs import say

__all__ = ["KILL_AFTER_S", "flush_newest"]

KILL_AFTER_S = 2.0  # from the SIGTERM that abandons a write to its SIGKILL
MODULE = "elasticstore.train.snapshots.flush"
MARK = ".checkpoint.local-"  # what workers write (train/snapshots/checkpoint_mark.py)


def wanted(area: str) -> bool:
    """Whether a worker of this node said where its checkpoints go (else there is nothing to
    write, and no process is started)."""
    try:
        return any(n.startswith(MARK) for n in os.listdir(area))
    except OSError:
        return False


def flush_newest(area: str, within: float) -> bool:
    """Runs the flush of ``area`` for at most ``within`` seconds; whether it finished (whatever
    it wrote: it says that itself)."""
    if not wanted(area):
        return True
    if within <= 0:
        say("[elasticstore-run] at the signal: no time left of --shutdown-timeout to write the "
            "newest snapshot to the checkpoint directory: not written")
        return False
    started = time.monotonic()
    try:
        proc = subprocess.Popen([sys.executable, "-m", MODULE, area], stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as exc:
        say(f"[elasticstore-run] at the signal: could not start the snapshot flush: {exc}")
        return False
    try:
        proc.wait(within)
        return True
    except subprocess.TimeoutExpired:
        pass
    for sig, wait in ((signal.SIGTERM, KILL_AFTER_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    say(f"[elasticstore-run] at the signal: writing the newest snapshot to the checkpoint directory "
        f"did not finish within the grace period ({time.monotonic() - started:.1f} s of "
        f"{within:.1f} s left of --shutdown-timeout): abandoned, the previous checkpoints intact")
    return False
