"""gloo process groups formed on elasticstore: ``store=``, and ``init_method="elasticstore://"``
with rank 0 hosting the server or with an external ``elasticstore server``."""

from __future__ import annotations

import socket

import spawned
import pytest

from elasticstore import StoreServer

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _group(mode: str, world_size: int, addr: str) -> None:
    children = [spawned.spawn("gloo", mode, rank, world_size, addr) for rank in range(world_size)]
    results = spawned.join(children, timeout=150)
    assert results == [f"rank {rank} ok" for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_init_process_group_with_store_no_reference_kept(world_size: int) -> None:
    with StoreServer() as server:
        _group("store", world_size, server.address)


def test_init_method_rank0_hosts_the_server() -> None:
    _group("init_method", 2, f"elasticstore://127.0.0.1:{_free_port()}")


def test_init_method_external_server() -> None:
    with spawned.cli_server() as server:
        _group("init_method", 2, f"elasticstore://{server.address}?server=external")


def test_rendezvous_url_errors() -> None:
    import torch.distributed as dist

    import elasticstore  # noqa: F401  (registers the scheme)

    with pytest.raises(ValueError, match="port number missing"):
        next(dist.rendezvous("elasticstore://127.0.0.1", rank=0, world_size=1))
    with pytest.raises(ValueError, match="server="):
        next(dist.rendezvous("elasticstore://127.0.0.1:1?server=bogus", rank=0, world_size=1))
