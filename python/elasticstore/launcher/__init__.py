"""torch's Python launch API on elasticstore's agent: ``from elasticstore.launcher import
LaunchConfig, elastic_launch`` in place of ``from torch.distributed.launcher.api import ...``.

The names load on first use (``api.py``), so a worker (``launcher.worker``) does not import the
agent."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import LaunchConfig, elastic_launch, launch_agent

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
