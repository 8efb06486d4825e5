"""A package's public names loaded on first use (PEP 562): its ``__init__`` maps each name to the
submodule that defines it, so importing one submodule (or the package) does not import the rest.
Used where a submodule is light and a sibling heavy (``train``: the agent reads the heartbeat
layout, the workers' snapshot writer imports ``torch.distributed.checkpoint``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, sources: Mapping[str, str], namespace: dict[str, Any]
               ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: ``sources`` maps each public
    name to its submodule (relative, e.g. ``".writer"``); ``namespace`` is the package's
    ``globals()``, where a name is kept once loaded (later reads skip ``__getattr__``)."""

    def __getattr__(name: str) -> object:
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(sources))

    return __getattr__, __dir__
