"""``elasticstore metrics``: the store server's counters (``Store.stats()``, from the Python
server or ``elasticstore-server`` alike) as Prometheus text, read at every scrape through
``prometheus-client`` (the ``metrics`` extra). Metric names are ``elasticstore_server_<counter>``
(gauges; ``elasticstore_server_up`` is 0 while the server does not answer)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

__all__ = ["serve_server_metrics", "serve_stats_metrics"]


def _remote_stats(host: str, port: int, timeout: float) -> Callable[[], dict[str, int]]:
    """Reads a server's counters over one connection, made again after a failure."""
    from ..stores.native.store import Store

    wait = timedelta(seconds=timeout)
    held: list[Store] = []

    def stats() -> dict[str, int]:
        try:
            if not held:
                held.append(Store(host, port, timeout=wait, connect_timeout=wait))
            return held[0].stats()
        except Exception:
            if held:
                held.pop().close()
            raise

    return stats


def _collector(read_stats: Callable[[], dict[str, int]]) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    class ServerCollector:
        def collect(self) -> Iterator[GaugeMetricFamily]:
            try:
                stats = read_stats()
            except Exception:
                yield GaugeMetricFamily("elasticstore_server_up", "The server answers", value=0)
                return
            yield GaugeMetricFamily("elasticstore_server_up", "The server answers", value=1)
            for name, value in sorted(stats.items()):
                metric = "elasticstore_server_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)
                yield GaugeMetricFamily(metric, f"server counter {name}", value=float(value))

    return ServerCollector()


def serve_stats_metrics(read_stats: Callable[[], dict[str, int]], metrics_port: int,
                        metrics_addr: str) -> Any:
    """Serves the counters ``read_stats()`` returns at every scrape (an HTTP daemon thread);
    returns prometheus-client's server handle."""
    try:
        import prometheus_client as prom
    except ImportError:
        raise RuntimeError("metrics need prometheus-client: pip install 'elasticstore[metrics]'") from None
    registry = prom.CollectorRegistry()
    registry.register(_collector(read_stats))
    return prom.start_http_server(metrics_port, addr=metrics_addr, registry=registry)


def serve_server_metrics(host: str, port: int, metrics_port: int, metrics_addr: str,
                         timeout: float) -> Any:
    """The counters of the server at ``host:port`` (``elasticstore metrics``)."""
    return serve_stats_metrics(_remote_stats(host, port, timeout), metrics_port, metrics_addr)
