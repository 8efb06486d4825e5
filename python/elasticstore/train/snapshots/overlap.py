"""The part of a snapshot's copy that runs while the next step computes.

A tensor of a torch.optim optimizer (a parameter it updates, or its own state: Adam's moments,
momentum buffers) changes only in that optimizer's ``step``. Once an optimizer has stepped in
this process, ``Snapshots.snapshot`` copies such tensors of a large CPU state (``OVERLAP_BYTES``
or more) on a background thread and returns; every other tensor (module buffers, which a forward
pass may update, e.g. batch norm's running statistics; anything it cannot place) is copied before
it returns, as always. A process-wide step pre-hook of torch.optim waits for the background copy
before any optimizer steps, so the next step's forward and backward passes overlap the copy and
the optimizer's update never does.

The snapshot is published (renamed into view, handed to the disk writer) only when the copy is
done and no tensor it copied changed meanwhile (their version counters, read on the training
thread when it waits): at that hook, at the next ``snapshot``, or at ``flush``/``close``/exit.
A worker that fails before that leaves it unpublished and the previous one is restored. A copied
tensor that changed anyway (changed in place outside its optimizer's step) discards that snapshot
with a warning and ends overlapping for that ``Snapshots``. A change that torch's version counter
does not see (through ``.data``, or outside torch) is not detected: see docs/training.md.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from .copying import copy_into
from .fileformat import Buffer, Encoded

__all__ = ["OVERLAP_BYTES", "PendingCopy", "Settles", "background_part", "note_pending",
           "watch_optimizers"]

OVERLAP_BYTES = 4 << 20  # a CPU state this large copies its optimizers' tensors in the background


class Settles(Protocol):
    def settle(self) -> None: ...


_lock = threading.Lock()
# Owners (``Snapshots``) with a copy running, held until it is settled (a snapshot whose owner
# the program dropped is still published), and the process they belong to (not a forked child).
_pending: set[Any] = set()
_pending_pid = -1
_hooked_pid = -1
_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
# the optimizers that stepped here, each with a number never reused (ids are)
_optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_serial = itertools.count()
_Owners = dict[int, "weakref.ref[torch.Tensor]"]
_owner_cache: tuple[tuple[tuple[int, int, int], ...], _Owners] = ((), {})


def watch_optimizers() -> None:
    """Registers (once per process) the torch.optim step pre-hook that waits for the background
    copies and notes which optimizers step."""
    global _hooked_pid
    with _lock:
        if _hooked_pid == os.getpid():
            return
        _hooked_pid = os.getpid()
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_before_step)
    atexit.register(_settle_all)


def _before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if opt not in _optimizers:
        _optimizers[opt] = next(_serial)
    if _pending:
        _settle_all(raising=True)
    return None


def _settle_all(raising: bool = False) -> None:
    with _lock:
        owners = list(_pending) if _pending_pid == os.getpid() else []
    for owner in owners:
        try:
            owner.settle()
        except Exception as err:
            if raising:
                raise
            import warnings

            warnings.warn(f"a snapshot's background copy failed: {err}", RuntimeWarning,
                          stacklevel=1)


def note_pending(owner: Settles, running: bool) -> None:
    """Notes that ``owner`` has (or no longer has) a copy to settle before an optimizer steps."""
    global _pending_pid
    with _lock:
        if _pending_pid != os.getpid():  # a forked child: its parent's copies are not its own
            _pending.clear()
            _pending_pid = os.getpid()
        if running:
            _pending.add(owner)
        else:
            _pending.discard(owner)


def _local(t: Any) -> torch.Tensor:
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        return t._local_tensor  # the shard a sharded state's snapshot copies
    return t  # type: ignore[no-any-return]


def _owners() -> _Owners:
    """Data pointer -> (a weak reference to) the tensor there, for every tensor the optimizers
    that stepped here own: their parameters and their state's tensors. Made again when an
    optimizer, its parameters or its state's entries change in number."""
    global _owner_cache
    opts = list(_optimizers.items())
    key = tuple((n, sum(len(g["params"]) for g in o.param_groups), len(o.state)) for o, n in opts)
    if key == _owner_cache[0]:
        return _owner_cache[1]
    owners: _Owners = {}
    for o, _ in opts:
        tensors = [_local(p) for g in o.param_groups for p in g["params"]]
        for entry in o.state.values():
            if isinstance(entry, dict):
                tensors += [_local(v) for v in entry.values() if isinstance(v, torch.Tensor)]
        owners.update((t.data_ptr(), weakref.ref(t)) for t in tensors if t.data_ptr())
    _owner_cache = (key, owners)
    return owners


def _owned(t: torch.Tensor, owners: _Owners) -> bool:
    """Whether ``t`` is a live tensor an optimizer owns, or an alias of all of it (``detach()``,
    as state dicts give): the same memory, shape, strides and dtype. Memory a live tensor holds
    cannot have been reused; a tensor over a larger or another region (a flat buffer that a
    parameter views) is not taken for it."""
    ref = owners.get(t.data_ptr())
    owner = ref() if ref is not None else None
    return (owner is not None and owner.data_ptr() == t.data_ptr() and owner.dtype == t.dtype
            and owner.shape == t.shape and owner.stride() == t.stride() and not t.is_inference())


def background_part(enc: Encoded) -> list[int] | None:
    """The indices of ``enc.tensors`` to copy in the background (None: copy all now): those an
    optimizer that stepped here owns, in a CPU state of ``OVERLAP_BYTES`` or more."""
    if not enc.on_cpu or enc.data_size < OVERLAP_BYTES or not _optimizers:
        return None
    owners = _owners()
    part = [i for i, t in enumerate(enc.tensors) if _owned(t, owners)]
    return part or None


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid():  # a forked child has no pool thread
            _pool = ThreadPoolExecutor(1, thread_name_prefix="elasticstore-snapshot-overlap")
            _pool_pid = os.getpid()
        return _pool


class PendingCopy:
    """Snapshot ``step``'s copy into ``buf``: the tensors not in ``part`` (indices into
    ``enc.tensors``) copied at once, those of ``part`` on the background thread; ``wait`` for
    it, then ``changed`` tells whether the tensors it copied kept their versions."""

    def __init__(self, buf: Buffer, enc: Encoded, step: int, views: list[torch.Tensor],
                 part: list[int]) -> None:
        self.buf, self.enc, self.step, self.pid = buf, enc, step, os.getpid()
        background = set(part)
        now = [i for i in range(len(enc.tensors)) if i not in background]
        if now:
            copy_into([views[i] for i in now], [enc.tensors[i] for i in now],
                      sum(enc.tensors[i].nbytes for i in now), True)
        src = [enc.tensors[i] for i in part]
        self._sources, self._versions = src, [t._version for t in src]
        self.nbytes = sum(t.nbytes for t in src)
        dst = [views[i] for i in part]
        try:
            self._future: Future[None] = _executor().submit(copy_into, dst, src, self.nbytes, True,
                                                            False)
        except RuntimeError:  # the interpreter is exiting (a snapshot taken at exit): copy now
            copy_into(dst, src, self.nbytes, True)
            self._future = Future()
            self._future.set_result(None)

    def wait(self) -> None:
        self._future.result()  # the copy's error, if any

    def changed(self) -> int:
        """How many of the copied tensors changed since the copy started (0: none)."""
        return sum(t._version != v for t, v in zip(self._sources, self._versions))
