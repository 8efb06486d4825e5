"""The rendezvous: torch's ``RendezvousHandler`` on the native store, on etcd v3, or static.

torchrun finds the handlers through the ``torchrun.handlers`` entry points ``elasticstore``,
``elasticstore-etcd`` and ``elasticstore-static`` (``plugin.py``). See ``docs/rendezvous.md``.
"""

from __future__ import annotations

from .handler import ElasticRendezvousHandler
from .plugin import create_etcd_handler, create_native_handler, create_static_handler
from .resolve import RendezvousNameError
from .settings import RendezvousSettings, settings_from_params
from .state import RoundState

__all__ = [
    "ElasticRendezvousHandler",
    "RendezvousNameError",
    "RendezvousSettings",
    "RoundState",
    "create_etcd_handler",
    "create_native_handler",
    "create_static_handler",
    "settings_from_params",
]
