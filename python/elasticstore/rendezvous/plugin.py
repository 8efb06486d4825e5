"""torchrun's entry points (group ``torchrun.handlers``), one per row of ``registry.py``:
``elasticstore``, ``elasticstore-etcd`` and ``elasticstore-static``.

torch loads them while its own ``torch.distributed.elastic.rendezvous`` package is being imported
(possibly because ``elasticstore.rendezvous`` is): so this module imports nothing at load time,
and each creator imports its backend when called. Each plugin returns the same creator object
every time (torch's registry refuses a second, different creator under one name). The entry
point names a row's ``plugin`` attribute of this module (``native_plugin``, ...).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = [
    "create_etcd_handler", "create_handler", "create_native_handler", "create_static_handler",
    "etcd_plugin", "native_plugin", "static_plugin",
]

Creator = Callable[["RendezvousParameters"], "RendezvousHandler"]


def create_handler(backend: str, params: RendezvousParameters) -> RendezvousHandler:
    """The handler of backend ``backend`` (any of its names) for torch's parameters, parsed by
    the same function as ``elasticstore-run``'s flags."""
    from .registry import backend as row_of

    row = row_of(backend)
    settings = row.settings(
        run_id=params.run_id, endpoint=params.endpoint, min_nodes=params.min_nodes,
        max_nodes=params.max_nodes, local_addr=params.local_addr, config=params.config)
    for notice in settings.notices:  # torch's --rdzv-conf keys that mean nothing here
        logging.getLogger(__name__).warning("%s", notice)
    handler: RendezvousHandler = row.create_handler(settings)
    return handler


def create_native_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``elasticstore`` backend: the rendezvous on a native elasticstore server."""
    return create_handler("elasticstore", params)


def create_etcd_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``elasticstore-etcd`` backend: the rendezvous on etcd v3 (``elasticstore[etcd]``).
    ``--rdzv-endpoint`` may list several members, comma-separated."""
    return create_handler("elasticstore-etcd", params)


def create_static_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Fixed ranks (``rank`` from ``--node-rank``); rank 0 hosts a native server."""
    return create_handler("elasticstore-static", params)


_CREATORS: dict[str, Creator] = {}


def _creator(name: str) -> Creator:
    """One creator object per backend, made once."""
    if name not in _CREATORS:
        def create(params: RendezvousParameters) -> RendezvousHandler:
            return create_handler(name, params)

        create.__name__ = create.__qualname__ = f"create_{name.replace('-', '_')}_handler"
        _CREATORS[name] = create
    return _CREATORS[name]


def __getattr__(attr: str) -> Callable[[], Creator]:
    """A row's entry point (its ``plugin`` attribute): a zero-argument callable returning the
    backend's creator, as torchrun's ``torchrun.handlers`` group expects."""
    from .registry import BACKENDS

    for row in BACKENDS:
        if row.plugin == attr:
            return lambda: _creator(row.name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


if TYPE_CHECKING:  # the rows' entry points, as type checkers see them
    def native_plugin() -> Creator: ...
    def etcd_plugin() -> Creator: ...
    def static_plugin() -> Creator: ...
