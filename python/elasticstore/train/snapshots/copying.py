"""Copies a snapshot's tensors into its buffer: the blocking part of ``Snapshots.snapshot``.

Small states (the usual per-step case: dozens to thousands of small tensors) are copied with one
``torch._foreach_copy_`` call: one dispatch for all of them instead of a Python call each. Large
states of CPU tensors are split across a few threads (``copy_`` releases the GIL), as many as the
worker's share of the node's cores: a worker usually runs with one intra-op thread
(``OMP_NUM_THREADS=1`` under a launcher), so torch alone copies on one core while the node's
other cores may be idle. Contiguous tensors are split into ranges of elements so that one large
tensor is shared out too. A state with tensors on an accelerator is copied one tensor at a time
(one device-to-host copy each).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

__all__ = ["PARALLEL_BYTES", "copy_into", "copy_threads"]

PARALLEL_BYTES = 8 << 20  # a state at least this large (on the CPU) is copied by several threads
_MAX_THREADS = 4  # memory bandwidth, not cores, limits a copy: a few threads reach it
_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


@functools.cache
def copy_threads() -> int:
    """Threads a large copy uses: this process's share of the cores it may run on (the cores over
    the launcher's ``LOCAL_WORLD_SIZE``: the node's workers take their snapshots at the same
    step), at most ``_MAX_THREADS``. One where the workers have a core each or less: measured on
    a loaded 2-core machine, a second thread there gained nothing."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(_MAX_THREADS, cores // local))


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():  # a forked child has no pool threads
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="elasticstore-snapshot-copy")
            _pool_pid = os.getpid()
        return _pool


def copy_into(views: list[torch.Tensor], tensors: list[torch.Tensor], nbytes: int,
              on_cpu: bool, parallel: bool = True) -> None:
    """``views[i].copy_(tensors[i])`` for every i, outside autograd (``nbytes``: their total size;
    ``on_cpu``: whether every one of ``tensors`` is on the CPU; ``parallel``: whether a large copy
    may take several threads: not a copy that runs beside the training, on a core of its own)."""
    # torch.no_grad() costs a few microseconds to enter and leave: this is every step's path
    grad = torch.is_grad_enabled()
    if grad:
        torch._C._set_grad_enabled(False)
    try:
        if not on_cpu:
            for dst, src in zip(views, tensors):
                dst.copy_(src)
        elif nbytes < PARALLEL_BYTES or not parallel or (threads := copy_threads()) == 1:
            torch._foreach_copy_(views, tensors)
        else:
            _parallel(views, tensors, nbytes, threads)
    finally:
        if grad:
            torch._C._set_grad_enabled(True)


def _parallel(views: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], nbytes: int,
              threads: int) -> None:
    parts = _split(views, tensors, nbytes, threads)
    pool = _executor(threads)
    futures = [pool.submit(_copy_part, dst, src) for dst, src in parts[1:]]
    try:
        _copy_part(*parts[0])
    finally:
        wait(futures)  # every part done before the buffer is used, whatever failed
    for f in futures:
        f.result()  # a thread's error


def _copy_part(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    with torch.no_grad():
        if dst:
            torch._foreach_copy_(dst, src)


def _split(views: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], nbytes: int,
           threads: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The copies shared out into ``threads`` parts of about equal bytes; a contiguous tensor of
    the same dtype larger than what a part still takes is cut (flat ranges of elements)."""
    share = -(-nbytes // threads)
    parts: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(threads)]
    part, room = 0, share
    for dst, src in zip(views, tensors):
        size = src.numel() * src.element_size()
        if size <= room or part == threads - 1 or not _cuttable(dst, src):
            parts[part][0].append(dst)
            parts[part][1].append(src)
            room -= size
        else:
            flat_dst, flat_src = dst.view(-1), src.view(-1)
            item, start, n = src.element_size(), 0, src.numel()
            while start < n:
                take = n - start if part == threads - 1 else min(n - start, max(1, room // item))
                parts[part][0].append(flat_dst[start:start + take])
                parts[part][1].append(flat_src[start:start + take])
                start += take
                room -= take * item
                if room <= 0 and part < threads - 1:
                    part, room = part + 1, share
            continue
        if room <= 0 and part < threads - 1:
            part, room = part + 1, share
    return parts


def _cuttable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype
