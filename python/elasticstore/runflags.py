"""The flags of ``elasticstore-run`` (``run.py`` parses them into settings): every flag with
torchrun's defaults, its dashed and underscored spellings, its ``PET_<FLAG>`` environment fallback
(torch's ``env`` and ``check_env`` actions), abbreviated long flags as torchrun's parser takes them,
and the flags not supported, refused by name with the reason. A bad flag raises :class:`UsageError` naming it
(``elasticstore-run`` prints one line and exits 2). The health check's flags: ``agent/healthflags.py``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .agent.config import FIRST_HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT
from .agent.healthflags import add_flags as add_health_flags

__all__ = ["NUMA_MODES", "UNSUPPORTED", "UsageError", "parser"]

# torchrun's flags that elasticstore-run refuses when given (by flag or by ``PET_<FLAG>``), each
# with the reason (``run.py``); none today.
UNSUPPORTED: dict[str, str] = {}
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")  # torch.numa.binding.AffinityMode


class UsageError(ValueError):
    """A bad flag value: ``flag`` names it."""

    def __init__(self, flag: str, reason: str) -> None:
        super().__init__(f"{flag}: {reason}")


def _env_name(option_strings: Sequence[str]) -> str:
    longest = max(option_strings, key=len)
    return "PET_" + longest.lstrip("-").replace("-", "_").upper()


class _Env(argparse.Action):
    """A value flag whose default comes from ``PET_<FLAG>`` (torch's ``env`` action)."""

    environ: Mapping[str, str] = os.environ

    def __init__(self, option_strings: Sequence[str], dest: str, default: Any = None,
                 **kwargs: Any) -> None:
        env = _Env.environ.get(_env_name(option_strings))
        super().__init__(option_strings, dest, default=env if env is not None else default, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)


class _CheckEnv(argparse.Action):
    """A switch, also on when ``PET_<FLAG>`` is 1 (torch's ``check_env``)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        on = _Env.environ.get(_env_name(option_strings), "0") == "1"
        super().__init__(option_strings, dest, nargs=0, default=on, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit code 2
        raise UsageError("elasticstore-run", message)


def _names(flag: str) -> list[str]:
    under = flag.replace("-", "_")
    return [flag, "--" + under[2:]] if under[2:] != flag[2:] else [flag]


def parser(environ: Mapping[str, str] = os.environ, prog: str = "elasticstore-run",
           legacy: bool = False) -> argparse.ArgumentParser:
    """The parser of ``elasticstore-run``'s flags, with ``PET_*`` fallbacks read from ``environ``;
    ``legacy``: also ``--use-env`` (``python -m elasticstore.launch``)."""
    _Env.environ = environ
    p = _Parser(prog=prog, description="Elastic launcher for PyTorch, a drop-in for torchrun.",
                allow_abbrev=True)  # torchrun's parser takes abbreviated long flags too
    value = {
        "--nnodes": "1:1", "--nproc-per-node": "1", "--rdzv-backend": None,
        "--rdzv-endpoint": "", "--rdzv-id": "none", "--rdzv-conf": "", "--max-restarts": "0",
        "--monitor-interval": "0.1", "--start-method": "forkserver", "--role": "default",
        "--log-dir": None, "--log-layout": "elasticstore", "--local-ranks-filter": "", "--node-rank": None,
        "--master-addr": "127.0.0.1", "--master-port": None, "--local-addr": None,
        "--signals-to-handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "--shutdown-timeout": None,
        "--event-log-handler": "null", "--metrics-port": None, "--metrics-addr": "127.0.0.1",
        "--heartbeat-timeout": str(HEARTBEAT_TIMEOUT), "--first-heartbeat-timeout": str(FIRST_HEARTBEAT_TIMEOUT),
    }
    for flag, default in value.items():
        p.add_argument(*_names(flag), action=_Env, default=default)
    p.add_argument("-r", "--redirects", action=_Env, default="0")
    p.add_argument("-t", "--tee", action=_Env, default="0")
    p.add_argument("--standalone", action=_CheckEnv)
    p.add_argument("-m", "--module", action=_CheckEnv)
    p.add_argument(*_names("--no-python"), action=_CheckEnv)
    p.add_argument(*_names("--run-path"), action=_CheckEnv)
    p.add_argument(*_names("--no-preload-imports"), action=_CheckEnv)
    add_health_flags(p, _names, _Env, _CheckEnv)  # --health-check* (agent/healthflags.py)
    p.add_argument(*_names("--virtual-local-rank"), action=_CheckEnv)
    # torch's has no PET_NUMA_BINDING; taken here too, so that no PET_ variable is ignored
    p.add_argument(*_names("--numa-binding"), action=_Env, default=None)
    for flag in ("--duplicate-stdout-filters", "--duplicate-stderr-filters"):
        p.add_argument(*_names(flag), action=_Env, default=None)
    # --logs-specs: a torchrun.logs_specs entry point's LogsSpecs (agent/logspecs.py)
    p.add_argument(*_names("--logs-specs"), action=_Env, default=None)
    for flag in UNSUPPORTED:  # refused when given, PET_ variable included (run.py)
        p.add_argument(*_names(flag), action=_Env, default=None)
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    if legacy:
        p.add_argument(*_names("--use-env"), action=_CheckEnv)
    return p
