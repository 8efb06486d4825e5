"""What a worker is started with: its command line, and its environment (every variable torchrun
sets, plus elasticstore's)."""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.rendezvous import RendezvousInfo

from .config import AgentSettings

__all__ = ["worker_argv", "worker_env"]


def worker_argv(s: AgentSettings, local: int) -> tuple[list[str], str]:
    """(argv, kind) of local worker ``local``: the script or module for the fork server (warm
    start), else a command to exec (python, or the entrypoint itself with --no-python)."""
    args = list(s.args)
    if s.legacy_local_rank_arg:
        args = [f"--local-rank={local}", *args]
    if s.kind == "exec":
        return [s.entrypoint, *args], "exec"
    if s.warm:
        return [s.entrypoint, *args], s.kind
    python = [sys.executable, "-u"]
    if s.kind == "module":
        return [*python, "-m", s.entrypoint, *args], "exec"
    return [*python, s.entrypoint, *args], "exec"


def worker_env(s: AgentSettings, info: RendezvousInfo, use_agent_store: bool, attempt: int,
               local: int, rank: int, world: int, error_file: str) -> dict[str, str]:
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
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
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
        "ELASTICSTORE_RUN_ID": s.run_id,
    })
    if s.token_file is not None:
        # The round's store requires the token: Store.from_env() reads it from this file.
        env["ELASTICSTORE_TOKEN_FILE"] = s.token_file
    return env
