"""What a warm worker imported, told to its fork server (``preload.py`` preloads it).

``ImportReporter`` sits first on a warm worker's ``sys.meta_path``. Third-party: a top-level
module or package that the worker found in a ``sys.path`` entry named ``site-packages`` or
``dist-packages`` (what ``pip install`` writes), and the submodules of one, also of one the
worker started with (torch: its ``distributed.fsdp``, ``distributed.checkpoint``, ...); never
the standard library, the script, a module from the script's directory or from a project
directory on ``PYTHONPATH``.

Standard library only: the fork server (run as a script) loads this file by its path.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from importlib.machinery import ModuleSpec
from typing import Any

__all__ = ["ImportReporter", "MAX_REPORT", "third_party_origin"]

SITE_DIR_NAMES = ("site-packages", "dist-packages")
MAX_REPORT = 4000  # bytes of one report line (under PIPE_BUF: written at once by any worker)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@functools.lru_cache(maxsize=8)
def _real_entries(path: tuple[str, ...], cwd: str) -> list[str]:
    """``path`` resolved (relative entries against ``cwd``): once per path, not per import."""
    return [os.path.realpath(os.path.join(cwd, p)) for p in path]


def third_party_origin(spec: ModuleSpec, path: list[str]) -> str | None:
    """Where a top-level module was found, when that is a site directory of ``path`` (else
    None): the longest ``path`` entry holding its file (or its package directories) must be named
    site-packages or dist-packages."""
    found: list[str | None] = list(spec.submodule_search_locations or []) or [spec.origin]
    locations = [loc for loc in found if isinstance(loc, str) and os.path.isabs(loc)]
    if not locations or len(locations) < len(found):
        return None  # built-in, frozen, or a finder of its own
    entries = _real_entries(tuple(p for p in path if isinstance(p, str)), os.getcwd())
    for loc in locations:
        real = os.path.realpath(loc)
        holders = [e for e in entries if _within(real, e)]
        if not holders or os.path.basename(max(holders, key=len)) not in SITE_DIR_NAMES:
            return None
    return os.path.realpath(locations[0])


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class ImportReporter:
    """First on a warm worker's ``sys.meta_path``: for each module the worker imports, finds its
    spec through the finders after it (as the import system would, and returns that spec); a
    third-party top-level module is reported with its origin (``{"name", "origin"}``), and so is
    each submodule of one (``{"name"}``: packages that import their submodules lazily, as
    transformers does, are mostly submodules). One line per module on a pipe to the fork server,
    written at once (a SIGKILLed worker has reported what it imported) and never blocking: a
    full or closed pipe drops it."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._pipe = _identity(fd)
        self._third_party: set[str] = set()
        self._checked: set[str] = set()  # top-level modules imported before, looked at once

    def _loaded_third_party(self, top: str) -> bool:
        """Whether ``top`` was imported before this worker started (by the fork server: torch,
        what it preloaded) and is third-party: the submodules of it that the worker imports
        (torch.distributed.fsdp, ...) are reported too. Looked at once per package."""
        module = sys.modules.get(top)
        if module is None or top in self._checked:
            return False
        self._checked.add(top)
        spec = getattr(module, "__spec__", None)
        if spec is None or third_party_origin(spec, sys.path) is None:
            return False
        self._third_party.add(top)
        return True

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        top = name.partition(".")[0]
        if top != name and top not in self._third_party and not self._loaded_third_party(top):
            return None
        finders = sys.meta_path
        spec = None
        for finder in finders[finders.index(self) + 1:] if self in finders else []:
            find = getattr(finder, "find_spec", None)
            if find is None:
                return None  # a finder of the old kind: the import system's own way
            spec = find(name, path, target)
            if spec is not None:
                break
        if spec is None:
            return None
        report: dict[str, str] = {"name": name}
        if top == name:
            origin = third_party_origin(spec, sys.path)
            if origin is None:
                return spec
            self._third_party.add(name)
            report["origin"] = origin
        line = json.dumps(report).encode() + b"\n"
        # The script may have closed the descriptor and opened a file of its own under it.
        if len(line) <= MAX_REPORT and _identity(self._fd) == self._pipe:
            try:
                os.write(self._fd, line)
            except OSError:
                pass
        return spec
