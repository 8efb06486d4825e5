"""A real elastic job on this machine: the README's first command (``bash scripts/demo``).

Two simulated nodes, on 127.0.0.2 and 127.0.0.3, each an ``elasticstore-run`` agent with two
workers; the first hosts the embedded native rendezvous store. They run ``examples/train_ddp.py``
(DDP on gloo, the elastic sampler, an in-memory snapshot every step in the agents' shared memory,
a disk checkpoint every 10 steps), and one worker fails on purpose mid-run (``--fail-at-step``).
Its agent ends the round for both nodes, the next round starts the four workers again (warm, from
the agents' fork servers) and they resume from the newest snapshot, the step before the failure,
not from the last disk checkpoint; the job finishes. Then an uninterrupted run of the same job at the same world size
(one agent, four workers) gives the weights to compare with.

Prints the agents' and rank 0's lines as they come, then the rounds, the step the group resumed
from (and how many steps the failure cost), the recovery time (from the failure to the restarted
group's first step, from timestamps the example writes with ``--events``), the final loss, and a
one-line verdict. Exit code 0 only when the job recovered from the step before the failure,
every sample of each epoch was trained on exactly once, and (unless ``--no-compare``) the final
weights are bit for bit those of the uninterrupted run. Every process it starts is stopped when it
ends, also on error or Ctrl-C.

    python examples/elastic_demo.py [--nproc-per-node 2] [--fail-at-step 25] [--no-compare]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE / "train_ddp.py"
NODES = ("127.0.0.2", "127.0.0.3")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--dataset-size", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--fail-at-step", type=int, default=25)
    p.add_argument("--fail-rank", type=int, default=None, help="default: the last rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compare", action="store_true",
                   help="skip the uninterrupted run (and the comparison of the final weights)")
    p.add_argument("--timeout", type=float, default=120.0, help="for the whole demo, in seconds")
    p.add_argument("--workdir", default=None, help="default: a temporary directory, removed after")
    p.add_argument("--verbose", action="store_true", help="show every line of every worker")
    args = p.parse_args(argv)
    world = 2 * args.nproc_per_node
    if args.nproc_per_node < 1:
        p.error("argument --nproc-per-node: must be >= 1")
    if args.fail_rank is None:
        args.fail_rank = world - 1
    if not 0 <= args.fail_rank < world:
        p.error(f"argument --fail-rank: must be in 0..{world - 1}")
    steps = args.epochs * -(-args.dataset_size // (world * args.batch_size))
    if not args.checkpoint_every < args.fail_at_step <= steps:
        p.error(f"argument --fail-at-step: must be past the first checkpoint "
                f"({args.checkpoint_every}) and at most the job's {steps} steps")
    return args


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Lines:
    """Every line of every started process, with the time it arrived, in one queue."""

    def __init__(self) -> None:
        self.q: queue.Queue[tuple[float, str, str]] = queue.Queue()

    def follow(self, name: str, stream: IO[str], log: IO[str]) -> threading.Thread:
        def pump() -> None:
            with log:
                for line in stream:
                    log.write(line)
                    log.flush()
                    self.q.put((time.time(), name, line.rstrip("\n")))

        thread = threading.Thread(target=pump, name=f"lines-{name}", daemon=True)
        thread.start()
        return thread


class Procs:
    """Processes started in sessions of their own, stopped by process group in ``close``."""

    def __init__(self, workdir: Path, lines: Lines) -> None:
        self.workdir, self.lines = workdir, lines
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.readers: dict[int, threading.Thread] = {}

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen[str]:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.Popen(cmd, cwd=self.workdir, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        assert proc.stdout is not None
        self.readers[proc.pid] = self.lines.follow(name, proc.stdout,
                                                   open(self.workdir / f"{name}.log", "w"))
        self.procs[name] = proc
        return proc

    def close(self) -> None:
        """SIGTERM to each one still running (an agent forwards it to its workers, whose trees
        die with it), SIGKILL after 10 s."""
        running = [p for p in self.procs.values() if p.poll() is None]
        for proc in running:
            _killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in running:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            _killpg(proc.pid, signal.SIGKILL)  # whatever is left of its session
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def agent_cmd(args: argparse.Namespace, flags: list[str], ckpt: Path, summary: Path,
              events: Path | None, fail: bool) -> list[str]:
    train = ["--epochs", str(args.epochs), "--dataset-size", str(args.dataset_size),
             "--batch-size", str(args.batch_size), "--checkpoint-every", str(args.checkpoint_every),
             "--log-every", "8", "--seed", str(args.seed), "--checkpoint-dir", str(ckpt),
             "--summary", str(summary)]
    if events is not None:
        train += ["--events", str(events)]
    if fail:
        train += ["--fail-at-step", str(args.fail_at_step), "--fail-rank", str(args.fail_rank)]
    return [sys.executable, "-m", "elasticstore.run", *flags, str(EXAMPLE), *train]


SHOWN = re.compile(r"^\[elasticstore-run\]|^\[[^\]]*:0\] |failing on purpose|Traceback|Error")


class Demo:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.dir = args, workdir
        self.deadline = time.monotonic() + args.timeout
        self.lines = Lines()
        self.procs = Procs(workdir, self.lines)
        self.t0 = time.time()

    def say(self, text: str) -> None:
        print(f"demo: {text}", flush=True)

    def pump(self, until_exit: list[subprocess.Popen[str]],
             what: str) -> list[tuple[float, str, str]]:
        """Shows lines until every process of ``until_exit`` exited (and their lines are in)."""
        seen: list[tuple[float, str, str]] = []
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise DemoFailed(
                    f"{what} did not finish within the demo's {self.args.timeout:.0f} s")
            try:
                t, name, line = self.lines.q.get(timeout=min(0.2, left))
            except queue.Empty:
                if all(p.poll() is not None and not self.procs.readers[p.pid].is_alive()
                       for p in until_exit) and self.lines.q.empty():
                    return seen
                continue
            seen.append((t, name, line))
            if self.args.verbose or SHOWN.search(line):
                print(f"  {t - self.t0:6.2f}s {name:>6} | {line}", flush=True)

    def run(self) -> int:
        a, world = self.args, 2 * self.args.nproc_per_node
        port = free_port(NODES[0])
        ckpt, summary = self.dir / "ckpt", self.dir / "summary.json"
        events = self.dir / "events.jsonl"
        self.say(f"2 simulated nodes ({', '.join(NODES)}) x {a.nproc_per_node} workers, "
                 f"rendezvous on the embedded native store at {NODES[0]}:{port}; rank "
                 f"{a.fail_rank} fails at step {a.fail_at_step} (a snapshot in memory every "
                 f"step, a disk checkpoint every {a.checkpoint_every} steps)")
        agents = []
        for i, host in enumerate(NODES, 1):
            flags = ["--nnodes", "2", "--nproc-per-node", str(a.nproc_per_node),
                     "--rdzv-endpoint", f"{NODES[0]}:{port}", "--rdzv-id", "demo",
                     "--local-addr", host, "--max-restarts", "2",
                     "--rdzv-conf", "last_call_timeout=1"]
            agents.append(self.procs.start(f"node{i}",
                                           agent_cmd(a, flags, ckpt, summary, events, fail=True)))
        seen = self.pump(agents, "the elastic job")
        codes = [p.returncode for p in agents]
        if any(codes):
            raise DemoFailed(f"the agents exited with {codes} (logs: {self.dir})")
        result = json.loads(summary.read_text())
        evs = [json.loads(line) for line in events.read_text().splitlines()]

        rounds = [(name, line) for _, name, line in seen
                  if re.match(r"\[elasticstore-run\] round \d+:", line)]
        self.say("rounds:")
        for name, line in rounds:
            print(f"  {name}: {line.removeprefix('[elasticstore-run] ')}", flush=True)
        fails = [e for e in evs if e["event"] == "fail"]
        if not fails:
            raise DemoFailed("no worker failed (the job ended before --fail-at-step?)")
        failed_at = fails[0]["time"]
        firsts = [e for e in evs if e["event"] == "first_step" and e["time"] > failed_at]
        if not firsts or result["restart_count"] < 1:
            raise DemoFailed("the group did not restart after the failure")
        recovery = firsts[0]["time"] - failed_at
        resumed = next((line for _, _, line in seen if "resumed from step" in line), "?")
        self.say(f"rank {fails[0]['rank']} failed at step {fails[0]['step']}; the restarted group "
                 f"{resumed.split('] ', 1)[-1]}; its first step (step {firsts[0]['step']}) came "
                 f"{recovery:.2f} s after the failure")
        resumed_at = int(m.group(1)) if (m := re.search(r"resumed from step (\d+)", resumed)) else -1
        lost = fails[0]["step"] - resumed_at
        if lost != 1:
            raise DemoFailed(f"the group resumed from step {resumed_at}, not from the step before "
                             f"the failure ({fails[0]['step'] - 1}): {resumed}")
        self.say(f"the failure cost {lost} step: the last disk checkpoint was step "
                 f"{(fails[0]['step'] - 1) // a.checkpoint_every * a.checkpoint_every}, the "
                 "snapshot in memory had the step before the failure")
        self.say(f"final loss {result['final_loss']:.6f} after {result['steps']} steps, "
                 f"weights {result['weights_sha256'][:16]}")

        expected = [float(a.dataset_size), a.dataset_size * (a.dataset_size - 1) / 2,
                    (a.dataset_size - 1) * a.dataset_size * (2 * a.dataset_size - 1) / 6]
        stats = result["epoch_stats"]
        if a.dataset_size % (world * a.batch_size) == 0:  # no padding: each sample exactly once
            bad = [e for e in range(a.epochs) if stats.get(str(e)) != expected]
            if bad:
                raise DemoFailed(
                    f"epoch(s) {bad} did not train on every sample exactly once: {stats}")
            once = "every sample seen once per epoch"
        else:
            once = "sample counts not checked (the last batch is padded)"

        compared = ""
        if not a.no_compare:
            self.say("the same job uninterrupted, for comparison: one agent, "
                     f"--nproc-per-node {world} (world size {world})")
            ref_summary = self.dir / "reference.json"
            ref = self.procs.start("ref", agent_cmd(
                a, ["--standalone", "--nproc-per-node", str(world)], self.dir / "ref-ckpt",
                ref_summary, None, fail=False))
            self.pump([ref], "the uninterrupted run")
            if ref.returncode != 0:
                raise DemoFailed(
                    f"the uninterrupted run exited with {ref.returncode} (logs: {self.dir})")
            reference = json.loads(ref_summary.read_text())
            if reference["weights_sha256"] != result["weights_sha256"]:
                raise DemoFailed(f"final weights differ from the uninterrupted run's: "
                                 f"{result['weights_sha256'][:16]} != "
                                 f"{reference['weights_sha256'][:16]}")
            compared = ", weights identical to an uninterrupted run"
        self.say(f"OK — recovered in {recovery:.2f} s, final loss {result['final_loss']:.4f}"
                 f"{compared}, {once} ({time.time() - self.t0:.0f} s in all)")
        return 0


class DemoFailed(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keep = args.workdir is not None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="elasticstore-demo-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    demo = Demo(args, workdir)
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` runs
    failed = True
    try:
        code = demo.run()
        failed = False
        return code
    except DemoFailed as exc:
        print(f"demo: FAILED — {exc}", flush=True)
        keep = True
        return 1
    except KeyboardInterrupt:
        print("demo: interrupted", flush=True)
        return 130
    finally:
        demo.procs.close()
        signal.signal(signal.SIGTERM, old)
        if failed:
            keep = True
            print(f"demo: logs, checkpoints and events are in {workdir}", flush=True)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
