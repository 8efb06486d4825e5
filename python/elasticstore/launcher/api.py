"""``LaunchConfig`` and ``elastic_launch`` with torch's signature, field names and results, run by
elasticstore's agent (warm start, heartbeats, snapshots, its rendezvous backends).

``elastic_launch(config, entrypoint)(*args)`` starts ``config.nproc_per_node`` workers on this
node and returns ``{global rank: return value}`` of this node's workers (``None`` for a command),
or raises torch's ``ChildFailedError`` when the restarts are spent. The config becomes the flags of
``elasticstore-run`` (parsed by the same ``run.parse``): ``rdzv_backend`` ``c10d``, ``etcd``,
``static`` run elasticstore's backends as the command line does.

A function entrypoint is pickled with its arguments (and what ``multiprocessing``'s spawn start
method hands a child, so functions of the caller's own script unpickle) into a private temporary
directory; each worker runs ``elasticstore.launcher.worker``, forked warm by the fork server
(``start_method`` ``forkserver``, the default here, or ``fork``) or as a fresh interpreter
(``spawn``), and writes its return value back there.

What differs from torch's: ``start_method`` defaults to ``forkserver`` (warm start; torch's
``spawn`` starts fresh interpreters); ``logs_specs``: torch's ``DefaultLogsSpecs`` gives its log
directory torchrun's layout (``--log-layout torchrun``), any other ``LogsSpecs`` places each
worker's files by its ``reify`` each round, as ``elasticstore-run --logs-specs`` (``agent/logspecs.py``);
``numa_options`` is ``--numa-binding`` (set only when given: torch's sets a default with one CUDA
device per worker); ``metrics_cfg`` is refused when set.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousInfo

from .. import run
from ..agent.agent import Agent
from ..agent.failures import Failure
from ..agent.forkclient import ForkServer
from ..agent.logs import say
from ..agent.platforms import PlatformHooks

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]

WORKER_MODULE = "elasticstore.launcher.worker"


@dataclass
class LaunchConfig:
    """torch's ``torch.distributed.launcher.api.LaunchConfig``, field for field."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: Any = None  # a torch LogsSpecs, or None: no log files
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "etcd"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "forkserver"  # torch's default: spawn (no warm start)
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: int | None = None

    def __post_init__(self) -> None:
        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        elif "timeout" not in self.rdzv_configs:
            self.rdzv_configs["timeout"] = 900
        if self.shutdown_timeout is None:
            self.shutdown_timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
        elif self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}")
        if self.metrics_cfg:
            raise ValueError("LaunchConfig.metrics_cfg: not supported by elasticstore's launcher "
                             "(torch's metrics handlers; elasticstore-run serves --metrics-port)")


class elastic_launch:  # noqa: N801 (torch's name)
    """``elastic_launch(config, entrypoint)(*args)``: as torch's (a function or a command)."""

    def __init__(self, config: LaunchConfig, entrypoint: Callable[..., Any] | str | None) -> None:
        self._config = config
        self._entrypoint = entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args))


def _entrypoint_name(entrypoint: Callable[..., Any] | str | None, args: list[Any]) -> str:
    if callable(entrypoint):
        return str(getattr(entrypoint, "__name__", repr(entrypoint)))
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            return next((str(a) for a in args if not str(a).startswith("-")), "")
        return entrypoint
    return ""


def _std(value: Any) -> str:
    """torch's ``Std`` or ``{local rank: Std}`` as the value of ``-r``/``-t``."""
    def bits(v: Any) -> int:
        return int(v.value if hasattr(v, "value") else v)

    if isinstance(value, dict):
        return ",".join(f"{k}:{bits(v)}" for k, v in value.items()) or "0"
    return str(bits(value))


def _custom(specs: Any) -> Any:
    """A ``LogsSpecs`` other than torch's ``DefaultLogsSpecs`` (None for that one, or none)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsSpecs

    if specs is None or type(specs) is DefaultLogsSpecs:
        return None
    if not isinstance(specs, LogsSpecs):
        raise ValueError(f"LaunchConfig.logs_specs: {type(specs).__name__} is not a torch LogsSpecs")
    return specs


def _log_flags(specs: Any) -> list[str]:
    if _custom(specs) is not None:
        return []  # its reify places the files (launch_agent)
    if specs is None:
        return []
    flags = ["--log-layout", "torchrun", "-r", _std(specs._redirects), "-t", _std(specs._tee)]
    if specs.root_log_dir != os.devnull:
        flags += ["--log-dir", specs.root_log_dir]
    if specs._local_ranks_filter:
        flags += ["--local-ranks-filter", ",".join(str(r) for r in sorted(specs._local_ranks_filter))]
    return flags


def _command(entrypoint: str, args: list[str]) -> list[str]:
    """A command entrypoint: ``sys.executable [-u] script.py ...`` or ``[-u] -m mod ...`` runs as
    a script or module (warm start), anything else as an executable (``--no-python``)."""
    if entrypoint == sys.executable:
        rest = args[1:] if args[:1] == ["-u"] else args
        if rest[:1] == ["-m"] and len(rest) > 1:
            return ["-m", *rest[1:]]
        if rest and not rest[0].startswith("-"):
            return rest
    return ["--no-python", entrypoint, *args]


def _argv(c: LaunchConfig, entry: list[str]) -> list[str]:
    argv = ["--nnodes", f"{c.min_nodes}:{c.max_nodes}", "--nproc-per-node", str(c.nproc_per_node),
            "--rdzv-backend", c.rdzv_backend, "--rdzv-endpoint", c.rdzv_endpoint,
            "--rdzv-id", c.run_id, "--role", c.role, "--max-restarts", str(c.max_restarts),
            "--monitor-interval", str(c.monitor_interval), "--start-method", c.start_method,
            "--event-log-handler", c.event_log_handler, "--signals-to-handle", c.signals_to_handle,
            "--shutdown-timeout", str(c.shutdown_timeout)]
    if c.rdzv_configs:
        argv += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in c.rdzv_configs.items())]
    if c.local_addr:
        argv += ["--local-addr", c.local_addr]
    if c.virtual_local_rank:
        argv.append("--virtual-local-rank")
    for stream, filters in (("stdout", c.duplicate_stdout_filters),
                            ("stderr", c.duplicate_stderr_filters)):
        if filters:  # torchrun's comma-separated list, ",," a comma within a filter
            argv += [f"--duplicate-{stream}-filters", ",".join(f.replace(",", ",,") for f in filters)]
    if c.numa_options is not None:  # torch's NumaOptions: its affinity mode is --numa-binding's
        argv += ["--numa-binding", str(getattr(c.numa_options.affinity_mode, "value",
                                               c.numa_options.affinity_mode))]
    return argv + _log_flags(c.logs_specs) + entry


def _write_payload(work: str, fn: Callable[..., Any], args: list[Any]) -> str:
    from multiprocessing import spawn

    path = os.path.join(work, "payload.pkl")
    prep = spawn.get_preparation_data("elasticstore-worker")
    prep.pop("authkey", None)  # multiprocessing's own secret: not needed, not to be written
    payload = {"prep": prep, "call": pickle.dumps((fn, tuple(args)))}
    with open(path, "wb") as f:
        pickle.dump(payload, f)
    return path


def _results(results: str) -> dict[int, Any]:
    """The return values of the last round's workers (``<attempt>.<rank>.result``)."""
    found: dict[int, dict[int, str]] = {}
    for name in os.listdir(results):
        parts = name.split(".")
        if len(parts) == 3 and parts[2] == "result" and parts[0].isdigit() and parts[1].isdigit():
            found.setdefault(int(parts[0]), {})[int(parts[1])] = os.path.join(results, name)
    if not found:
        return {}
    values = {}
    for rank, path in sorted(found[max(found)].items()):
        with open(path, "rb") as f:
            values[rank] = pickle.load(f)
    return values


def launch_agent(config: LaunchConfig, entrypoint: Callable[..., Any] | str | None,
                 args: list[Any]) -> dict[int, Any]:
    """torch's ``launch_agent``: runs this node's agent to the end of the job."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    if entrypoint is None:
        raise ValueError("elastic_launch: no entrypoint (a function or a command)")
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    name = _entrypoint_name(entrypoint, args)
    work = tempfile.mkdtemp(prefix="elasticstore_launch_")
    try:
        if callable(entrypoint):
            entry = ["-m", WORKER_MODULE, _write_payload(work, entrypoint, args), work]
        else:
            entry = _command(entrypoint, [str(a) for a in args])
        environ = {k: v for k, v in os.environ.items()
                   if not k.startswith("PET_") and k != "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"}
        rs = run.parse(_argv(config, entry), environ)
        settings = dataclasses.replace(rs.agent, extra_env=(), logs_specs=_custom(config.logs_specs),
                                       log_line_prefix_template=config.log_line_prefix_template)
        for notice in rs.notices:
            say(f"[elasticstore.launcher] {notice}")
        handler = run.make_handler(rs)
        agent = _Agent(settings, handler,
                       server_factory=functools.partial(ForkServer, learn=settings.preload_imports))
        if settings.event_log_handler != "null":
            from ..agent.events import route_torch_events

            route_torch_events(agent.events, settings.event_log_handler)
        code = agent.run()
        if code == 0:
            return _results(work) if callable(entrypoint) else dict.fromkeys(agent.ranks)
        failures = {f.rank: ProcessFailure(local_rank=f.local_rank, pid=f.pid, exitcode=f.exit_code,
                                           error_file=f.error_file or "")
                    for f in agent.failures}
        if failures:
            raise ChildFailedError(name=name, failures=failures)
        if code > 128:
            from torch.distributed.elastic.multiprocessing.api import SignalException

            sig = signal.Signals(code - 128)
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        raise RuntimeError(f"elastic_launch: the agent ended with exit code {code} (its reason "
                           "is on stderr)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _Agent(Agent):
    """The agent, remembering this node's ranks in the last round and its failures."""

    ranks: list[int] = []
    # The workers that failed when the agent noticed (or the hung one), without those it then
    # stopped: torch's ChildFailedError names only these.
    failures: list[Failure] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._platform = PlatformHooks(error_file=False)  # as torch's: the caller's @record writes it

    def _start(self, info: RendezvousInfo, attempt: int, base: int, world: int) -> None:
        super()._start(info, attempt, base, world)
        self.ranks = list(range(base, base + self.s.nproc))

    def _failed(self, what: str, worker: Any) -> tuple[str, Any]:
        outcome = super()._failed(what, worker)
        self.failures = list(self._failures)
        return outcome

    def _hung(self, hang: Any) -> tuple[str, Any]:
        outcome = super()._hung(hang)
        self.failures = list(self._failures)
        return outcome
