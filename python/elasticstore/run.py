"""``elasticstore-run`` (also ``python -m elasticstore.run``): a drop-in for torchrun 2.13.

torchrun's flags with the same defaults and meaning, dashed and underscored spellings, and the
``PET_<FLAG>`` environment fallback, abbreviated long flags as torchrun's parser takes them.
Without ``--rdzv-backend``, torchrun's choice for the command line: ``static`` (node rank 0 hosts
the store at ``--master-addr:--master-port``) for a fixed ``--nnodes``, standalone for one node
without ``--master-port``, ``static`` at ``--rdzv-endpoint`` with ``--node-rank``, ours
(``elasticstore``) with ``--rdzv-endpoint`` alone or a range of nodes (``etcd`` is ours on etcd
v3; ``c10d`` and ``etcd-v2`` map to ours with a notice);
``--start-method`` defaults to ``forkserver`` (warm start: workers forked from a
process with torch imported, and with the third-party packages the previous round's workers
imported unless ``--no-preload-imports``; ``spawn`` starts plain processes). torchrun's flags that
cannot be given their meaning here (``runflags.UNSUPPORTED``) are refused with the reason, by flag
or ``PET_*``. A bad value exits with code 2 and one line naming the flag and the reason;
``--rdzv-conf`` is parsed into the rendezvous settings here too (a bad key or value names the
key), before the banner and before anything starts. The flags themselves (spellings, defaults,
``PET_*``): ``runflags.py``; backend names: ``rendezvous/registry.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .agent.config import AgentSettings
from .agent.forkclient import ForkServer
from .agent.healthflags import health_settings
from .agent.logs import parse_std
from .agent.logspecs import build
from . import schedulers
from .rendezvous import registry
from .rendezvous.settings import RendezvousSettings, SettingsError, parse_endpoint
from .runflags import UNSUPPORTED, UsageError, parser
from .runvalues import (comma_list, fork_server_value, int_value, log_level, nnodes_value, nproc_value,
                        numa_value, rdzv_conf_value, signals_value, timeout_value,
                        virtual_local_rank)

__all__ = ["RunSettings", "UsageError", "main", "main_exit", "parse", "parser"]

# Every --rdzv-backend name -> the backend's short name (its label in the registry).
BACKENDS = {name: registry.backend(name).label for name in registry.names()}


@dataclass(frozen=True)
class RunSettings:
    """Everything the launcher needs, parsed once."""

    agent: AgentSettings
    backend: str  # the backend's label: elasticstore, etcd or static
    endpoint: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None
    rdzv_conf: tuple[tuple[str, str], ...]  # --rdzv-conf as given (plus the launcher's keys)
    notices: tuple[str, ...]
    rendezvous: RendezvousSettings  # rdzv_conf and the flags above, parsed and checked
    log_level: int | None = None  # LOGLEVEL: the launcher's own log records shown from it
    # ELASTICSTORE_FORK_SERVER: the warm fork server is a copy of the launcher ("forked", True)
    # or a fresh interpreter that imports torch itself ("fresh")
    fork_server: bool = True

    @property
    def backend_row(self) -> registry.Backend:
        return registry.backend(self.backend)


def _rendezvous(row: registry.Backend, run_id: str, endpoint: str, min_nodes: int,
                max_nodes: int, local_addr: str | None,
                conf: tuple[tuple[str, str], ...]) -> RendezvousSettings:
    """The rendezvous settings, parsed once (the torchrun plugin path parses the same way); a
    bad key or value is a usage error naming the flag and the key."""
    try:
        return row.settings(run_id=run_id, endpoint=endpoint, min_nodes=min_nodes,
                            max_nodes=max_nodes, local_addr=local_addr, config=dict(conf))
    except SettingsError as exc:
        reason = str(exc)
        for prefix in ("rdzv-conf: ", "rdzv-conf ", "rdzv endpoint "):
            reason = reason.removeprefix(prefix)
        raise UsageError(exc.flag, reason) from None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _default_backend(args: argparse.Namespace, min_nodes: int, max_nodes: int) -> str:
    """``--rdzv-backend`` as given, else torchrun's default for the command line: ``static``
    (``--master-addr:--master-port`` hosted by node rank 0) for a fixed node count, except one
    node with neither ``--rdzv-endpoint`` nor ``--master-port``, which runs standalone (as
    torchrun's c10d there); ``--rdzv-endpoint`` with ``--node-rank``: static at that endpoint
    with that rank (torchrun's static default); ours for ``--rdzv-endpoint`` without
    ``--node-rank`` (where torchrun's static would give every node rank 0) or a range of nodes."""
    if args.rdzv_backend is not None:
        return str(args.rdzv_backend)
    if args.standalone:
        return "elasticstore"
    if args.rdzv_endpoint and args.node_rank is not None:
        return "static"
    if args.rdzv_endpoint or min_nodes != max_nodes:
        return "elasticstore"
    return "elasticstore" if max_nodes == 1 and args.master_port is None else "static"


def _refused(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """torchrun's flags that cannot be given their meaning here (``runflags.UNSUPPORTED``):
    refused with the reason when given, by flag or by ``PET_<FLAG>`` (never ignored)."""
    for flag, reason in UNSUPPORTED.items():
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            var = "PET_" + flag[2:].replace("-", "_").upper()
            given = f" ({var} is set)" if var in environ else ""
            raise UsageError(flag, f"not supported by elasticstore-run{given}: {reason}")


def _show_logs(level: int, prog: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{prog}] %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("elasticstore")
    logger.setLevel(level)
    logger.addHandler(handler)


def parse(argv: Sequence[str], environ: Mapping[str, str] = os.environ,
          legacy: bool = False) -> RunSettings:
    """Flags (and ``PET_*``) -> settings; raises ``UsageError`` naming the flag."""
    args, taken = schedulers.parse_args(parser(environ, legacy=legacy), argv, environ)
    _refused(args, environ)
    notices: list[str] = taken  # what a scheduler's environment gave (schedulers/)
    min_nodes, max_nodes = nnodes_value(args.nnodes)
    backend_arg = _default_backend(args, min_nodes, max_nodes)
    try:
        row = registry.backend(backend_arg)
    except ValueError as exc:
        raise UsageError("--rdzv-backend", str(exc)) from None
    if (notice := row.notice(backend_arg)) is not None:
        notices.append(notice)
    event_log_handler = str(args.event_log_handler)
    if event_log_handler not in ("null", "console", "dynamic_rendezvous"):
        raise UsageError("--event-log-handler", f"{event_log_handler!r}: expected one of torch's "
                         "null, console, dynamic_rendezvous (torch's events for it also go to "
                         "<log-dir>/<run_id>/events.jsonl)")
    metrics_port = int_value("--metrics-port", args.metrics_port, 0) if args.metrics_port is not None else None
    if metrics_port is not None and metrics_port > 65535:
        raise UsageError("--metrics-port", f"{metrics_port} is not a port number")
    if args.start_method not in ("spawn", "fork", "forkserver"):
        raise UsageError("--start-method", f"{args.start_method!r}: expected spawn, fork or forkserver")
    backend = row.label
    nproc = nproc_value(args.nproc_per_node)
    conf = rdzv_conf_value(args.rdzv_conf)
    endpoint, run_id = str(args.rdzv_endpoint), str(args.rdzv_id)
    local_addr = args.local_addr
    master_port = int_value("--master-port", args.master_port, 1) if args.master_port is not None else 29500
    node_rank = int_value("--node-rank", args.node_rank) if args.node_rank is not None else 0
    if args.standalone or (backend == "elasticstore" and not endpoint and max_nodes == 1):
        if max_nodes != 1 and args.standalone:
            raise UsageError("--standalone", f"needs --nnodes 1, got {args.nnodes}")
        if args.standalone or run_id == "none":  # --standalone ignores --rdzv-id, as torchrun's
            run_id = uuid.uuid4().hex[:12]
        row = registry.backend("elasticstore")
        backend, endpoint = row.label, f"127.0.0.1:{_free_port('127.0.0.1')}"
        local_addr, conf = local_addr or "127.0.0.1", (*conf, ("is_host", "1"))
    if backend == "static":
        why = (" (--node-rank with --rdzv-endpoint and no --rdzv-backend: torchrun's static "
               "rendezvous at that endpoint)" if args.rdzv_backend is None and endpoint else "")
        endpoint = endpoint or f"{args.master_addr}:{master_port}"
        if min_nodes != max_nodes:
            raise UsageError("--nnodes", f"{args.nnodes}: the static backend needs a fixed count{why}")
        if node_rank >= max_nodes:
            raise UsageError("--node-rank", f"{node_rank} must be below --nnodes {max_nodes}")
        conf = (*conf, ("rank", str(node_rank)))
    elif not endpoint:
        raise UsageError("--rdzv-endpoint", f"required by the {backend} backend for --nnodes {args.nnodes}")
    elif node_rank != 0:  # as torchrun's warning, where the rank cannot be honoured
        notices.append(f"--node-rank {node_rank}: ignored by the {backend} rendezvous (only the "
                       "static one takes it); node ranks follow the order of arrival")
    rdzv = _rendezvous(row, run_id, endpoint, min_nodes, max_nodes, local_addr, conf)
    notices += rdzv.notices
    if rdzv.is_host and parse_endpoint(endpoint.split(",")[0], rdzv.port, any_port=True)[1] == 0:
        endpoint = rdzv.endpoint  # host:0 -> the free port chosen for it
    extra_env: list[tuple[str, str]] = []
    if "OMP_NUM_THREADS" not in environ and nproc > 1:
        extra_env.append(("OMP_NUM_THREADS", "1"))
        notices.append("Setting OMP_NUM_THREADS environment variable for each process to be 1 in "
                       "default, to avoid your system being overloaded, please further tune the "
                       "variable for optimal performance in your application as needed.")
    shutdown = args.shutdown_timeout or environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    try:
        monitor = float(args.monitor_interval)
        if not monitor > 0:
            raise ValueError
    except ValueError:
        raise UsageError("--monitor-interval", f"{args.monitor_interval!r} is not a positive number") from None
    ranks_filter = None
    if args.local_ranks_filter:
        ranks_filter = frozenset(int_value("--local-ranks-filter", r) for r in str(args.local_ranks_filter).split(","))
    try:
        redirects = parse_std("--redirects", str(args.redirects), nproc)
        tee = parse_std("--tee", str(args.tee), nproc)
    except ValueError as exc:
        flag, _, reason = str(exc).partition(" ")
        raise UsageError(flag, reason) from None
    logs_specs = None
    if args.logs_specs is not None:  # torchrun's: built once, with these flags (agent/logspecs.py)
        try:
            logs_specs = build(str(args.logs_specs), args.log_dir, str(args.redirects), str(args.tee),
                               ranks_filter)
        except (LookupError, ImportError, TypeError, ValueError) as exc:
            raise UsageError("--logs-specs", str(exc)) from None
        redirects = tee = {}
    if args.log_layout not in ("elasticstore", "torchrun"):
        raise UsageError("--log-layout", f"{args.log_layout!r}: expected elasticstore "
                         "(<run_id>/attempt_N/<rank>) or torchrun (<run_id>_<random>/attempt_N/<local rank>)")
    kind = "exec" if args.no_python and not args.run_path else ("module" if args.module else "script")
    if args.no_python and args.module:
        raise UsageError("--no-python", "cannot be combined with --module")
    python = environ.get("PYTHON_EXEC") or None  # torchrun's interpreter for the workers
    if python == sys.executable:
        python = None
    warm = args.start_method != "spawn" and kind != "exec"
    if python is not None and warm:
        warm = False
        notices.append(f"PYTHON_EXEC={python}: workers start as plain processes under it "
                       "(no warm start: the fork server runs this launcher's Python)")
    agent = AgentSettings(
        entrypoint=args.training_script, args=tuple(args.training_script_args), nproc=nproc,
        run_id=run_id, host=local_addr or socket.gethostname(), kind=kind,
        warm=warm, python=python,
        preload_imports=not args.no_preload_imports, role=str(args.role),
        max_restarts=int_value("--max-restarts", args.max_restarts), monitor_interval=monitor,
        shutdown_timeout=float(int_value("--shutdown-timeout", shutdown)),
        log_dir=None if logs_specs is not None else args.log_dir, logs_specs=logs_specs, redirects=redirects,
        tee=tee, local_ranks_filter=None if logs_specs is not None else ranks_filter, log_layout=str(args.log_layout),
        log_line_prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None,
        signals=signals_value(args.signals_to_handle), extra_env=tuple(extra_env),
        legacy_local_rank_arg=legacy and not args.use_env,
        event_log_handler=event_log_handler, metrics_port=metrics_port,
        metrics_addr=str(args.metrics_addr), token_file=rdzv.token_file,
        heartbeat_timeout=timeout_value("--heartbeat-timeout", args.heartbeat_timeout),
        first_heartbeat_timeout=timeout_value("--first-heartbeat-timeout", args.first_heartbeat_timeout),
        health=health_settings(args, UsageError, rdzv.join_timeout),
        virtual_local_rank=virtual_local_rank(args, environ, nproc),
        cpu_affinity=numa_value(args.numa_binding, nproc),
        duplicate_filters={stream: comma_list(value) for stream, value in (
            ("stdout", args.duplicate_stdout_filters), ("stderr", args.duplicate_stderr_filters))
            if value is not None},
    )
    return RunSettings(agent, backend, endpoint, min_nodes, max_nodes, local_addr, conf,
                       tuple(notices), rdzv, log_level(environ), fork_server_value(environ))


def make_handler(rs: RunSettings) -> Any:
    """The rendezvous handler for ``rs``, from its parsed settings (imports torch)."""
    return rs.backend_row.create_handler(rs.rendezvous)


class _FirstServerFirst:
    """The agent's fork-server factory: the server forked from this process before it started
    anything first, fresh ones after (a replacement: this process runs threads by then)."""

    def __init__(self, first: ForkServer | None, learn: bool) -> None:
        self.first, self.learn = first, learn

    def __call__(self, warm: bool) -> ForkServer:
        first, self.first = self.first, None
        if first is not None and first.preload == warm:
            return first
        if first is not None:
            first.close()
        return ForkServer(warm, learn=self.learn)

    def close(self) -> None:
        """Closes the first server if the agent never took it."""
        if self.first is not None:
            self.first.close()
            self.first = None


def run(rs: RunSettings, prog: str = "elasticstore-run") -> int:
    a = rs.agent
    # First of all, while this process has imported torch and runs nothing else: the fork server
    # is a copy of it, so a node imports torch once (forkclient.fork_refusal: when it is not).
    servers = _FirstServerFirst(
        ForkServer(True, learn=a.preload_imports, fork=rs.fork_server) if a.warm else None,
        a.preload_imports)
    try:
        return _run(rs, prog, servers)
    finally:
        servers.close()


def _run(rs: RunSettings, prog: str, servers: _FirstServerFirst) -> int:
    if rs.log_level is not None:
        _show_logs(rs.log_level, prog)
    if servers.first is not None:
        logging.getLogger("elasticstore.run").info(
            "fork server: %s", "a copy of this launcher (torch imported once on this node)"
            if servers.first.origin == "forked" else f"a fresh interpreter ({servers.first.origin[7:]})")
    for notice in rs.notices:
        print(f"[{prog}] {notice}", file=sys.stderr, flush=True)
    a = rs.agent
    print(f"[{prog}] job {a.run_id}: {rs.min_nodes}:{rs.max_nodes} node(s) x {a.nproc} worker(s), "
          f"rendezvous {rs.backend} at {rs.endpoint}, {'warm start' if a.warm else 'plain processes'}, "
          f"max restarts {a.max_restarts}; this node {a.host}", file=sys.stderr, flush=True)
    from .agent import Agent

    try:
        handler = make_handler(rs)
    except Exception as exc:
        print(f"[{prog}] rendezvous: {exc}", file=sys.stderr, flush=True)
        return 1
    metrics = None
    if a.metrics_port is not None:
        from .agent.metrics import AgentMetrics

        try:
            metrics = AgentMetrics(a.metrics_port, a.metrics_addr)
        except (RuntimeError, OSError) as exc:
            print(f"[{prog}] --metrics-port: {exc}", file=sys.stderr, flush=True)
            handler.shutdown()
            return 1
    try:
        agent = Agent(a, handler, metrics=metrics, server_factory=servers)
    except OSError as exc:  # the log directory (events.jsonl) refused or unwritable
        print(f"[{prog}] {exc}", file=sys.stderr, flush=True)
        handler.shutdown()
        if metrics is not None:
            metrics.close()
        return 1
    if a.event_log_handler != "null":
        from .agent.events import route_torch_events

        route_torch_events(agent.events, a.event_log_handler)
    try:
        return agent.run()
    finally:
        if metrics is not None:
            metrics.close()


def main(argv: Sequence[str] | None = None, legacy: bool = False, prog: str = "elasticstore-run") -> int:
    try:
        rs = parse(sys.argv[1:] if argv is None else argv, os.environ, legacy)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return schedulers.finish(run(rs, prog), os.environ, prog)  # e.g. a preempted Slurm job requeued


def main_exit() -> None:
    """The console script."""
    sys.exit(main())


if __name__ == "__main__":
    main_exit()
