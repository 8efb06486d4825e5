"""Endpoint names that resolve late: a Kubernetes Service's or pod's DNS name may not resolve
until seconds after the pod starts (pods start in any order). A name that does not resolve yet
is looked up again with a bounded back-off until ``join_timeout``; one log line says so. A name
that never resolves ends with :class:`RendezvousNameError`, naming the host and the time waited.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Sequence

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

__all__ = ["BACKOFF_FIRST", "BACKOFF_MAX", "RendezvousNameError", "wait_for_name"]

log = logging.getLogger(__name__)

BACKOFF_FIRST = 0.1  # seconds before the second lookup; doubled after each failed one
BACKOFF_MAX = 2.0  # the longest pause between two lookups


class RendezvousNameError(RendezvousConnectionError):
    """An ``--rdzv-endpoint`` host name did not resolve within ``join_timeout``."""


def _lookup(host: str) -> str:
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])


def wait_for_name(hosts: Sequence[str], timeout: float) -> tuple[str, str]:
    """(host, numeric address) of the first of ``hosts`` that resolves (forward lookups only),
    looking again every 0.1 s to 2 s until ``timeout`` seconds passed; numeric hosts need no
    lookup. Raises :class:`RendezvousNameError` when none resolved in time."""
    if not hosts:
        raise ValueError("wait_for_name: no host")
    start = time.monotonic()
    deadline, pause, told = start + timeout, BACKOFF_FIRST, False
    failures: list[str] = []
    for _ in range(1 << 20):  # bounded by the deadline; the count only guards the loop
        failures.clear()
        for host in hosts:
            try:
                return host, _lookup(host)
            except (socket.gaierror, UnicodeError) as exc:  # not (yet) in DNS
                failures.append(f"{host}: {exc}")
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if not told:
            told = True
            log.warning("rendezvous endpoint %s %s not resolve yet (%s): looking up again until "
                        "join_timeout (%gs)", ", ".join(hosts), "does" if len(hosts) == 1 else "do",
                        "; ".join(failures), timeout)
        time.sleep(min(pause, left))
        pause = min(pause * 2, BACKOFF_MAX)
    waited = time.monotonic() - start
    raise RendezvousNameError(
        f"rendezvous endpoint host{'s' if len(hosts) > 1 else ''} "
        f"{', '.join(repr(h) for h in hosts)} did not resolve within "
        f"{waited:.1f}s (join_timeout {timeout:g}s): {'; '.join(failures)}; check the name "
        "(a Kubernetes Service or pod DNS name) or raise join_timeout in --rdzv-conf")
