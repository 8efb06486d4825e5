"""The agent's settings, parsed once by the launcher (``run.py``) and never changed."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AgentSettings", "DRAIN_TIMEOUT", "FIRST_HEARTBEAT_TIMEOUT", "HEALTH_CHECK_TIMEOUT",
           "HEARTBEAT_TIMEOUT", "HealthSettings", "MAX_MATMUL_MS", "parse_timeout"]

DRAIN_TIMEOUT = 120.0  # how long a store host serves, after its workers succeeded, for the others
# Hang detection (agent/hangs.py), for workers that call elasticstore.train.heartbeat() only.
# Steady state: longer than any healthy step, shorter than gloo's 30 min collective timeout.
HEARTBEAT_TIMEOUT = 600.0
# Start to the first beat: imports, data loading, compilation, a restore; NCCL's own watchdog
# (10 min) does not cover a rank that never reaches its first collective.
FIRST_HEARTBEAT_TIMEOUT = 1800.0


def parse_timeout(text: str) -> float | None:
    """Seconds for a heartbeat timeout flag; 0 or "none": off (None). Raises ValueError."""
    if text.strip().lower() in ("0", "none", "off"):
        return None
    value = float(text)
    if not 0 < value < 1e9:
        raise ValueError(f"{text!r}: expected a positive number of seconds (0: off)")
    return value


# The health check's defaults (docs/agent.md#health-checks): a warm check takes 0.1-0.5 s and a
# plain one (N fresh interpreters importing torch) 2-20 s on a loaded host, so 60 s flags only a
# check that hangs (gloo's own default timeout is 30 min), and bounds how long the others wait
# for a node whose workers just failed before it steps aside.
HEALTH_CHECK_TIMEOUT = 60.0
# A 512x512 float32 product takes 1-20 ms on one core of any healthy CPU, loaded or not: a
# median over 1 s means a node ~100x slower than it should be.
MAX_MATMUL_MS = 1000.0


@dataclass(frozen=True)
class HealthSettings:
    """``--health-check``, ``--health-check-cmd``, ``--health-check-timeout``,
    ``--health-check-max-matmul-ms`` (``healthflags.py``)."""

    enabled: bool = False
    command: str | None = None  # run with the shell instead of the default check; exit 0: healthy
    timeout: float = HEALTH_CHECK_TIMEOUT  # seconds: a check that takes longer failed
    max_matmul_ms: float = MAX_MATMUL_MS  # the default check's limit (slowest rank's median); 0: none
    matmul_size: int = 512
    matmul_reps: int = 5
    # How long a failing node keeps checking: the rendezvous' join_timeout (its default here).
    join_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"health-check-timeout {self.timeout}: must be positive")
        if self.max_matmul_ms < 0:
            raise ValueError(f"health-check-max-matmul-ms {self.max_matmul_ms}: must be >= 0")
        if not self.join_timeout > 0:
            raise ValueError(f"join_timeout {self.join_timeout}: must be positive")


@dataclass(frozen=True)
class AgentSettings:
    entrypoint: str  # the script, module or command
    args: tuple[str, ...]  # its arguments
    nproc: int
    run_id: str
    host: str  # this node's address: the console prefix and the failure summary
    kind: str = "script"  # "script", "module" or "exec" (--no-python)
    warm: bool = True  # fork workers from a fork server with torch imported
    # warm: the fork server also imports the third-party packages the last round's workers imported
    preload_imports: bool = True
    role: str = "default"
    max_restarts: int = 0
    monitor_interval: float = 0.1  # only for rendezvous handlers without a watch
    shutdown_timeout: float = 30.0
    log_dir: str | None = None  # per-rank files under log_dir/run_id/attempt_N/RANK/
    redirects: dict[int, int] = field(default_factory=dict)  # local rank -> Std bits
    tee: dict[int, int] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None  # console: only these local ranks
    # log_dir/<run_id>/attempt_N/<rank>/ ("elasticstore"), or torchrun's
    # log_dir/<run_id>_<random>/attempt_N/<local rank>/ ("torchrun")
    log_layout: str = "elasticstore"
    # TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: the console prefix (${role_name}, ${rank}, ${local_rank})
    log_line_prefix_template: str | None = None
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    extra_env: tuple[tuple[str, str], ...] = ()  # e.g. OMP_NUM_THREADS chosen by the launcher
    legacy_local_rank_arg: bool = False  # launch.py without --use-env: --local-rank=N
    drain_timeout: float = DRAIN_TIMEOUT
    event_log_handler: str = "null"  # torch's events destination routed into events.jsonl
    metrics_port: int | None = None  # Prometheus text on metrics_addr:metrics_port
    metrics_addr: str = "127.0.0.1"
    # --rdzv-conf token_file (absolute): workers get it as ELASTICSTORE_TOKEN_FILE (the path,
    # never the token), and the agent's own connections to the round's store use it.
    token_file: str | None = None
    heartbeat_timeout: float | None = HEARTBEAT_TIMEOUT  # None: off
    first_heartbeat_timeout: float | None = FIRST_HEARTBEAT_TIMEOUT
    health: HealthSettings = field(default_factory=HealthSettings)  # checks before joining
    # --virtual-local-rank: LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES the worker's one device
    virtual_local_rank: bool = False
    # --numa-binding: the CPUs of each local rank (numa.py), applied in the worker at its start
    cpu_affinity: tuple[frozenset[int], ...] | None = None
    python: str | None = None  # PYTHON_EXEC: the interpreter of plain (not warm) workers
    # --duplicate-std{out,err}-filters: stream -> needles; a teed rank's line containing one is
    # also written to the attempt's filtered_<stream>.log (logs.py)
    duplicate_filters: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # --logs-specs: the LogsSpecs object (torch's) whose reify places each worker's files
    # (logspecs.py); log_dir, redirects and tee are then its own
    logs_specs: Any = None

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc-per-node {self.nproc}: must be at least 1")
        if self.max_restarts < 0:
            raise ValueError(f"max-restarts {self.max_restarts}: must be >= 0")
        if self.log_layout not in ("elasticstore", "torchrun"):
            raise ValueError(f"log-layout {self.log_layout!r}: expected elasticstore or torchrun")
        if self.cpu_affinity is not None and len(self.cpu_affinity) != self.nproc:
            raise ValueError(f"cpu_affinity: {len(self.cpu_affinity)} sets for {self.nproc} workers")
        if self.kind not in ("script", "module", "exec"):
            raise ValueError(f"kind {self.kind!r}")
