"""What the machine is (recorded with every run) and what its limits allow."""

from __future__ import annotations

import os
import resource
import sys

from measures import Sizes


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    u = os.uname()
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "kernel": f"{u.sysname} {u.release}",
        "python": sys.version.split()[0],
        "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def fd_room(n_clients: int, sz: Sizes) -> str | None:
    """Why n_clients connections cannot be made here, or None. The server holds n fds; each
    client process holds n/procs (+ inherited ones)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if n_clients + 256 > soft:
        return f"fd limit {soft} < {n_clients} connections + 256"
    return None
