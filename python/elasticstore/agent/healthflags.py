"""The health check's flags of ``elasticstore-run`` (``runflags.py`` registers them, ``run.py``
parses them, both with the functions here), each with its ``PET_<FLAG>`` fallback and both
spellings, as every other flag:

- ``--health-check`` (``PET_HEALTH_CHECK=1``): check the node before it joins (the default
  check: ``healthcheck.py``; when and how: ``health.py``);
- ``--health-check-cmd CMD``: run ``CMD`` with the shell instead (exit 0: healthy); implies
  ``--health-check``;
- ``--health-check-timeout SECONDS`` (default ``HEALTH_CHECK_TIMEOUT``): a longer check failed;
- ``--health-check-max-matmul-ms MS`` (default ``MAX_MATMUL_MS``; 0: no limit): the default
  check fails when a process's median matmul takes longer.

The last two without a check to apply to (or the matmul limit with a command) are refused: a
setting that would do nothing is a mistake worth naming.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from .config import HEALTH_CHECK_TIMEOUT, MAX_MATMUL_MS, HealthSettings

__all__ = ["add_flags", "health_settings"]

VALUE_FLAGS = ("--health-check-cmd", "--health-check-timeout", "--health-check-max-matmul-ms")


def add_flags(p: argparse.ArgumentParser, names: Callable[[str], list[str]],
              value: type[argparse.Action], switch: type[argparse.Action]) -> None:
    """Registers the flags on ``p`` with runflags.py's spellings (``names``) and actions."""
    p.add_argument(*names("--health-check"), action=switch)
    for flag in VALUE_FLAGS:
        p.add_argument(*names(flag), action=value, default=None)


def _number(flag: str, text: str, error: Callable[[str, str], Exception], zero: bool) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise error(flag, f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise error(flag, f"{text!r}: must be {'at least 0' if zero else 'positive'}")
    return value


def health_settings(args: argparse.Namespace, error: Callable[[str, str], Exception],
                    join_timeout: float = 600.0) -> HealthSettings:
    """The parsed flags -> settings; ``error(flag, reason)`` is raised for a bad value.
    ``join_timeout`` (the rendezvous') bounds how long a failing node keeps checking."""
    command = args.health_check_cmd
    if command is not None and not str(command).strip():
        raise error("--health-check-cmd", "empty command")
    enabled = bool(args.health_check) or command is not None
    timeout, max_ms = HEALTH_CHECK_TIMEOUT, MAX_MATMUL_MS
    if args.health_check_timeout is not None:
        timeout = _number("--health-check-timeout", args.health_check_timeout, error, zero=False)
        if not enabled:
            raise error("--health-check-timeout", "no effect without --health-check or "
                        "--health-check-cmd")
    if args.health_check_max_matmul_ms is not None:
        max_ms = _number("--health-check-max-matmul-ms", args.health_check_max_matmul_ms, error,
                         zero=True)
        if not enabled or command is not None:
            raise error("--health-check-max-matmul-ms", "applies to the default check only "
                        "(--health-check without --health-check-cmd)")
    return HealthSettings(enabled=enabled, command=str(command) if command is not None else None,
                          timeout=timeout, max_matmul_ms=max_ms, join_timeout=join_timeout)
