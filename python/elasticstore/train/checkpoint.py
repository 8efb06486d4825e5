"""Atomic checkpoints in a directory, and node-local resume over a process group.

``save_checkpoint`` writes ``ckpt-<step, 12 digits>.pt`` through a temporary file in the same
directory (write, flush, fsync, rename, fsync of the directory): a process killed during a save
leaves the previous checkpoints intact and at most a ``.tmp`` file, which loading ignores and the
next save removes. One writer per directory (e.g. local rank 0 of each node).

``load_checkpoint`` returns the newest checkpoint that loads; a truncated or corrupt file is skipped
with a ``RuntimeWarning``. ``load_checkpoint_from_any_rank`` is for node-local directories (no
shared filesystem): the ranks agree on the newest step any of them has, and the lowest rank holding
it sends it to the others, so a node that joined with an empty directory resumes too.
"""

from __future__ import annotations

import os
import re
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .sharded import ShardedStateError, refuse_sharded, sharded_path

__all__ = ["Checkpoint", "CheckpointConflictError", "list_checkpoints", "load_checkpoint", "load_checkpoint_from_any_rank",
           "save_checkpoint"]

_NAME = re.compile(r"^ckpt-(\d{12,})\.pt$")
_TMP = re.compile(r"^\.ckpt-\d+\.pt\.[0-9a-f]+\.tmp$")
_FORMAT = "elasticstore.train.checkpoint/1"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: its step, the state given to ``save_checkpoint``, and its file."""

    step: int
    state: Any
    path: str
    meta: Any = None  # what wrote it says about it (a snapshot's identity record), or None


def _name(step: int) -> str:
    return f"ckpt-{step:012d}.pt"


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """The complete checkpoint files of ``directory`` as ``(step, path)``, oldest first."""
    directory = os.fspath(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(directory, name))
             for name in names if (m := _NAME.match(name))]
    return sorted(found)


class CheckpointConflictError(ValueError):
    """``save_checkpoint`` of a step older than a checkpoint already in the directory."""


def save_checkpoint(
    directory: str | os.PathLike[str], state: Any, step: int, keep: int = 2, *, meta: Any = None
) -> str:
    """Writes ``state`` (anything ``torch.save`` takes) as the checkpoint of ``step``, atomically;
    then keeps the newest ``keep`` checkpoints. Returns the file's path.

    Raises ``CheckpointConflictError`` before writing anything when the directory already holds a
    later step (a new run reusing a directory, or a resume from an older checkpoint): the new file
    would be the first one pruned, and a resume would load the later, unrelated step. Saving the
    same step again replaces it.

    Raises ``ShardedStateError`` for a state holding sharded tensors (``DTensor``,
    ``ShardedTensor``): one rank's shards are not a checkpoint; use ``torch.distributed.checkpoint``.
    ``meta``: plain data stored beside the state (``Checkpoint.meta``)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, not {step}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, not {keep}")
    directory = os.fspath(directory)
    refuse_sharded(state, "save_checkpoint()")
    later = [s for s, _ in list_checkpoints(directory) if s > step]
    if later:
        raise CheckpointConflictError(
            f"{directory} holds checkpoints of later steps ({', '.join(map(str, later[-3:]))}"
            f"{', ...' if len(later) > 3 else ''}) than step {step}: they would outrank the new "
            "one (a resume loads the newest) and it would be pruned at once; nothing was written. "
            "Use a fresh directory for a new run, or remove the later checkpoints")
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, _name(step))
    tmp = os.path.join(directory, f".{_name(step)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            payload = {"format": _FORMAT, "step": step, "state": state}
            if meta is not None:
                payload["meta"] = meta
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)
    _prune(directory, keep, own_tmp=os.path.basename(tmp))
    return final


def _prune(directory: str, keep: int, own_tmp: str) -> None:
    for _, path in list_checkpoints(directory)[:-keep]:
        os.unlink(path)
    for name in os.listdir(directory):  # leftovers of saves that were killed
        if _TMP.match(name) and name != own_tmp:
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def _load_file(path: str, step: int, map_location: Any, weights_only: bool) -> Checkpoint:
    payload = torch.load(path, map_location=map_location, weights_only=weights_only)
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise ValueError("not a checkpoint written by save_checkpoint")
    if payload.get("step") != step:
        raise ValueError(f"holds step {payload.get('step')!r}, its name says {step}")
    return Checkpoint(step=step, state=payload["state"], path=path, meta=payload.get("meta"))


def load_checkpoint(
    directory: str | os.PathLike[str], *, map_location: Any = "cpu", weights_only: bool = True
) -> Checkpoint | None:
    """The newest checkpoint of ``directory`` that loads, or None (no directory, none complete).

    A file that does not load (truncated, corrupt) is skipped with a ``RuntimeWarning``.
    ``weights_only`` is ``torch.load``'s: tensors, numbers, strings, lists, tuples and dicts.
    """
    for step, path in reversed(list_checkpoints(directory)):
        try:
            return _load_file(path, step, map_location, weights_only)
        except Exception as err:  # noqa: BLE001 - any failure to load means "not usable"
            reason = (str(err).strip().splitlines() or [""])[0]
            warnings.warn(f"skipping checkpoint {path}: {type(err).__name__}: {reason}",
                          RuntimeWarning, stacklevel=2)
    return None


def load_checkpoint_from_any_rank(
    directory: str | os.PathLike[str],
    group: dist.ProcessGroup | None = None,
    *,
    weights_only: bool = True,
) -> Checkpoint | None:
    """Collective: every rank of ``group`` gets the newest checkpoint that any of them holds.

    Each rank loads its own newest (``load_checkpoint``); the ranks agree on the highest step
    (all_reduce MAX) and the lowest rank holding it broadcasts it (``broadcast_object_list``).
    Returns None on every rank when none has one. ``group`` (default: the default group) must
    take CPU tensors, e.g. gloo; with NCCL pass ``dist.new_group(backend="gloo")``. The state
    travels pickled: for large sharded state use ``torch.distributed.checkpoint`` instead.
    """
    own = load_checkpoint(directory, weights_only=weights_only)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    newest = torch.tensor([own.step if own is not None else -1], dtype=torch.int64)
    dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=group)
    step = int(newest.item())
    if step < 0:
        return None
    holder = torch.tensor([rank if own is not None and own.step == step else world],
                          dtype=torch.int64)
    dist.all_reduce(holder, op=dist.ReduceOp.MIN, group=group)
    src = int(holder.item())
    payload: list[Any] = [own if rank == src else None]
    global_src = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast_object_list(payload, src=global_src, group=group)
    received = payload[0]
    assert isinstance(received, Checkpoint)
    where = sharded_path(received.state)
    if where is not None:  # every rank got the same payload: every rank raises
        raise ShardedStateError(
            f"{received.path} (rank {src}'s) holds a sharded tensor at {where!r}: one rank's shard "
            "cannot be handed to every rank. Use torch.distributed.checkpoint for sharded state")
    return received
