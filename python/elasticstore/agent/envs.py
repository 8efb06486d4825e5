"""What a worker is started with: its command line, and its environment (every variable torchrun
sets, plus elasticstore's)."""

from __future__ import annotations

import os
import signal
import sys
from string import Template

from torch.distributed.elastic.rendezvous import RendezvousInfo

from .config import AgentSettings
from .numa import cpu_list

__all__ = ["worker_argv", "worker_env"]


def worker_argv(s: AgentSettings, local: int) -> tuple[list[str], str]:
    """(argv, kind) of local worker ``local``: the script or module for the fork server (warm
    start), else a command to exec (python, or the entrypoint itself with --no-python). As
    torchrun, ``${local_rank}`` in the script and its arguments becomes the local rank."""
    args = list(s.args)
    if s.legacy_local_rank_arg:
        args = [f"--local-rank={local}", *args]
    if s.kind == "exec":
        return [s.entrypoint, *_substitute(args, local)], "exec"
    entry, *args = _substitute([s.entrypoint, *args], local)
    if s.warm:
        return [entry, *args], s.kind
    python = [s.python or sys.executable, "-u"]
    if s.kind == "module":
        return [*python, "-m", entry, *args], "exec"
    return [*python, entry, *args], "exec"


def _substitute(args: list[str], local: int) -> list[str]:
    """torch's ``macros.substitute``: ``$local_rank``/``${local_rank}``, ``$$`` -> ``$``."""
    return [Template(a).safe_substitute(local_rank=str(local)) for a in args]


def worker_env(s: AgentSettings, info: RendezvousInfo, use_agent_store: bool, attempt: int,
               local: int, rank: int, world: int, error_file: str,
               restarts: int = 0) -> dict[str, str]:
    """The worker's environment; ``attempt``: the round's (its number less one: the log
    directory's ``attempt_N``, the store prefix, ``ELASTICSTORE_ATTEMPT``); ``restarts``: the
    job's failure restarts (``TORCHELASTIC_RESTART_COUNT``, ``rounds.assign``)."""
    boot = info.bootstrap_store_info
    addr, port = (boot.master_addr, boot.master_port) if boot is not None else ("127.0.0.1", 0)
    env = dict(os.environ)
    env.update(s.extra_env)
    env.update({
        "LOCAL_RANK": str(local), "RANK": str(rank), "GROUP_RANK": str(info.rank),
        "ROLE_RANK": str(rank), "ROLE_NAME": s.role,
        "LOCAL_WORLD_SIZE": str(s.nproc), "WORLD_SIZE": str(world),
        "GROUP_WORLD_SIZE": str(info.world_size), "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": addr, "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(restarts),
        "TORCHELASTIC_MAX_RESTARTS": str(s.max_restarts),
        "TORCHELASTIC_RUN_ID": s.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(use_agent_store),
        "TORCHELASTIC_ERROR_FILE": error_file,
        # torchrun exports --signals-to-handle for torch's own handlers in the workers' tree
        "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(signal.Signals(sig).name for sig in s.signals),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "ELASTICSTORE_ADDR": f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}",
        # Store.from_env() connects to the round's store from these two.
        "ELASTICSTORE_HOST": addr, "ELASTICSTORE_PORT": str(port),
        "ELASTICSTORE_PREFIX": f"/worker/attempt_{attempt}",
        "ELASTICSTORE_ATTEMPT": str(attempt),  # every round counts, membership changes too
        "ELASTICSTORE_RUN_ID": s.run_id,
    })
    if s.virtual_local_rank:  # torch's rule: the worker's device, seen as device 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible is not None else None
        if devices is not None and local >= len(devices):
            raise ValueError(f"--virtual-local-rank: local rank {local} exceeds the devices in "
                             f"CUDA_VISIBLE_DEVICES={visible}")
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = devices[local].strip() if devices is not None else str(local)
    if s.cpu_affinity is not None:  # --numa-binding: the fork server applies it in the worker
        env["ELASTICSTORE_CPU_AFFINITY"] = cpu_list(s.cpu_affinity[local])
    if s.token_file is not None:
        # The round's store requires the token: Store.from_env() reads it from this file.
        env["ELASTICSTORE_TOKEN_FILE"] = s.token_file
    return env
