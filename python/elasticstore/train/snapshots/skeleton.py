"""A snapshot's skeleton: its state pickled with every plain tensor replaced by a reference into
the snapshot's data region (``fileformat.py`` lays the bytes out).

Pickling runs on every step's path, so the pickler chooses how to reduce an object through a
dispatch table that the C pickler reads itself: a type's entry is computed once per process
(``_Reducers``) and every later object of that type costs the pickler no Python call, except
tensors, which it hands to ``SkeletonPickler._tensor``. The entries reduce as the pickler would without
the table (``copyreg``'s, else the object's ``__reduce_ex__``), except for plain tensors
(references) and sharded tensors and their subclasses (refused: ``prepare`` turns them into
``ShardedStateError``). Types of types (classes pickled by name) are left to the pickler.
"""

from __future__ import annotations

import copyreg
import io
import operator
import pickle
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PROTOCOL", "ShardedFound", "SkeletonPickler", "SkeletonUnpickler", "tensor_ref"]

PROTOCOL = pickle.HIGHEST_PROTOCOL
# The module name that snapshots written by earlier versions give their tensor references.
_EARLIER_MODULE = "elasticstore.train.snapshots.fileformat"
_Tensor = torch.Tensor
_STRIDED = torch.strided


class ShardedFound(Exception):
    """A sharded tensor met while pickling (``prepare`` turns it into ``ShardedStateError``)."""


def tensor_ref(dtype: torch.dtype, shape: tuple[int, ...], offset: int, nbytes: int) -> Any:
    """What a copied tensor pickles as; ``SkeletonUnpickler`` resolves it into the data region."""
    raise RuntimeError("a snapshot's tensor reference is read by its own unpickler only")


def _refuse(obj: Any) -> Any:
    raise ShardedFound


class _Reducers(dict):  # type: ignore[type-arg]
    """The shared part of every pickler's dispatch table: type -> reduction, filled on first
    sight of a type (``_Table.__missing__``), for the sharded tensor types loaded so far and the
    reductions registered with ``copyreg`` (``reset``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sharded: tuple[type, ...] = ()
        self.registered: dict[type, Any] = dict(copyreg.dispatch_table)

    def reset(self, sharded: tuple[type, ...]) -> None:
        """Decides every type again when a sharded tensor module was loaded, or a ``copyreg``
        reduction registered, replaced or removed, since the last snapshot (the registered
        functions compared by identity: a type registered again keeps no stale reduction)."""
        if sharded != self.sharded or copyreg.dispatch_table != self.registered:
            self.clear()
            self.sharded, self.registered = sharded, dict(copyreg.dispatch_table)

    def entry(self, cls: type) -> Callable[[Any], Any] | None:
        if self.sharded and issubclass(cls, self.sharded):
            return _refuse
        if issubclass(cls, type):
            return None  # a class with a metaclass: the pickler saves it by name
        found = copyreg.dispatch_table.get(cls)
        return found if found is not None else operator.methodcaller("__reduce_ex__", PROTOCOL)


_REDUCERS = _Reducers()


class _Table(dict):  # type: ignore[type-arg]
    """One pickler's dispatch table: ``_REDUCERS`` plus its own tensor entry."""

    def __missing__(self, cls: type) -> Callable[[Any], Any]:
        found = _REDUCERS.get(cls)
        if found is None:
            entry = _REDUCERS.entry(cls)
            if entry is None:
                raise KeyError(cls)
            _REDUCERS[cls] = found = entry
        self[cls] = found
        return found


class SkeletonPickler(pickle.Pickler):
    """Pickles one snapshot's ``(identity, state)``; collects the tensors it replaced by
    references and where each goes in the data region (64-byte aligned offsets)."""

    def __init__(self, f: io.BytesIO, sharded: tuple[type, ...], align: int) -> None:
        _REDUCERS.reset(sharded)
        table = _Table(_REDUCERS)
        table[_Tensor] = self._tensor
        self.dispatch_table = table  # read by the C pickler's __init__
        super().__init__(f, protocol=PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.layout: list[tuple[torch.dtype, tuple[int, ...], int]] = []  # dtype, shape, offset
        self.size = 0
        self.on_cpu = True  # every copied tensor is on the CPU
        self._align = align

    def _tensor(self, obj: torch.Tensor) -> Any:
        if obj.layout is not _STRIDED or obj.is_quantized or obj.is_meta:
            return obj.__reduce_ex__(PROTOCOL)  # pickled by value, as torch does
        dtype, shape, nbytes = obj.dtype, tuple(obj.shape), obj.nbytes
        offset = -(-self.size // self._align) * self._align
        self.tensors.append(obj)
        self.layout.append((dtype, shape, offset))
        self.on_cpu = self.on_cpu and obj.is_cpu
        self.size = offset + nbytes
        return tensor_ref, (dtype, shape, offset, nbytes)


class SkeletonUnpickler(pickle.Unpickler):
    """Reads a skeleton; its tensor references become views of ``data`` (clones with
    ``clone``)."""

    def __init__(self, f: io.BytesIO, data: torch.Tensor, clone: bool = True) -> None:
        super().__init__(f)
        self.data, self.clone = data, clone

    def find_class(self, module: str, name: str) -> Any:
        if name in ("tensor_ref", "_tensor_ref") and module in (__name__, _EARLIER_MODULE):
            return self._tensor
        return super().find_class(module, name)

    def _tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int,
                nbytes: int) -> torch.Tensor:
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        view = self.data[offset:offset + nbytes].view(dtype).view(shape)
        return view.clone() if self.clone else view
