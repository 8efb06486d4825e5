"""``elasticstore metrics``: the store server's counters (``Store.stats()``, from the Python
server or ``elasticstore-server`` alike) as Prometheus text, read at every scrape through
``prometheus-client`` (the ``metrics`` extra). Metric names are ``elasticstore_server_<counter>``
(gauges; ``elasticstore_server_up`` is 0 while the server does not answer)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

__all__ = ["serve_server_metrics"]


def _collector(host: str, port: int, timeout: float) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    from ..store import Store

    class ServerCollector:
        def __init__(self) -> None:
            self._store: Store | None = None

        def collect(self) -> Iterator[GaugeMetricFamily]:
            wait = timedelta(seconds=timeout)
            try:
                if self._store is None:
                    self._store = Store(host, port, timeout=wait, connect_timeout=wait)
                stats = self._store.stats()
            except Exception:
                if self._store is not None:
                    self._store.close()
                self._store = None
                yield GaugeMetricFamily("elasticstore_server_up", "The server answers", value=0)
                return
            yield GaugeMetricFamily("elasticstore_server_up", "The server answers", value=1)
            for name, value in sorted(stats.items()):
                metric = "elasticstore_server_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)
                yield GaugeMetricFamily(metric, f"server counter {name}", value=float(value))

    return ServerCollector()


def serve_server_metrics(host: str, port: int, metrics_port: int, metrics_addr: str,
                         timeout: float) -> Any:
    """Starts the HTTP endpoint (a daemon thread); returns prometheus-client's server handle."""
    try:
        import prometheus_client as prom
    except ImportError:
        raise RuntimeError("metrics need prometheus-client: pip install 'elasticstore[metrics]'") from None
    registry = prom.CollectorRegistry()
    registry.register(_collector(host, port, timeout))
    return prom.start_http_server(metrics_port, addr=metrics_addr, registry=registry)
