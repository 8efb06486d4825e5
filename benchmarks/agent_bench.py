"""elasticstore-run against torchrun 2.13, same script, same run, real processes on loopback.

Scenarios (2 simulated nodes on 127.0.0.2/127.0.0.3, 2 gloo workers each, ``tests/helpers/programs/agent_train.py``):

- ``cold``: both launchers started -> all 4 workers past ``init_process_group``;
- ``worker-kill``: rank 3 SIGKILLed -> all 4 workers of the new round past ``init_process_group``;
- ``node-loss`` (``--nnodes 1:2``): node 2's agent and workers SIGKILLed at once -> node 1's
  workers past ``init_process_group`` at world size 2.

Peers: ``elasticstore-run`` (native rendezvous, warm start), ``torchrun-plugin`` (torch's own agent
on ``--rdzv-backend=elasticstore``), ``torchrun`` (c10d rendezvous, its defaults: the rendezvous
store shared with the workers) and ``torchrun-noshare`` (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).
Every launcher runs with its defaults (``last_call_timeout`` 30 s for all); ``--last-call S`` sets
it for all of them, to show a tuned figure beside the default one. One sample per cell: the
scenarios take seconds to tens of seconds each on this machine.

    python benchmarks/agent_bench.py [--out benchmarks/results/agent] [--only elasticstore-run]
        [--last-call 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers"))

from agent_nodes import Agents, assert_gone, free_port, until  # noqa: E402

PEERS = ("elasticstore-run", "torchrun-plugin", "torchrun", "torchrun-noshare")
LIMIT = float(os.environ.get("AGENT_BENCH_LIMIT", "90"))  # seconds before "did not recover"


def _start(a: Agents, peer: str, addr: str, port: int, nnodes: str, first: bool,
           last_call: float | None) -> Any:
    common = ["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.2:{port}",
              "--rdzv-id", "bench", "--local-addr", addr, "--max-restarts", "3"]
    conf = [] if last_call is None else [f"last_call_timeout={last_call:g}"]
    if peer == "elasticstore-run":
        return a.start([*common, *(["--rdzv-conf", *conf] if conf else [])], name=addr)
    if peer == "torchrun-plugin":
        return a.start(["--rdzv-backend", "elasticstore", *common,
                        *(["--rdzv-conf", *conf] if conf else [])], name=addr,
                       module="torch.distributed.run")
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if peer == "torchrun-noshare" else {}
    conf.append(f"is_host={'true' if first else 'false'}")
    return a.start(["--rdzv-backend", "c10d", *common, "--rdzv-conf", ",".join(conf)], name=addr,
                   env=env, module="torch.distributed.run")


def _ready(a: Agents, world: int, after: float) -> list[tuple[int, int]] | None:
    """The (attempt, rank) of ``world`` workers, one per rank, all past init_process_group after
    ``after`` at that world size; None until then. Attempt numbers are not compared across nodes:
    torch's agent numbers a round it joins for a membership change like the one before (its
    restart count), so a survivor's new workers may reuse an earlier attempt's number."""
    worlds = {(s["attempt"], s["rank"]): s["world"] for s in a.starts()}
    chosen: dict[int, tuple[float, int]] = {}
    for att in {att for att, _ in worlds}:
        for rank, t in a.inits(att).items():
            if t >= after and worlds.get((att, rank)) == world and t > chosen.get(rank, (0.0, 0))[0]:
                chosen[rank] = (t, att)
    if sorted(chosen) != list(range(world)):
        return None
    return [(att, rank) for rank, (_, att) in sorted(chosen.items())]


def _inits(a: Agents, ready: list[tuple[int, int]]) -> list[float]:
    return [a.inits(att)[rank] for att, rank in ready]


def scenario(peer: str, kind: str, last_call: float | None = None) -> dict[str, Any]:
    port = free_port()
    a = Agents(tempfile.mkdtemp(prefix=f"agentbench-{peer}-{kind}-"))
    result: dict[str, Any] = {"peer": peer, "scenario": kind, "last_call": last_call}
    try:
        nnodes = "1:2" if kind == "node-loss" else "2"
        t0 = time.time()
        nodes = [_start(a, peer, addr, port, nnodes, i == 0, last_call)
                 for i, addr in enumerate(("127.0.0.2", "127.0.0.3"))]
        until(lambda: _ready(a, 4, t0) is not None, LIMIT, "cold start")
        cold = _ready(a, 4, t0) or []
        result["cold"] = max(_inits(a, cold)) - t0
        if kind == "cold":
            return result
        first = [s for s in a.starts() if (s["attempt"], s["rank"]) in cold]
        t1 = time.time()
        if kind == "worker-kill":
            os.kill(next(s["pid"] for s in first if s["rank"] == 3), signal.SIGKILL)
            world = 4
        else:
            victims = [s["pid"] for s in first if s["env"].get("GROUP_RANK") == "1"]
            os.kill(nodes[1].pid, signal.SIGKILL)
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            world = 2
        try:
            until(lambda: _ready(a, world, t1) is not None, LIMIT, "recovery")
            ready = _ready(a, world, t1) or []
            result["recovery"] = max(_inits(a, ready)) - t1
            starts = [s for s in a.starts() if (s["attempt"], s["rank"]) in ready]
            result["warm"] = all(s["preloaded"] for s in starts)
        except AssertionError:
            result["recovery"] = None
            result["note"] = f"no new round past init_process_group within {LIMIT:g}s"
            tails = [a.output(p)[-int(os.environ.get("AGENT_BENCH_TAIL", "600")):] for p in nodes]
            result["tail"] = tails
        return result
    finally:
        a.cleanup_quiet()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "agent"))
    p.add_argument("--only", action="append", choices=PEERS)
    p.add_argument("--scenarios", default="worker-kill,node-loss")
    p.add_argument("--last-call", type=float, default=None,
                   help="last_call_timeout for every launcher (default: each launcher's default)")
    args = p.parse_args()
    rows = []
    for kind in args.scenarios.split(","):
        for peer in args.only or PEERS:
            row = scenario(peer, kind, args.last_call)
            print(json.dumps({k: v for k, v in row.items() if k != "tail"}), flush=True)
            rows.append(row)
    with open(args.out + ".json", "w") as f:
        json.dump({"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(render(rows))
    print(render(rows))


def render(rows: list[dict[str, Any]]) -> str:
    def fmt(v: Any) -> str:
        return "—" if v is None else f"{v:.2f} s"

    lines = ["| scenario | launcher | last call | cold start (2x2 past init) | recovery (past init) "
             "| vs torchrun (c10d) |", "|---|---|---|---|---|---|"]
    base = {(r["scenario"], r.get("last_call")): r.get("recovery") for r in rows
            if r["peer"] == "torchrun"}
    for r in rows:
        ratio = ""
        b = base.get((r["scenario"], r.get("last_call")))
        if r.get("recovery") is not None and b:
            ratio = f"{r['recovery'] / b:.2f}x"
        note = f" ({r['note']})" if r.get("note") else ""
        last = "default (30 s)" if r.get("last_call") is None else f"{r['last_call']:g} s"
        lines.append(f"| {r['scenario']} | {r['peer']} | {last} | {fmt(r.get('cold'))} | "
                     f"{fmt(r.get('recovery'))}{note} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
