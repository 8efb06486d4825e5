"""The values of ``elasticstore-run``'s flags, each parsed and checked on its own (``run.py``
puts them together into the run's settings): integers and ranges, timeouts, ``--nproc-per-node``'s
device names, ``--signals-to-handle``, torchrun's comma lists, ``LOGLEVEL``, ``--numa-binding``'s
placement and ``--virtual-local-rank``. A bad value raises :class:`runflags.UsageError` naming
the flag."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Mapping
from typing import Any

from .agent.config import parse_timeout
from .rendezvous.settings import parse_pairs
from .runflags import NUMA_MODES, UsageError

__all__ = ["comma_list", "cpu_count", "int_value", "log_level", "nnodes_value", "nproc_value",
           "numa_value", "rdzv_conf_value", "signals_value", "timeout_value", "virtual_local_rank"]


def int_value(flag: str, text: str, low: int = 0) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise UsageError(flag, f"{text!r} is not an integer") from None
    if value < low:
        raise UsageError(flag, f"{value} must be at least {low}")
    return value


def timeout_value(flag: str, text: str) -> float | None:
    try:
        return parse_timeout(str(text))
    except ValueError:
        raise UsageError(flag, f"{text!r}: expected a positive number of seconds (0: off)") from None


def nnodes_value(text: str) -> tuple[int, int]:
    lo, _, hi = str(text).partition(":")
    a = int_value("--nnodes", lo, 1)
    b = int_value("--nnodes", hi, 1) if hi else a
    if b < a:
        raise UsageError("--nnodes", f"{text!r}: MAX below MIN")
    return a, b


def nproc_value(text: str) -> int:
    """torchrun's ``--nproc-per-node``: N, ``cpu``, ``gpu`` (CUDA), ``xpu``, the name of torch's
    custom (PrivateUse1) device, or ``auto`` (``torch.accelerator``'s devices, else the CPUs)."""
    text = str(text).strip()
    if text.isdigit():
        return int_value("--nproc-per-node", text, 1)
    if text == "cpu":
        return cpu_count()
    import torch

    if text in ("gpu", "xpu"):
        mod = torch.cuda if text == "gpu" else torch.xpu
        if not mod.is_available():
            raise UsageError("--nproc-per-node", f"{text}: {'CUDA' if text == 'gpu' else 'XPU'} "
                             "is not available")
        return int(mod.device_count())
    if text == "auto":
        if torch.accelerator.is_available():
            return int(torch.accelerator.device_count())
        return cpu_count()
    custom = torch._C._get_privateuse1_backend_name()
    if text == custom:
        device: Any = getattr(torch, custom, None)
        if device is None or not device.is_available():
            raise UsageError("--nproc-per-node", f"{text}: the device is not available")
        return int(device.device_count())
    raise UsageError("--nproc-per-node", f"{text!r}: expected N, auto, cpu, gpu, xpu or {custom}")


def cpu_count() -> int:
    """torch's count for ``cpu``: the CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def rdzv_conf_value(text: str) -> tuple[tuple[str, str], ...]:
    try:
        return parse_pairs(text)
    except ValueError as exc:
        raise UsageError("--rdzv-conf", str(exc)) from None


def signals_value(text: str) -> tuple[int, ...]:
    out = []
    for name in filter(None, (n.strip() for n in str(text).split(","))):
        try:
            out.append(int(signal.Signals[name]))
        except KeyError:
            raise UsageError("--signals-to-handle", f"{name!r} is not a signal name") from None
    return tuple(out)


def comma_list(text: str) -> tuple[str, ...]:
    """torchrun's ``comma_separated_list``: ``a,b`` -> (a, b); ``,,`` is a comma in an item."""
    return tuple(item.replace("\0", ",") for item in str(text).replace(",,", "\0").split(","))


def log_level(environ: Mapping[str, str]) -> int | None:
    """torchrun's ``LOGLEVEL`` (a level name): also the level of elasticstore's own loggers."""
    text = environ.get("LOGLEVEL")
    if not text:
        return None
    level = logging.getLevelName(text.strip().upper())
    if not isinstance(level, int):
        raise UsageError("LOGLEVEL", f"{text!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def fork_server_value(environ: Mapping[str, str]) -> bool:
    """``ELASTICSTORE_FORK_SERVER``: ``forked`` (the default: the warm fork server is a copy of
    the launcher, which imported torch already) or ``fresh`` (a new interpreter that imports
    torch itself); True for ``forked``."""
    text = environ.get("ELASTICSTORE_FORK_SERVER", "").strip().lower()
    if text in ("", "forked"):
        return True
    if text == "fresh":
        return False
    raise UsageError("ELASTICSTORE_FORK_SERVER",
                     f"{environ['ELASTICSTORE_FORK_SERVER']!r}: expected 'forked' or 'fresh'")


def numa_value(mode: str | None, nproc: int) -> tuple[frozenset[int], ...] | None:
    """``--numa-binding``: every local rank's CPUs, placed before anything starts."""
    if mode is None:
        return None
    if mode not in NUMA_MODES:
        raise UsageError("--numa-binding", f"{mode!r}: expected one of {', '.join(NUMA_MODES)}")
    from .agent.numa import bindings

    try:
        return bindings(mode, nproc)
    except (RuntimeError, OSError) as exc:
        raise UsageError("--numa-binding", f"{mode}: {exc}") from None


def virtual_local_rank(args: argparse.Namespace, environ: Mapping[str, str], nproc: int) -> bool:
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if args.virtual_local_rank and visible is not None and nproc > len(visible.split(",")):
        raise UsageError("--virtual-local-rank", f"{nproc} workers but CUDA_VISIBLE_DEVICES="
                         f"{visible} lists {len(visible.split(','))} device(s): each worker "
                         "sees the device of its local rank")
    return bool(args.virtual_local_rank)
