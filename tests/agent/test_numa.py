"""--numa-binding's placement (torch.numa.binding's four modes) on a fake sysfs tree: two
sockets, three NUMA nodes, four devices, hyper-threads and L3 complexes."""

from __future__ import annotations

import os

import pytest

from elasticstore.agent.numa import cpu_list, cpus_for, parse_list, read_topology

# node -> CPUs (hyper-thread sibling of CPU c: c + 16 on nodes 0 and 1); node 2 has no siblings.
NODES = {0: "0-3,16-19", 1: "4-7,20-23", 2: "8-15"}
SOCKET = {0: 0, 1: 0, 2: 1}
L3 = ["0-1,16-17", "2-3,18-19", "4-7,20-23", "8-15"]  # node 0 has two complexes
# PCI address -> NUMA node; -1 (firmware without NUMA information) is node 0, as for torch.
DEVICES = {"0000:1a:00.0": 0, "0000:1b:00.0": 0, "0000:3c:00.0": 1, "0000:9e:00.0": 2, "0000:9d:00.0": -1}
ADDRS = ["0000:1a:00.0", "0000:1b:00.0", "0000:3c:00.0", "0000:9e:00.0"]  # devices 0-3


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def _fake_sysfs(root: str) -> str:
    for addr, node in DEVICES.items():
        _write(f"{root}/bus/pci/devices/{addr}/numa_node", str(node))
    _write(f"{root}/devices/system/node/possible", "0-2")
    for node, cpus in NODES.items():
        _write(f"{root}/devices/system/node/node{node}/cpulist", cpus)
        for cpu in parse_list(cpus):
            top = f"{root}/devices/system/cpu/cpu{cpu}"
            _write(f"{top}/topology/physical_package_id", str(SOCKET[node]))
            sib = f"{cpu % 16},{cpu % 16 + 16}" if node < 2 else str(cpu)
            _write(f"{top}/topology/thread_siblings_list", sib)
            shared = next(c for c in L3 if cpu in parse_list(c))
            for index, (kind, level, cache) in enumerate([("Data", 1, str(cpu)), ("Instruction", 1, str(cpu)),
                                                          ("Unified", 2, sib), ("Unified", 3, shared)]):
                _write(f"{top}/cache/index{index}/type", kind)
                _write(f"{top}/cache/index{index}/level", str(level))
                _write(f"{top}/cache/index{index}/shared_cpu_list", cache)
    return root


@pytest.mark.parametrize(
    "mode, device, expected",
    [
        ("node", 0, "0-3,16-19"), ("node", 2, "4-7,20-23"), ("node", 3, "8-15"),
        ("socket", 1, "0-7,16-23"), ("socket", 3, "8-15"),
        ("exclusive", 0, "0-1,16-17"), ("exclusive", 1, "2-3,18-19"), ("exclusive", 3, "8-15"),
        ("core-complex", 0, "0-1,16-17"), ("core-complex", 1, "2-3,18-19"), ("core-complex", 2, "4-7,20-23"),
    ],
)
def test_placement_per_mode(tmp_path: object, mode: str, device: int, expected: str) -> None:
    topo = read_topology(ADDRS, _fake_sysfs(str(tmp_path)), allowed=range(24))
    assert cpu_list(cpus_for(mode, device, topo)) == expected


def test_only_cpus_this_process_may_use_and_uneven_exclusive_split(tmp_path: object) -> None:
    # Without CPU 3 (and its sibling 19) node 0 has three cores for two devices: the first gets two.
    topo = read_topology(ADDRS, _fake_sysfs(str(tmp_path)), allowed=set(range(24)) - {3, 19})
    assert [cpu_list(cpus_for("exclusive", d, topo)) for d in (0, 1)] == ["0-1,16-17", "2,18"]
    assert cpu_list(cpus_for("node", 0, topo)) == "0-2,16-18"
    # The largest complex first: node 0's complexes are now 4 and 2 CPUs.
    assert [cpu_list(cpus_for("core-complex", d, topo)) for d in (0, 1)] == ["0-1,16-17", "2,18"]


def test_what_cannot_be_placed_says_why(tmp_path: object) -> None:
    root = _fake_sysfs(str(tmp_path))
    topo = read_topology(ADDRS, root, allowed={0, 16, 4, 8})  # node 0: one core for two devices
    with pytest.raises(RuntimeError, match="NUMA node 0 has 1 physical core.* for 2 devices"):
        cpus_for("exclusive", 1, topo)
    with pytest.raises(RuntimeError, match="no device 4"):
        cpus_for("node", 4, topo)
    with pytest.raises(RuntimeError, match="NUMA node of device 0000:ff:00.0 is not known"):
        read_topology(["0000:ff:00.0"], root)
    assert read_topology(["0000:9d:00.0"], root).device_nodes == (0,)
    empty = read_topology(ADDRS, root, allowed={8})
    with pytest.raises(RuntimeError, match="no CPU for device 0"):
        cpus_for("node", 0, empty)


def test_cpu_lists_round_trip() -> None:
    for text in ("0-2,5", "3", "1,3-6,9-10", "0-63"):
        assert cpu_list(parse_list(text)) == text
