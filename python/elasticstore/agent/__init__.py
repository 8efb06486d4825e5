"""The elastic agent: one node's worker group through rounds of the rendezvous (see
``docs/agent.md``). ``elasticstore-run`` (``run.py``) parses the flags into ``AgentSettings`` and
runs an ``Agent`` with a rendezvous handler. ``Agent`` imports torch: it is loaded on first use,
so parsing flags stays fast."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import AgentSettings
from .forkclient import ForkServer

if TYPE_CHECKING:
    from .agent import Agent

__all__ = ["Agent", "AgentSettings", "ForkServer"]


def __getattr__(name: str) -> object:
    if name == "Agent":
        from .agent import Agent

        return Agent
    raise AttributeError(f"module 'elasticstore.agent' has no attribute {name!r}")
