"""Child-process tasks for the tests: ``python child_tasks.py TASK JSON_ARGS``.

Each task prints one JSON line (its result) to stdout and exits 0; anything else is a failure
that :func:`spawned.join` reports with the child's output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from store_kinds import connect  # noqa: E402

TASKS: dict[str, Callable[..., Any]] = {}


def task(fn: Callable[..., Any]) -> Callable[..., Any]:
    TASKS[fn.__name__] = fn
    return fn


@task
def adds(spec: dict[str, Any], key: str, count: int, go: str) -> list[int]:
    """``count`` adds of 1 to ``key`` (after ``go`` exists, so every process starts together)."""
    store = connect(spec)
    store.wait([go])
    return [store.add(key, 1) for _ in range(count)]


@task
def blocked_then_report(spec: dict[str, Any]) -> list[str]:
    """Blocks in ``get("xkey")``, then in ``wait(["ykey"])``, announcing each wait (``ready/*``)
    and reporting each wake-up (``report/*``)."""
    store = connect(spec)
    store.set("ready/get", "1")
    value = store.get("xkey").decode()
    store.set("report/get", value)
    store.set("ready/wait", "1")
    store.wait(["ykey"])
    store.set("report/wait", "woken")
    return [value, "woken"]


@task
def set_keys(spec: dict[str, Any], key: str, count: int, go: str) -> int:
    """Sets ``key`` to 0..count-1 in order, after ``go`` exists."""
    store = connect(spec)
    store.wait([go])
    for i in range(count):
        store.set(key, str(i))
    return count


@task
def set_prefixed(spec: dict[str, Any], prefix: str, count: int, go: str) -> int:
    """Sets ``prefix/i`` = i for i in 0..count-1 in order, after ``go`` exists."""
    store = connect(spec)
    store.wait([go])
    for i in range(count):
        store.set(f"{prefix}/{i}", str(i))
    return count


@task
def barrier_rounds(spec: dict[str, Any], key: str, world_size: int, rounds: int) -> list[int]:
    store = connect(spec)
    return [store.barrier(key, world_size) for _ in range(rounds)]


@task
def hold_ephemeral(spec: dict[str, Any], key: str, ready: str) -> None:
    """Sets ``key`` bound to this process's session, then ``ready``, then sleeps until killed."""
    store = connect(spec)
    store.set(key, "alive", ephemeral=True)
    store.set(ready, "1")
    time.sleep(3600)  # the test kills this process with SIGKILL


@task
def push_after(spec: dict[str, Any], queue: str, value: str, go: str) -> int:
    store = connect(spec)
    store.wait([go])
    store.queue_push(queue, value)
    return 1


def _exercise_group(rank: int, world_size: int) -> None:
    """all_reduce on the default group, on ``new_group()`` (torch's C++ side calls back into the
    store, which may be parked: the keep-alive case) and on a pair, then barriers."""
    import torch
    import torch.distributed as dist

    expected = world_size * (world_size + 1) / 2
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == expected, t
    group = dist.new_group()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=group)
    assert t.item() == expected, t
    pair = dist.new_group(ranks=[0, 1])
    if rank in (0, 1):
        t = torch.tensor([1.0])
        dist.all_reduce(t, group=pair)
        assert t.item() == 2.0, t
    dist.barrier()
    dist.barrier(group=group)


@task
def gloo(mode: str, rank: int, world_size: int, addr: str) -> str:
    """A gloo group: ``mode`` is ``store`` (an elasticstore.Store handed to torch with no
    reference kept) or ``init_method`` (``addr`` is the URL)."""
    import gc
    from datetime import timedelta

    import torch.distributed as dist

    import elasticstore

    timeout = timedelta(seconds=60)
    if mode == "store":
        host, port = addr.rsplit(":", 1)
        # No Python reference kept: torch's C++ side holds the only one (keep-alive case).
        dist.init_process_group(
            "gloo",
            store=elasticstore.Store(host, int(port), timeout=timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    else:
        dist.init_process_group(
            "gloo", init_method=addr, rank=rank, world_size=world_size, timeout=timeout
        )
    gc.collect()
    _exercise_group(rank, world_size)
    # Rank 0 may host the server: it leaves last.
    default_store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        default_store.wait([f"exit/{r}" for r in range(1, world_size)])
    else:
        default_store.set(f"exit/{rank}", "1")
    dist.destroy_process_group()
    return f"rank {rank} ok"


@task
def gloo_etcd(rank: int, world_size: int, endpoints: list[str], prefix: str) -> str:
    """A gloo group on an EtcdStore handed to torch with no reference kept (keep-alive case):
    all_reduce on the default group, on ``new_group()`` and on a pair, then barriers."""
    import gc
    from datetime import timedelta

    import torch.distributed as dist

    import elasticstore

    timeout = timedelta(seconds=60)
    dist.init_process_group(
        "gloo",
        store=elasticstore.EtcdStore(endpoints, prefix=prefix, timeout=timeout),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    gc.collect()
    _exercise_group(rank, world_size)
    dist.destroy_process_group()
    return f"rank {rank} ok"


def main() -> None:
    name, raw = sys.argv[1], sys.argv[2]
    args = json.loads(raw)
    result = TASKS[name](*args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
