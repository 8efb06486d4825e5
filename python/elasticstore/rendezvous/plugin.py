"""torchrun's entry points (group ``torchrun.handlers``): ``elasticstore``,
``elasticstore-etcd`` and ``elasticstore-static``.

torch loads them while its own ``torch.distributed.elastic.rendezvous`` package is being imported
(possibly because ``elasticstore.rendezvous`` is): so this module imports nothing at load time,
and each creator imports its backend when called. Each plugin returns the same creator object
every time (torch's registry refuses a second, different creator under one name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = [
    "create_etcd_handler", "create_native_handler", "create_static_handler",
    "etcd_plugin", "native_plugin", "static_plugin",
]


def create_native_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``elasticstore`` backend: the rendezvous on a native elasticstore server."""
    from .handler import ElasticRendezvousHandler
    from .native import create_native_backend
    from .settings import settings_from_params

    settings = settings_from_params(params)
    return ElasticRendezvousHandler(create_native_backend(settings), settings)


def create_etcd_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``elasticstore-etcd`` backend: the rendezvous on etcd v3 (``elasticstore[etcd]``).
    ``--rdzv-endpoint`` may list several members, comma-separated."""
    from .etcd import create_etcd_backend
    from .handler import ElasticRendezvousHandler
    from .settings import settings_from_params

    settings = settings_from_params(params, default_port=2379, endpoint=params.endpoint.split(",")[0])
    return ElasticRendezvousHandler(create_etcd_backend(settings, params.endpoint), settings)


def create_static_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Fixed ranks (``rank`` from ``--node-rank``); rank 0 hosts a native server."""
    from .settings import settings_from_params
    from .static import StaticRendezvousHandler

    return StaticRendezvousHandler(settings_from_params(params))


Creator = Callable[["RendezvousParameters"], "RendezvousHandler"]


def native_plugin() -> Creator:
    return create_native_handler


def etcd_plugin() -> Creator:
    return create_etcd_handler


def static_plugin() -> Creator:
    return create_static_handler
