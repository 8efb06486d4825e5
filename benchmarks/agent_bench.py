"""elasticstore-run against torchrun 2.13, same script, same run, real processes on loopback.

Scenarios (2 simulated nodes on 127.0.0.2/127.0.0.3, 3 for ``host-loss`` (127.0.0.4), 2 gloo
workers each, ``tests/helpers/programs/agent_train.py``):

- ``cold``: both launchers started -> all 4 workers past ``init_process_group``;
- ``worker-kill``: rank 3 SIGKILLed -> all 4 workers of the new round past ``init_process_group``;
- ``node-loss`` (``--nnodes 1:2``): node 2's agent and workers SIGKILLed at once -> node 1's
  workers past ``init_process_group`` at world size 2;
- ``host-loss`` (3 nodes, ``--nnodes 2:3``): the process group of node 1 (127.0.0.2, whose agent
  hosts the rendezvous store) and its workers SIGKILLed once all 6 workers are past
  ``init_process_group`` -> the two survivors' 4 workers past it at world size 4; then the file
  ``release`` ends the job and the survivors' agents' exit codes are recorded (bounded wait), with
  the restarts they spent. Our launchers get all three in ``--rdzv-endpoint`` (the store moves
  to a survivor); torch's c10d backend takes one endpoint, ``127.0.0.2:P`` (``is_host`` there).

Peers: ``elasticstore-run`` (native rendezvous, warm start), ``elasticstore-run-fresh`` (the same
with ``ELASTICSTORE_FORK_SERVER=fresh``: the fork server a fresh interpreter that imports torch
itself, as before it was a copy of the launcher), ``torchrun-plugin`` (torch's own agent
on ``--rdzv-backend=elasticstore``), ``torchrun`` (c10d rendezvous, its defaults: the rendezvous
store shared with the workers) and ``torchrun-noshare`` (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).
Every launcher runs with its defaults (``last_call_timeout`` 30 s for all); ``--last-call S`` sets
it for all of them, to show a tuned figure beside the default one. One sample per cell: the
scenarios take seconds to tens of seconds each on this machine. The rows of a run replace those
of the same scenario, launcher and last call in ``OUT.json`` (the others are kept, each with the
time it was measured), and ``OUT.md`` is rendered from all of them. At the end of every scenario,
each process it started (agents, workers, their sessions and children) is checked gone.

    python benchmarks/agent_bench.py [--out benchmarks/results/agent] [--only elasticstore-run]
        [--scenarios host-loss] [--last-call 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers"))

from agent_nodes import Agents, alive, assert_gone, free_port, until  # noqa: E402

PEERS = ("elasticstore-run", "elasticstore-run-fresh", "torchrun-plugin", "torchrun", "torchrun-noshare")
SCENARIOS = ("cold", "worker-kill", "node-loss", "host-loss")  # all but "cold" by default
ADDRS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
LIMIT = float(os.environ.get("AGENT_BENCH_LIMIT", "90"))  # seconds before "did not recover"
EXIT_WAIT = float(os.environ.get("AGENT_BENCH_EXIT_WAIT", "60"))  # survivors' exit after release
SPENT = re.compile(r"\[elasticstore-run\] .*; restart \d+/\d+")  # a restart spent on a failure


def _start(a: Agents, peer: str, addr: str, port: int, nnodes: str, first: bool,
           last_call: float | None, hosts: tuple[str, ...] = ADDRS[:1]) -> Any:
    """``hosts``: the endpoint list our launchers get; torch's c10d gets the first alone."""
    ours = ",".join(f"{h}:{port}" for h in hosts)
    endpoint = ours if peer.startswith("elasticstore-run") or peer == "torchrun-plugin" else f"{hosts[0]}:{port}"
    common = ["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-endpoint", endpoint,
              "--rdzv-id", "bench", "--local-addr", addr, "--max-restarts", "3"]
    conf = [] if last_call is None else [f"last_call_timeout={last_call:g}"]
    if peer.startswith("elasticstore-run"):
        fresh = {"ELASTICSTORE_FORK_SERVER": "fresh"} if peer == "elasticstore-run-fresh" else {}
        return a.start([*common, *(["--rdzv-conf", *conf] if conf else [])], name=addr, env=fresh)
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


def _procs() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every process."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                found[int(name)] = (int(fields[1]), int(fields[3]))
            except (OSError, IndexError, ValueError):
                pass
    return found


def _tree(roots: list[int]) -> list[int]:
    """``roots``' descendants and the members of their sessions (the agents' and the workers'):
    every process a launcher started, as far as it still runs."""
    procs = _procs()
    found = {pid for pid, (_, sid) in procs.items() if sid in roots}
    for _ in range(64):
        more = {pid for pid, (ppid, _) in procs.items() if ppid in found or ppid in roots}
        if more <= found:
            break
        found |= more
    return sorted(found - set(roots))


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _exits(procs: list[Any], within: float) -> list[int | None]:
    """The exit codes of ``procs`` (None: still running ``within`` s from now)."""
    deadline = time.monotonic() + within
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(0.0, deadline - time.monotonic())))
        except Exception:  # subprocess.TimeoutExpired
            codes.append(None)
    return codes


def _spent(a: Agents, peer: str, survivors: list[Any],
           ready: list[tuple[int, int]]) -> list[int] | None:
    """The restarts each survivor spent (elasticstore-run says so; torch's agent gives its
    workers its restart count, max_restarts less the restarts left: read from the workers of the
    new round, by node rank); None when they are not known (no new round)."""
    if peer.startswith("elasticstore-run"):
        return [len(SPENT.findall(a.output(p))) for p in survivors]
    counts: dict[int, int] = {}
    for s in a.starts():
        if (s["attempt"], s["rank"]) in ready:
            counts[int(s["env"]["GROUP_RANK"])] = int(s["env"]["TORCHELASTIC_RESTART_COUNT"])
    return [counts[g] for g in sorted(counts)] if ready else None


def _cleanup(a: Agents, nodes: list[Any], seen: list[int]) -> list[int]:
    """Kills what is left of the scenario (the agents, their process groups, every worker and
    child recorded or ``seen``) and checks each process gone; returns those still running 10 s
    later (killed again, then)."""
    roots = [p.pid for p in nodes]
    pids = sorted({*seen, *_tree(roots + a.all_pids())})
    a.cleanup_quiet()
    for pgid in roots:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    pids = sorted({*pids, *_tree(roots + a.all_pids())})
    _kill(pids)
    try:
        assert_gone(roots + a.all_pids() + pids, 10.0)
    except AssertionError:
        return [p for p in roots + a.all_pids() + pids if alive(p)]
    return []


def scenario(peer: str, kind: str, last_call: float | None = None) -> dict[str, Any]:
    port = free_port()
    a = Agents(tempfile.mkdtemp(prefix=f"agentbench-{peer}-{kind}-"))
    result: dict[str, Any] = {"peer": peer, "scenario": kind, "last_call": last_call,
                              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    nodes: list[Any] = []
    seen: list[int] = []  # the lost node's processes, killed
    try:
        nnodes = {"node-loss": "1:2", "host-loss": "2:3"}.get(kind, "2")
        addrs = ADDRS if kind == "host-loss" else ADDRS[:2]
        t0 = time.time()
        nodes = [_start(a, peer, addr, port, nnodes, i == 0, last_call, addrs if kind == "host-loss"
                        else ADDRS[:1]) for i, addr in enumerate(addrs)]
        until(lambda: _ready(a, 2 * len(addrs), t0) is not None, LIMIT, "cold start")
        cold = _ready(a, 2 * len(addrs), t0) or []
        result["cold"] = max(_inits(a, cold)) - t0
        if kind == "cold":
            return result
        first = [s for s in a.starts() if (s["attempt"], s["rank"]) in cold]
        t1 = time.time()
        if kind == "worker-kill":
            os.kill(next(s["pid"] for s in first if s["rank"] == 3), signal.SIGKILL)
            world = 4
        elif kind == "host-loss":
            # Node 1 is lost whole: the process group its agent was started in (start_new_session:
            # pgid = pid), and its workers and their children wherever they are (torch's agent
            # starts each worker in a session of its own).
            seen = _tree([nodes[0].pid])
            os.killpg(nodes[0].pid, signal.SIGKILL)
            _kill(seen)
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
        ready: list[tuple[int, int]] = []
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
        if kind == "host-loss":
            a.release()
            survivors = nodes[1:]
            result["exits"] = _exits(survivors, EXIT_WAIT)
            result["restarts"] = _spent(a, peer, survivors, ready if result["recovery"] else [])
            if any(code != 0 for code in result["exits"]):
                tail = int(os.environ.get("AGENT_BENCH_TAIL", "600"))
                result["exit_tail"] = [a.output(p)[-tail:] for p in survivors]
        return result
    finally:
        left = _cleanup(a, nodes, seen)
        if left:
            result["left_running"] = left
            print(f"{peer} {kind}: processes still running 10 s after the kill: {left}",
                  file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "agent"))
    p.add_argument("--only", action="append", choices=PEERS)
    p.add_argument("--scenarios", default=",".join(SCENARIOS[1:]),
                   help="comma-separated, of: " + ", ".join(SCENARIOS))
    p.add_argument("--last-call", type=float, default=None,
                   help="last_call_timeout for every launcher (default: each launcher's default)")
    args = p.parse_args()
    kinds = args.scenarios.split(",")
    if unknown := [k for k in kinds if k not in SCENARIOS]:
        p.error(f"unknown scenario(s): {', '.join(unknown)}")
    rows = []
    for kind in kinds:
        for peer in args.only or PEERS:
            row = scenario(peer, kind, args.last_call)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("tail")}), flush=True)
            rows.append(row)
    rows = merge(args.out + ".json", rows)
    with open(args.out + ".json", "w") as f:
        json.dump({"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(render(rows))
    print(render(rows))


def merge(path: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows kept in ``path`` (each with the time of the run that measured it), a row of
    ``rows`` in place of the one of the same scenario, launcher and last call; new ones last."""
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["scenario"], r["peer"], r.get("last_call")

    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return rows
    new = {key(r): r for r in rows}
    merged = [new.pop(key(r), None) or dict(r, when=r.get("when", old.get("when")))
              for r in old.get("rows", [])]
    return merged + [r for r in rows if key(r) in new]


def render(rows: list[dict[str, Any]]) -> str:
    def fmt(v: Any) -> str:
        return "—" if v is None else f"{v:.2f} s"

    def exits(r: dict[str, Any]) -> str:
        if "exits" not in r:
            return ""
        codes = ", ".join("still running" if c is None else str(c) for c in r["exits"])
        spent = ", ".join(str(n) for n in r.get("restarts") or [])
        return f"{codes} (restarts spent: {spent})" if spent else codes

    lines = ["| scenario | launcher | last call | cold start (all past init) | recovery (past init) "
             "| vs torchrun (c10d) | survivors' exit after release |",
             "|---|---|---|---|---|---|---|"]
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
                     f"{fmt(r.get('recovery'))}{note} | {ratio} | {exits(r)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
