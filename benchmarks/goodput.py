"""Goodput under failures: an example (``--examples ddp``: ``examples/train_ddp.py``; ``fsdp``:
``examples/train_fsdp.py``, FSDP2) run whole, then again with a failure injected from outside
every K seconds, for ``elasticstore-run`` and torchrun in the same run.

goodput = (time of the uninterrupted run) / (time of the interrupted run), each from the launch to
the exit of every agent; the interrupted run's final weights (the example's ``--summary``: a
SHA-256 of the final weights) are compared with the uninterrupted run's at the same world size.

Scenarios:

- ``worker`` (one node, 2 workers): every K s one worker (the ranks in turn) is SIGKILLed;
- ``worker-2x2`` (two simulated nodes, 127.0.0.2 and 127.0.0.3, 2 workers each): the same;
- ``node-2x2``: every K s the second node's agent and workers are SIGKILLed (its process group)
  and a replacement node is started at once with the same command line; the world size goes from
  4 to 2 and back, so the weights are not comparable.
- ``node-standby`` (``elasticstore-run`` only): three nodes (127.0.0.2-4) with ``--nnodes 2:2``,
  so one waits as a standby; every K s a node training other than the first (whose exit ends
  the job) is SIGKILLed and a replacement started at once with the same command line: the
  standby takes the lost node's place, the replacement becomes the next standby. The world size
  stays 4, so the weights are compared.
- ``node-standby-elastic``: the same with ``--nnodes 1:2``: when the standby is not ready (still
  starting), the survivor trains alone meanwhile instead of waiting.

Launchers, each at its defaults except what it needs to survive the failures
(``--max-restarts 1000``): ``elasticstore-run`` (snapshots every step, the example's default) and
``torchrun`` (``--standalone`` on one node; on two, c10d with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, the only variant whose new round survives a worker
kill, and ``--monitor-interval 0.1``). Both resume from the example's disk checkpoints (every
``--checkpoint-every`` steps, 20; for FSDP2 DCP checkpoints, each rank its shard) where they have
nothing newer: under torchrun a snapshot lives only as long as its worker. The FSDP2 example also
records every start (``--events``: the step and every rank's restore source: memory, peer or
disk) and every step; each row keeps its restarts (``goodput_report.restarts``), the table says
where they resumed from and how many steps each trained again.

    python benchmarks/goodput.py [--intervals 8,16] [--scenarios worker,worker-2x2,node-2x2]
        [--examples ddp,fsdp] [--step-time 0.1] [--checkpoint-every 20]
        [--out benchmarks/results/goodput] [--merge] [--logs DIR]
    python benchmarks/goodput.py --render-only [--out benchmarks/results/goodput]

``--merge`` keeps the rows of ``<out>.json`` that this run did not measure again (same example,
scenario, launcher, interval): one configuration can be measured at a time; every row records
its own ``when``. ``--logs DIR`` keeps every job's agent logs and events there.
Each row keeps the failures it injected (``injected``: wall time, what); with ``--logs`` the
agents of ``elasticstore-run`` also write their events (``--log-dir``), kept as
``agent-events.jsonl`` beside their logs. ``--render-only`` runs nothing: it writes ``<out>.md`` again from ``<out>.json``. A run that did not
finish says what happened: its first node's agent still running at the limit ("not done in
300 s"), or exited non-zero, with every agent's exit ("failed (exit 1 from both agents) at
84.8 s").
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from goodput_report import LAUNCHERS, plot, render, restarts

if TYPE_CHECKING:
    import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = {"ddp": os.path.join(ROOT, "examples", "train_ddp.py"),
            "fsdp": os.path.join(ROOT, "examples", "train_fsdp.py")}
SCENARIOS = ("worker", "worker-2x2", "node-2x2", "node-standby", "node-standby-elastic")
STANDBY_ONLY = ("elasticstore-run",)  # launchers run in the node-standby scenarios
CHECKPOINT_ERROR = "RuntimeError: the background disk checkpoint failed"
LIMIT = float(os.environ.get("GOODPUT_LIMIT", "300"))  # seconds before a run counts as not done


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Run:
    """One job: its agents (each the leader of its own process group) and where it writes."""

    launcher: str
    scenario: str
    step_time: float
    example: str = "ddp"
    checkpoint_every: int = 20
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="goodput-"))
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    retired: list[subprocess.Popen[bytes]] = field(default_factory=list)
    port: int = 0
    keep: bool = False  # the agents' logs and events are kept (--logs)

    @property
    def two_nodes(self) -> bool:
        return self.scenario.endswith("2x2") or self.scenario.startswith("node-standby")

    @property
    def addrs(self) -> tuple[str, ...]:
        if self.scenario.startswith("node-standby"):
            return ("127.0.0.2", "127.0.0.3", "127.0.0.4")
        return ("127.0.0.2", "127.0.0.3") if self.two_nodes else ("127.0.0.1",)

    def example_args(self) -> list[str]:
        size = 8192 if self.two_nodes else 4096  # 64 steps per epoch at either world size
        args = [EXAMPLES[self.example], "--epochs", "3", "--dataset-size", str(size),
                "--step-time", f"{self.step_time:g}",
                "--checkpoint-dir", os.path.join(self.workdir, "ckpt"),
                "--checkpoint-every", str(self.checkpoint_every),
                "--summary", os.path.join(self.workdir, "summary.json")]
        if self.example == "fsdp":  # rank 0 records every start and step (restarts' cost)
            return [*args, "--log-every", "1", "--events", self.events]
        return [*args, "--log-every", "1000"]

    @property
    def events(self) -> str:
        return os.path.join(self.workdir, "events.jsonl")

    def command(self, addr: str) -> tuple[list[str], dict[str, str]]:
        env = dict(os.environ)
        common = ["--nproc-per-node", "2", "--max-restarts", "1000"]
        if not self.two_nodes:
            if self.launcher == "elasticstore-run":
                return ["elasticstore-run", "--standalone", *common, *self.example_args()], env
            return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--monitor-interval", "0.1", *common, *self.example_args()], env
        nnodes = {"node-2x2": "1:2", "node-standby": "2:2",
                  "node-standby-elastic": "1:2"}.get(self.scenario, "2")
        nodes = ["--nnodes", nnodes,
                 "--rdzv-endpoint", f"127.0.0.2:{self.port}", "--rdzv-id", "goodput",
                 "--local-addr", addr]
        if self.launcher == "elasticstore-run":  # its events (each round, by node) for --logs
            logs = ["--log-dir", os.path.join(self.workdir, "agent-logs")] if self.keep else []
            return ["elasticstore-run", *nodes, *common, *logs, *self.example_args()], env
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        host = "true" if addr == "127.0.0.2" else "false"
        return [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d", *nodes,
                "--rdzv-conf", f"is_host={host}", "--monitor-interval", "0.1", *common,
                *self.example_args()], env

    def start(self, addr: str) -> None:
        argv, env = self.command(addr)
        log = open(os.path.join(self.workdir, f"agent-{addr}-{len(self.retired)}.log"), "wb")  # noqa: SIM115
        self.agents[addr] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             cwd=self.workdir, start_new_session=True)
        log.close()

    def workers_of(self, addr: str) -> list[psutil.Process]:
        return self.workers([self.agents[addr]])

    def workers(self, agents: list[subprocess.Popen[bytes]] | None = None) -> list[psutil.Process]:
        import psutil  # the bench extra; --render-only needs none of it

        found = []
        script = os.path.basename(EXAMPLES[self.example])
        for agent in self.agents.values() if agents is None else agents:
            try:
                for p in psutil.Process(agent.pid).children(recursive=True):
                    cmd = " ".join(p.cmdline())
                    if script in cmd and "forkserver" not in cmd:
                        found.append(p)
            except psutil.Error:
                continue
        return found

    def kill_group(self, proc: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)

    def count_in_logs(self, text: str) -> int:
        """Lines of the agents' logs (every agent this job started) that contain ``text``."""
        n = 0
        for name in os.listdir(self.workdir):
            if name.endswith(".log"):
                with open(os.path.join(self.workdir, name), errors="replace") as f:
                    n += sum(text in line for line in f)
        return n

    def keep_logs(self, where: str) -> None:
        os.makedirs(where, exist_ok=True)
        for name in os.listdir(self.workdir):
            if name.endswith((".log", ".jsonl")):
                shutil.copy(os.path.join(self.workdir, name), where)
        # the agents' events (--log-dir <d>: <d>/<run id, or run id_suffix>/events.jsonl)
        for agents in glob.glob(os.path.join(self.workdir, "agent-logs", "*", "events.jsonl")):
            shutil.copy(agents, os.path.join(where, "agent-events.jsonl"))

    def cleanup(self) -> None:
        for proc in [*self.agents.values(), *self.retired]:
            if proc.poll() is None:
                self.kill_group(proc)
            else:  # its workers lead their own groups (elasticstore-run): gone with the agent
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        shutil.rmtree(self.workdir, ignore_errors=True)


def _inject(run: Run, interval: float, stop: threading.Event, log: list[dict[str, Any]]) -> None:
    """Every ``interval`` s: a worker (the ranks in turn) or the second node, until ``stop``."""
    import psutil

    n = 0
    while not stop.wait(interval):
        t = time.time()
        if run.scenario.startswith("node"):
            addr = "127.0.0.3"
            if run.scenario.startswith("node-standby"):  # a training node but the first
                training = [a for a in run.addrs[1:] if run.workers_of(a)]
                if not training:
                    continue
                addr = training[n % len(training)]
            old = run.agents[addr]
            try:  # the node's whole tree, whatever groups its workers lead
                tree = psutil.Process(old.pid).children(recursive=True)
            except psutil.Error:
                tree = []
            run.kill_group(old)
            for p in tree:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            run.retired.append(old)
            run.start(addr)
            log.append({"t": t, "what": f"node {addr} replaced"})
        else:
            workers = sorted(run.workers(), key=lambda p: p.pid)
            if not workers:
                continue
            victim = workers[n % len(workers)]
            try:
                victim.kill()
                log.append({"t": t, "what": f"worker pid {victim.pid}"})
            except psutil.Error:
                pass
        n += 1


def run_job(launcher: str, scenario: str, step_time: float, interval: float | None,
            example: str = "ddp", checkpoint_every: int = 20,
            logs: str | None = None) -> dict[str, Any]:
    run = Run(launcher, scenario, step_time, example=example, checkpoint_every=checkpoint_every,
              keep=logs is not None)
    run.port = _free_port("127.0.0.2")
    failures: list[dict[str, Any]] = []
    stop = threading.Event()
    result: dict[str, Any] = {"launcher": launcher, "scenario": scenario, "interval": interval,
                              "example": example, "checkpoint_every": checkpoint_every,
                              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        t0 = time.monotonic()
        for addr in run.addrs:
            run.start(addr)
        injector = None
        if interval is not None:
            injector = threading.Thread(target=_inject, args=(run, interval, stop, failures),
                                        daemon=True)
            injector.start()
        deadline = t0 + LIMIT
        first = next(iter(run.agents.values()))  # never the one replaced
        while time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        elapsed = time.monotonic() - t0  # the job ends when its first node is done
        stop.set()  # no failure after that: a replacement started now would find a finished job
        if injector is not None:
            injector.join(30)
        for proc in run.agents.values():  # the others follow (a late replacement is refused)
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        codes = [p.poll() for p in run.agents.values()]  # the first node's first; None: running
        result.update(seconds=elapsed, failures=len(failures), codes=codes,
                      done=first.poll() == 0, limit=LIMIT, injected=failures)
        summary = os.path.join(run.workdir, "summary.json")
        if os.path.exists(summary):
            with open(summary) as f:
                s = json.load(f)
            result.update(weights=s.get("weights_sha256"), world=s.get("world_size"))
        if example == "fsdp":
            result["restarts"] = restarts(run.events)
            # ranks that stopped on an error of their background DCP checkpoint (not injected)
            result["checkpoint_errors"] = run.count_in_logs(CHECKPOINT_ERROR)
        if logs is not None:
            run.keep_logs(os.path.join(logs, f"{example}-{scenario}-{launcher}-"
                                             f"{'base' if interval is None else f'{interval:g}'}"))
        return result
    finally:
        stop.set()
        run.cleanup()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--intervals", default="8,16", help="seconds between failures (comma list)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--launchers", default=",".join(LAUNCHERS))
    p.add_argument("--examples", default="ddp", help="ddp, fsdp or both (comma list)")
    p.add_argument("--checkpoint-every", type=int, default=20,
                   help="the example's --checkpoint-every: steps between disk checkpoints")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of <out>.json this run does not measure again")
    p.add_argument("--logs", default=None, help="keep every job's agent logs and events here")
    p.add_argument("--step-time", type=float, default=0.1, help="the example's --step-time")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "goodput"))
    p.add_argument("--render-only", action="store_true",
                   help="run nothing: write <out>.md again from <out>.json")
    args = p.parse_args()
    if args.render_only:
        with open(args.out + ".json") as f:
            table = render(json.load(f)["rows"])
        with open(args.out + ".md", "w") as f:
            f.write(table)
        print(table, end="")
        return
    intervals = [float(x) for x in args.intervals.split(",")]
    examples = args.examples.split(",")
    for name, values, known in (("--examples", examples, EXAMPLES),
                                ("--scenarios", args.scenarios.split(","), SCENARIOS),
                                ("--launchers", args.launchers.split(","), LAUNCHERS)):
        if any(v not in known for v in values):
            p.error(f"argument {name}: {','.join(values)}: each must be one of {', '.join(known)}")
    rows = []
    for example, scenario, launcher in [(e, s, la) for e in examples
                                        for s in args.scenarios.split(",")
                                        for la in args.launchers.split(",")]:
        if scenario.startswith("node-standby") and launcher not in STANDBY_ONLY:
            continue
        job = {"example": example, "checkpoint_every": args.checkpoint_every, "logs": args.logs}
        base = run_job(launcher, scenario, args.step_time, None, **job)
        print(json.dumps(base), flush=True)
        for interval in intervals if scenario == "worker" else intervals[:1]:
            row = run_job(launcher, scenario, args.step_time, interval, **job)
            if base.get("done") and row.get("done"):
                row["goodput"] = base["seconds"] / row["seconds"]
            comparable = (scenario not in ("node-2x2", "node-standby-elastic")
                          and row.get("world") == base.get("world"))
            row["same_weights"] = row.get("weights") == base.get("weights") if comparable else None
            row["baseline_seconds"] = base["seconds"]
            if "checkpoint_errors" in base:
                row["baseline_checkpoint_errors"] = base["checkpoint_errors"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    doc = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "step_time": args.step_time, "rows": rows}
    if args.merge and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            doc = json.load(f)
        def key(r: dict[str, Any]) -> tuple[Any, ...]:
            return r.get("example", "ddp"), r["scenario"], r["launcher"], r["interval"]
        again = {key(r) for r in rows}
        doc["rows"] = [r for r in doc["rows"] if key(r) not in again] + rows
        rows = doc["rows"]
    with open(args.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    table = render(rows)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    print(table)
    plot(rows, args.out + ".png")


if __name__ == "__main__":
    main()
