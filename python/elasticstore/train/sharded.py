"""Sharded tensors (``DTensor``, ``ShardedTensor``) in a state: found, and refused where one copy
would be handed to every rank (``save_checkpoint``, ``load_checkpoint_from_any_rank``, and in
snapshots ``ShardedTensor``). ``Snapshots`` takes DTensors as sharded state (``snapshots/shards.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ShardedStateError", "has_sharded_tensor", "refuse_sharded", "sharded_path",
           "sharded_types"]


class ShardedStateError(ValueError):
    """A state holding sharded tensors where one copy would serve every rank: a rank would get
    another rank's shard back. Nothing was written."""


_SHARDED: tuple[type, ...] | None = None
# Each sharded tensor class and the module that defines it: ``(module, class name)``.
_SHARDED_CLASSES = (("torch.distributed.tensor", "DTensor"),
                    ("torch.distributed._shard.sharded_tensor", "ShardedTensor"))


def sharded_types() -> tuple[type, ...]:
    """The classes of sharded tensors (``DTensor``, ``ShardedTensor``) that objects of this process
    can be: those whose module is loaded. A sharded tensor cannot exist before its module is
    imported (unpickling one imports it first), so their imports (about 1 s) are left to the
    code that makes them; the answer is cached once every class is loaded."""
    global _SHARDED
    if _SHARDED is not None:
        return _SHARDED
    found: list[type] = []
    complete = True
    for module_name, name in _SHARDED_CLASSES:
        cls = getattr(sys.modules.get(module_name), name, None)
        if isinstance(cls, type):
            found.append(cls)
        else:
            complete = False
    if complete or not dist.is_available():
        _SHARDED = tuple(found)
    return tuple(found)


def sharded_path(state: Any, limit: int = 100_000) -> str | None:
    """Where in ``state`` (dicts, lists, tuples, sets and the attributes of plain objects) the
    first sharded tensor is, as ``key.key[index]``; None when there is none (or, past ``limit``
    objects, none found so far)."""
    types = sharded_types()
    if not types:
        return None
    todo: list[tuple[str, Any]] = [("", state)]
    seen: set[int] = set()
    while todo and len(seen) < limit:
        path, obj = todo.pop()
        if isinstance(obj, types):
            return path or "<the state itself>"
        if isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None))) \
                or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Mapping):
            todo.extend((f"{path}.{k}" if path else str(k), v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(obj))
        elif hasattr(obj, "__dict__"):
            todo.extend((f"{path}.{k}" if path else k, v) for k, v in vars(obj).items())
    return None


def refuse_sharded(state: Any, what: str, where: str | None = None) -> None:
    """Raises ``ShardedStateError`` when ``state`` holds a sharded tensor (at ``where``, when the
    caller found it already)."""
    where = where or sharded_path(state)
    if where is None:
        return
    raise ShardedStateError(
        f"{what}: the state holds a sharded tensor (DTensor or ShardedTensor) at {where!r}, e.g. "
        "from FSDP2 (fully_shard) or get_state_dict. One copy serves every rank here, so a rank "
        "would get another rank's shard back: sharded state is refused (nothing was written). "
        "Save sharded state with torch.distributed.checkpoint (dcp.save/dcp.load) or Snapshots "
        "(DTensors: each rank keeps its shards, restore(template=...) reshards), or "
        "snapshot the full state dict, the same on every rank (get_state_dict(..., "
        "options=StateDictOptions(full_state_dict=True)), loaded back with set_state_dict and "
        "the same options)")


def has_sharded_tensor(state: Any) -> bool:
    """Whether ``state`` holds a ``ShardedTensor`` (refused; DTensors are snapshotted)."""
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:
        return False
    todo, seen = [state], 0
    while todo and seen < 100_000:
        obj = todo.pop()
        seen += 1
        if isinstance(obj, ShardedTensor):
            return True
        if isinstance(obj, Mapping):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
    return False
