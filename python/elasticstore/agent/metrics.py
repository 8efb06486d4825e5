"""Prometheus metrics of one agent (``elasticstore-run --metrics-port``), through
``prometheus-client`` (the ``metrics`` extra), on a registry of its own.

=========================================================== ========= ================================
name                                                        type      meaning
=========================================================== ========= ================================
elasticstore_rounds_total                                   counter   rounds this agent took part in
elasticstore_rendezvous_duration_seconds                    histogram join to ranks, per round
elasticstore_restarts_total{cause}                          counter   new rounds after the first, by
                                                                      cause (worker_failure,
                                                                      node_lost, node_joined)
elasticstore_worker_exits_total{code}                       counter   worker exits by exit code or
                                                                      signal name
elasticstore_recovery_seconds                               histogram end of a round to the next
                                                                      round's workers
elasticstore_world_size                                     gauge     workers in the current round
elasticstore_worker_step{rank}                              gauge     steps beaten by each local rank
                                                                      (with heartbeats)
elasticstore_worker_step_seconds{rank}                      gauge     its median step time (last 8
                                                                      beats)
elasticstore_worker_work_seconds{rank}                      gauge     its median time in sections per
                                                                      step (the straggler measure)
elasticstore_worker_heartbeat_age_seconds{rank}             gauge     time since its last beat
elasticstore_store_client_calls_total{backend,op,outcome}   counter   store client calls by backend
                                                                      (native, etcd), operation (set,
                                                                      get, add, compare_set, wait,
                                                                      watch, ..., connect) and outcome
                                                                      (ok, timeout, network, error)
elasticstore_store_client_call_seconds{backend,op}          histogram their latency (buckets: 50 us to
                                                                      60 s)
elasticstore_snapshot_checkpoints_skipped_total{local_rank} counter   disk checkpoints a local
                                                                      rank's workers skipped: the
                                                                      disk was slower than
                                                                      checkpoint_every steps
=========================================================== ========= ================================

The store client's series are read at scrape time from
:func:`elasticstore.client_call_stats` (every store of the agent's process: the rendezvous's and
any other); an operation appears once it was called. The worker series cover this node's ranks
and are refreshed every 5 s. There is no straggler series: ``elasticstore status`` marks a rank
whose measure is at least 1.5x the median of the *other* ranks' and 5 ms longer
(``ops/stragglers.py``), and PromQL has no median of the others. The simple query against the
median of all ranks, ``elasticstore_worker_work_seconds > 1.5 * scalar(quantile(0.5,
elasticstore_worker_work_seconds))``, is stricter than that rule (a slow rank raises the median it
is compared with) and misses the two-rank case: the median of two ranks is their mean, so it
flags a rank only when it is more than 3x as slow as its peer, where ``elasticstore status``
marks 1.5x. For two ranks, compare with the other, ``elasticstore_worker_work_seconds > 1.5 *
scalar(min(elasticstore_worker_work_seconds))``; for any size, ``elasticstore status`` is the
reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..stores.call_stats import CLIENT_CALL_BUCKETS, client_call_stats

__all__ = ["AgentMetrics"]

_WORKER_GAUGES = {
    "step": "Steps beaten by the rank (elasticstore.train.heartbeat)",
    "step_seconds": "The rank's median step time over its last 8 beats",
    "work_seconds": "The rank's median time in sections per step (elasticstore.train.section)",
    "heartbeat_age_seconds": "Time since the rank's last beat",
}
_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class AgentMetrics:
    def __init__(self, port: int, addr: str = "127.0.0.1") -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            raise RuntimeError("--metrics-port needs prometheus-client: pip install "
                               "'elasticstore[metrics]'") from None
        self.registry = reg = prom.CollectorRegistry()
        self._rounds = prom.Counter("elasticstore_rounds", "Rounds this agent took part in",
                                    registry=reg)
        self._rdzv = prom.Histogram("elasticstore_rendezvous_duration_seconds",
                                    "Rendezvous: join to ranks", buckets=_BUCKETS, registry=reg)
        self._restarts = prom.Counter("elasticstore_restarts", "New rounds after the first",
                                      ["cause"], registry=reg)
        self._exits = prom.Counter("elasticstore_worker_exits", "Worker exits",
                                   ["code"], registry=reg)
        self._recover = prom.Histogram("elasticstore_recovery_seconds",
                                       "End of a round to the next round's workers started",
                                       buckets=_BUCKETS, registry=reg)
        self._world = prom.Gauge("elasticstore_world_size", "Workers in the current round",
                                 registry=reg)
        self._worker = {name: prom.Gauge(f"elasticstore_worker_{name}", text, ["rank"], registry=reg)
                        for name, text in _WORKER_GAUGES.items()}
        for cause in ("worker_failure", "node_lost", "node_joined"):
            self._restarts.labels(cause)
        reg.register(_StoreClientCollector())
        self._skipped = _SkippedCheckpoints()
        reg.register(self._skipped)
        self._server: Any = prom.start_http_server(port, addr=addr, registry=reg)

    def round(self, rendezvous_seconds: float, world_size: int) -> None:
        self._rounds.inc()
        self._rdzv.observe(rendezvous_seconds)
        self._world.set(world_size)

    def restart(self, cause: str, recover_seconds: float | None) -> None:
        self._restarts.labels(cause).inc()
        if recover_seconds is not None:
            self._recover.observe(recover_seconds)

    def ranks(self, report: dict[str, dict[str, Any]]) -> None:
        """This node's beating ranks (``hangs.HangWatch.report_due``); old ranks are dropped."""
        for gauge in self._worker.values():
            gauge.clear()
        for rank, r in report.items():
            for name, key in (("step", "step"), ("step_seconds", "step_seconds"),
                              ("work_seconds", "work_seconds"),
                              ("heartbeat_age_seconds", "silent_seconds")):
                if r.get(key) is not None:
                    self._worker[name].labels(rank).set(r[key])

    def snapshot_area(self, path: str | None) -> None:
        """The agent's snapshot directory (``snapshots.py``), read at scrape time."""
        self._skipped.path = path

    def worker_exit(self, code: str) -> None:
        self._exits.labels(code).inc()

    def close(self) -> None:
        server = self._server
        if isinstance(server, tuple):  # prometheus-client >= 0.17: (server, thread)
            server[0].shutdown()
            server[0].server_close()


class _SkippedCheckpoints:
    """The disk checkpoints skipped by this node's workers (``snapshots.skipped_checkpoints``)."""

    def __init__(self) -> None:
        self.path: str | None = None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        from .snapshots import skipped_checkpoints

        family = CounterMetricFamily("elasticstore_snapshot_checkpoints_skipped",
                                     "Disk checkpoints skipped because the disk lagged (the writer "
                                     "wrote a newer step)", labels=["local_rank"])
        for local_rank, n in sorted(skipped_checkpoints(self.path).items()):
            family.add_metric([str(local_rank)], n)
        yield family

    def describe(self) -> list[Any]:
        return []


class _StoreClientCollector:
    """The store client's counters (:func:`elasticstore.client_call_stats`), read per scrape."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        calls = CounterMetricFamily("elasticstore_store_client_calls",
                                    "Store client calls by backend, operation and outcome",
                                    labels=["backend", "op", "outcome"])
        latency = HistogramMetricFamily("elasticstore_store_client_call_seconds",
                                        "Store client call latency", labels=["backend", "op"])
        bounds = [floatToGoString(b) for b in CLIENT_CALL_BUCKETS] + ["+Inf"]
        for s in client_call_stats():
            for outcome, n in s.calls.items():
                calls.add_metric([s.backend, s.op, outcome], n)
            cumulative, total = [], 0
            for bound, n in zip(bounds, s.buckets):
                total += n
                cumulative.append((bound, total))
            latency.add_metric([s.backend, s.op], cumulative, s.seconds)
        yield calls
        yield latency

    def describe(self) -> list[Any]:
        return []  # no fixed series: the registry does not check these names for clashes
