"""``--numa-binding``: each worker runs on the CPUs near its accelerator, as torchrun places them
(``torch.numa.binding``): the worker of local rank ``i`` uses CUDA device ``i``, whose NUMA node
is its PCI device's (``/sys/bus/pci/devices/<addr>/numa_node``). The modes, torch's:

- ``node``: every CPU of that NUMA node;
- ``socket``: every CPU of the NUMA nodes of that node's socket;
- ``exclusive``: the node's physical cores split evenly (in core order, the first devices one
  core more when they do not divide) between the node's devices, so no two workers share a core;
- ``core-complex``: one group of cores sharing the largest cache (an L3 complex) per device,
  the largest groups first, round robin when the devices outnumber them.

Only CPUs this process may use count (its affinity, as torch's). The placement is a pure
function of a :class:`Topology` (``cpus_for``), read once from sysfs (``read_topology``, whose
``sysfs`` root a test points at a fake tree); the launcher computes every rank's set before
anything starts and the fork server applies it to the worker (``sched_setaffinity``) before the
script runs, so it is inherited by every thread and child: torchrun's ``numactl
--physcpubind`` without needing ``numactl``. Memory follows the CPUs (first touch), as under
torchrun, which binds CPUs only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MODES", "Topology", "bindings", "cpu_list", "cpus_for", "parse_list", "read_topology"]

MODES = ("node", "socket", "exclusive", "core-complex")


@dataclass(frozen=True)
class Topology:
    """What the placement reads: per device its NUMA node, per node its usable CPUs, per CPU its
    socket, its physical core and its largest shared cache (each named by its lowest CPU)."""

    device_nodes: tuple[int, ...]
    node_cpus: Mapping[int, frozenset[int]]
    cpu_socket: Mapping[int, int]
    cpu_core: Mapping[int, int]
    cpu_cache: Mapping[int, int]


def parse_list(text: str) -> set[int]:
    """sysfs' CPU list (``"0-2,4,6-7"``) -> ``{0, 1, 2, 4, 6, 7}``."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def cpu_list(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the inverse of ``parse_list``)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def _groups(cpus: Iterable[int], key: Mapping[int, int], what: str) -> dict[int, frozenset[int]]:
    groups: dict[int, set[int]] = {}
    for cpu in cpus:
        if cpu not in key:
            raise RuntimeError(f"--numa-binding: the {what} of CPU {cpu} is not known (sysfs)")
        groups.setdefault(key[cpu], set()).add(cpu)
    return {k: frozenset(v) for k, v in groups.items()}


def cpus_for(mode: str, device: int, topo: Topology) -> frozenset[int]:
    """The CPUs of the worker using ``device`` under ``mode`` (torch's rules, module doc);
    ``RuntimeError`` saying why when there are none."""
    if not 0 <= device < len(topo.device_nodes):
        raise RuntimeError(f"--numa-binding: no device {device} (this node has "
                           f"{len(topo.device_nodes)})")
    node = topo.device_nodes[device]
    own = topo.node_cpus.get(node, frozenset())
    peers = sorted(d for d, n in enumerate(topo.device_nodes) if n == node)
    index = peers.index(device)
    if mode == "node":
        cpus = own
    elif mode == "socket":
        if not own:
            raise RuntimeError(f"--numa-binding: NUMA node {node} has no CPU this process may use")
        socket = topo.cpu_socket[min(own)]
        cpus = frozenset(c for n, cs in topo.node_cpus.items() if cs
                         and topo.cpu_socket.get(min(cs)) == socket for c in cs)
    elif mode == "exclusive":
        cores = [v for _, v in sorted(_groups(own, topo.cpu_core, "core").items())]
        share, extra = divmod(len(cores), len(peers))
        if share < 1:
            raise RuntimeError(f"--numa-binding exclusive: NUMA node {node} has {len(cores)} "
                               f"physical core(s) for {len(peers)} devices")
        start = index * share + min(index, extra)
        cpus = frozenset().union(*cores[start:start + share + (index < extra)])
    elif mode == "core-complex":
        groups = sorted(_groups(own, topo.cpu_cache, "cache").items(), key=lambda kv: (-len(kv[1]), kv[0]))
        cpus = groups[index % len(groups)][1] if groups else frozenset()
    else:
        raise ValueError(f"--numa-binding {mode!r}: expected one of {', '.join(MODES)}")
    if not cpus:
        raise RuntimeError(f"--numa-binding {mode}: no CPU for device {device} (NUMA node {node})")
    return cpus


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _largest_cache(sysfs: str, cpu: int) -> int | None:
    """The lowest CPU sharing ``cpu``'s highest-level data or unified cache."""
    base = f"{sysfs}/devices/system/cpu/cpu{cpu}/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    best: tuple[int, int] | None = None
    for entry in entries:
        if not entry.startswith("index") or not entry[5:].isdecimal():
            continue
        kind, level = _read(f"{base}/{entry}/type"), _read(f"{base}/{entry}/level")
        shared = _read(f"{base}/{entry}/shared_cpu_list")
        if kind in ("Unified", "Data") and level and shared and (best is None or int(level) > best[0]):
            best = (int(level), min(parse_list(shared)))
    return best[1] if best else None


def read_topology(pci_addrs: Sequence[str], sysfs: str = "/sys",
                  allowed: Iterable[int] | None = None) -> Topology:
    """The topology of devices at ``pci_addrs`` (``0000:1b:00.0``, in device order); only the
    CPUs in ``allowed`` (default: this process's affinity) count."""
    usable = set(os.sched_getaffinity(0) if allowed is None else allowed)
    nodes = []
    for addr in pci_addrs:
        text = _read(f"{sysfs}/bus/pci/devices/{addr}/numa_node")
        if text is None:
            raise RuntimeError(f"--numa-binding: the NUMA node of device {addr} is not known "
                               f"({sysfs}/bus/pci/devices/{addr}/numa_node)")
        nodes.append(max(int(text), 0))  # -1: a machine without NUMA (one node)
    node_cpus: dict[int, frozenset[int]] = {}
    for node in sorted(parse_list(_read(f"{sysfs}/devices/system/node/possible") or "0")):
        text = _read(f"{sysfs}/devices/system/node/node{node}/cpulist")
        if text is not None:
            node_cpus[node] = frozenset(parse_list(text) & usable)
    cpus = sorted(set().union(*node_cpus.values())) if node_cpus else []
    socket, core, cache = {}, {}, {}
    for cpu in cpus:
        top = f"{sysfs}/devices/system/cpu/cpu{cpu}/topology"
        if (pkg := _read(f"{top}/physical_package_id")) is not None:
            socket[cpu] = int(pkg)
        if (siblings := _read(f"{top}/thread_siblings_list")) is not None:
            core[cpu] = min(parse_list(siblings))
        if (shared := _largest_cache(sysfs, cpu)) is not None:
            cache[cpu] = shared
    return Topology(tuple(nodes), node_cpus, socket, core, cache)


def bindings(mode: str, nproc: int) -> tuple[frozenset[int], ...]:
    """The CPUs of local ranks ``0..nproc-1`` on this machine (imports torch, reads CUDA's
    devices); ``RuntimeError`` saying why it cannot place them."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("needs CUDA devices (the worker of local rank i is placed near "
                           "device i); none is available")
    count = torch.cuda.device_count()
    if nproc > count:
        raise RuntimeError(f"{nproc} workers for {count} CUDA device(s): local rank i is placed "
                           "near device i")
    addrs = []
    for i in range(count):
        p: Any = torch.cuda.get_device_properties(i)  # pci_* ids: not in torch's stubs
        addrs.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
    topo = read_topology(addrs)
    return tuple(cpus_for(mode, i, topo) for i in range(nproc))
