"""Keep-alive of Python stores that torch's C++ side still holds (``Store``, ``EtcdStore``).

torch holds a store through a C++ ``c10::intrusive_ptr<Store>`` whose count Python does not see:
``init_process_group(store=Store(...))`` wraps the store in a C++ ``PrefixStore`` and the caller's
temporary is dropped. pybind11 then deallocates the Python half (its instance and ``__dict__``)
while the C++ trampoline (torch's ``PythonStore``) lives on; a later C++ call (``new_group`` ->
``ProcessGroupGloo`` -> ``store->set``) finds no Python override and fails with "INTERNAL ASSERT
FAILED ... Not implemented" (pytorch/pytorch#106633, still so in torch 2.13: ``Store`` uses an
intrusive_ptr holder, so pybind11's trampoline self-life-support does not apply). torch gives no
signal of when C++ lets go.

So a store's ``__del__`` calls :func:`park`: when C++ still holds the store (its intrusive_ptr
count, read below, is above the one reference of the Python instance's own holder), the store
resurrects itself into :data:`PARKED` (PEP 442: CPython then skips the dealloc, so pybind11 keeps
the instance registered and C++ calls keep reaching its methods). A store nobody else holds (a
dropped ``clone()``) is not parked: it is freed. A parked store is released (:func:`sweep`) once
C++ let it go (``destroy_process_group``, a dropped ``PrefixStore``): after each garbage
collection, when parked stores doubled, and before ``elasticstore://`` hosts a server (so a second
``init_process_group`` on one URL can bind its port).

Reading the count: a pybind11 instance of simple layout holds the C++ value pointer right after
the object header; ``intrusive_ptr_target`` keeps its strong count in the low 32 bits of the word
after its vtable pointer. This layout is checked once against torch itself (a probe store wrapped
in a ``PrefixStore`` must read 1, 2, 1); if the check fails, every dropped open store is parked
and never released, as before (correct, only not frugal).
(set.add/discard are atomic under the GIL: no lock, so a finalizer run by the cyclic GC at any
allocation can never deadlock on one.)
"""

from __future__ import annotations

import ctypes
import gc
import struct
import sys
from typing import Any

import torch.distributed as dist

__all__ = ["PARKED", "park", "sweep"]

PARKED: set[dist.Store] = set()  # elasticstore.Store and EtcdStore that C++ may still call

_HEAD = object.__basicsize__  # PyObject_HEAD: the pybind11 value pointer follows it
_FLAGS = _HEAD + 3 * 8 + 8  # after the simple holder union (3 pointers) and the weakrefs pointer
_SIMPLE_LAYOUT = 0b10  # pybind11 instance::simple_layout (bit 1 after `owned`)
_layout_ok: bool | None = None  # None: not probed yet
_swept_at = 0  # len(PARKED) after the last sweep


def _read_count(store: dist.Store) -> int:
    addr = id(store)
    if not ctypes.c_uint8.from_address(addr + _FLAGS).value & _SIMPLE_LAYOUT:
        return -1
    value = ctypes.c_void_p.from_address(addr + _HEAD).value
    if not value:
        return -1
    return int(ctypes.c_uint32.from_address(value + 8).value)


def _probe() -> bool:
    if sys.implementation.name != "cpython" or struct.calcsize("P") != 8 or _HEAD != 16:
        return False
    if sys.byteorder != "little" or dist.Store.__basicsize__ < _FLAGS + 1:
        return False

    class _Probe(dist.Store):
        pass

    try:
        probe = _Probe()
        alone = _read_count(probe)
        wrapper = dist.PrefixStore("elasticstore-probe", probe)
        held = _read_count(probe)
        del wrapper
        return (alone, held, _read_count(probe)) == (1, 2, 1)
    except Exception:  # another torch: park every dropped store, as before
        return False


def cpp_holders(store: dist.Store) -> int | None:
    """References to ``store`` held by C++ other than its Python instance's own; None when the
    count cannot be read here."""
    global _layout_ok
    if _layout_ok is None:
        _layout_ok = _probe()
    if not _layout_ok:
        return None
    count = _read_count(store)
    return None if count < 1 else count - 1


def park(store: dist.Store) -> bool:
    """Called by ``store.__del__``: keeps ``store`` alive (returns True) when torch's C++ side
    may still call it; False when nothing else holds it (it is then freed: the caller releases
    its resources)."""
    global _swept_at
    if cpp_holders(store) == 0:
        return False
    PARKED.add(store)  # resurrects the store
    if len(PARKED) >= max(2 * _swept_at, 64):
        sweep()
    return True


_sweeping = False


def sweep() -> int:
    """Releases the parked stores that C++ no longer holds (and nothing in Python references);
    returns how many."""
    global _sweeping, _swept_at
    if _sweeping or not PARKED:
        return 0
    _sweeping = True
    released = 0
    try:
        for store in tuple(PARKED):
            # References: PARKED, the tuple, `store`, getrefcount's argument. More: Python code
            # holds it again (e.g. PrefixStore.underlying_store) and could hand it to C++.
            if cpp_holders(store) == 0 and sys.getrefcount(store) <= 4:
                PARKED.discard(store)
                release = getattr(store, "_release_parked", None)
                if release is not None:
                    release()
                released += 1
    finally:
        _swept_at = len(PARKED)
        _sweeping = False
    return released


def _after_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "stop" and PARKED and not _sweeping:
        sweep()


gc.callbacks.append(_after_gc)
