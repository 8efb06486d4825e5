"""A randomized fault schedule (a nemesis) for jobs of real agents on the native backend with an
agent-hosted store: a job of 3 or 4 nodes (one ``elasticstore-run`` each, on its own 127.0.0.x,
one endpoint list naming all of them, 1 worker each running ``programs/steps_train.py``) goes
through episodes; each episode SIGKILLs (and restarts after a random delay, same command line)
or SIGSTOPs (and SIGCONTs after a random delay) one random node, the store's host among them,
and sometimes a second one. What is checked (``Job.violations``):

(a) never two groups train in overlapping time under one run id (``step_log.overlaps``);
(b) after an episode that left a majority of the last round unfaulted (the quorum rule needs
    more than half of it; a restarted node is a new member), the job trains again within
    ``RECOVER`` seconds of the last restart/SIGCONT, and at the end every node still running
    finishes with exit 0;
(c) what is carried across a switch never goes backwards: the rounds (attempts) of the groups,
    in the order they trained, strictly increase, and so do their restart counts (not
    decreasing), unless every member of the last group was killed (then nobody carries the run:
    a node restarted afterwards starts it afresh); each node's console shows its rounds
    increasing.

Partitions are not part of the schedule: ``netfaults.py`` puts a node in a network namespace
with its own subnet, so a job would need every node in a namespace of its own and the endpoint
list rewritten per node; the partition case is tested on its own
(``tests/rendezvous/test_rendezvous_failover.py``). A SIGSTOP of a node's whole process tree is
what a partition looks like from the others (silence, no FIN).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from agent_nodes import Agents, free_port, tree
from step_log import STEPS_TRAIN, Group, groups, overlaps

RECOVER = 45.0  # s: (b) training again after the last fault of a one-node episode healed
JOIN_TIMEOUT = 25  # s: rdzv-conf join_timeout of the jobs (a node that cannot join gives up)
STORE_TIMEOUT = 5  # s: rdzv-conf store_timeout (the host probe's bound, hostprobe.py)
_THREAD_START = ("run", "_bootstrap", "_bootstrap_inner")  # threading.py's frames under any thread
_ROUND_LINE = re.compile(r"\[elasticstore-run\] round (\d+): \d+ node\(s\) \[([^\]]*)\]")
FINISHED_WITHOUT_IT = "is closed (finished: a job with this run id already succeeded)"


def _pid_of(node_id: str) -> int | None:
    """The agent's pid in a node id (``addr-pid-random``)."""
    parts = node_id.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


@dataclass
class Fault:
    node: int
    kind: str  # "kill" (then restart) or "stop" (then SIGCONT)
    at: float  # s after the episode's start
    heal_after: float  # s after the fault

    def describe(self) -> str:
        return f"{self.kind} node {self.node} at +{self.at:.1f}s, healed {self.heal_after:.1f}s later"


def episode(rng: random.Random, nodes: int, host: int) -> list[Fault]:
    """One episode's faults: one node (the store's host half of the time), sometimes two."""
    first = host if rng.random() < 0.5 else rng.randrange(nodes)
    targets = [first]
    if rng.random() < 0.2:
        targets.append(rng.choice([n for n in range(nodes) if n != first]))
    faults = []
    for node in targets:
        kind = rng.choice(["kill", "kill", "stop"])
        heal = rng.uniform(0.2, 3.0) if kind == "kill" else rng.uniform(1.0, 8.0)
        faults.append(Fault(node, kind, rng.uniform(0.0, 2.0), heal))
    return faults


@dataclass
class Job:
    """One job of ``nodes`` agents; ``index`` keeps its addresses apart from other jobs'."""

    workdir: str
    nodes: int
    index: int
    run_id: str
    port: int = 0
    agents: Agents = field(init=False)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    incarnations: dict[int, int] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    killed: dict[tuple[str, int], float] = field(default_factory=dict)  # (node, incarnation) -> when

    def __post_init__(self) -> None:
        os.makedirs(self.workdir, exist_ok=True)
        self.agents = Agents(self.workdir)
        self.port = self.port or free_port(self.addr(0))

    def addr(self, node: int) -> str:
        return f"127.0.{10 + self.index}.{2 + node}"

    def flags(self, node: int) -> list[str]:
        endpoints = ",".join(f"{self.addr(i)}:{self.port}" for i in range(self.nodes))
        return ["--nnodes", f"1:{self.nodes}", "--nproc-per-node", "1", "--rdzv-endpoint",
                endpoints, "--local-addr", self.addr(node), "--rdzv-id", self.run_id,
                "--max-restarts", "100", "--rdzv-conf",
                f"last_call_timeout=1,join_timeout={JOIN_TIMEOUT},store_timeout={STORE_TIMEOUT}"]

    def start(self, node: int) -> None:
        n = self.incarnations.get(node, 0)
        self.incarnations[node] = n + 1
        self.procs[node] = self.agents.start(
            self.flags(node), ["--dir", self.workdir], name=f"node{node}-{n}", script=STEPS_TRAIN,
            env={"ELASTICSTORE_TEST_NODE": self.addr(node), "STEPS_TERM_DELAY": "",
                 "STEPS_INCARNATION": str(n), "PYTHONFAULTHANDLER": "1"})

    def start_all(self) -> None:
        for node in range(self.nodes):
            self.start(node)

    def host(self) -> int:
        """The node that hosts the store now, as the agents' consoles say (the last move)."""
        best, addr = 1, self.addr(0)
        for proc in self.agents.procs:
            for m in re.finditer(r"moved from \S+ to (\S+):\d+ \(epoch (\d+)\)", self.agents.output(proc)):
                if int(m.group(2)) > best:
                    best, addr = int(m.group(2)), m.group(1)
        return next((i for i in range(self.nodes) if self.addr(i) == addr), 0)

    def last_round(self) -> list[str]:
        """The participants (node ids) of the newest round that an agent still running printed
        last: the round whose quorum the next one counts (it may not have trained a step yet,
        e.g. a round that a restarted node joined); [] before any."""
        best, members = 0, []
        for proc in self.procs.values():
            if proc.poll() is None:
                found = _ROUND_LINE.findall(self.agents.output(proc))
                if found and int(found[-1][0]) >= best:
                    best, members = int(found[-1][0]), found[-1][1].split(", ")
        return members

    def keeps_majority(self, faults: list[Fault]) -> bool:
        """Whether more than half of the newest round's participants are left running and
        unfaulted by ``faults`` (a restarted node comes back as a new member: it does not
        count). Not the last group that trained: a round formed since, bigger, is what the
        quorum rule counts, and a test that counted the smaller group expected a recovery the
        rule forbids."""
        members = self.last_round()
        hit = {self.procs[f.node].pid for f in faults}
        running = {p.pid for p in self.procs.values() if p.poll() is None}
        left = [m for m in members if (pid := _pid_of(m)) in running and pid not in hit]
        return bool(members) and 2 * len(left) > len(members)

    def trained_after(self, since: float) -> Group | None:
        """A group that completed a step that started after ``since``."""
        return next((g for g in reversed(groups(self.workdir)) if g.last > since), None)

    def wait_training(self, since: float, timeout: float,
                      stop: threading.Event | None = None) -> Group | None:
        """The first group that trained after ``since``, within ``timeout``; None at the timeout,
        when every agent exited, or when ``stop`` is set."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            if (g := self.trained_after(since)) is not None:
                return g
            if all(p.poll() is not None for p in self.procs.values()):
                return None
            time.sleep(0.2)
        return None

    def run_episode(self, faults: list[Fault]) -> float:
        """Applies ``faults`` (bounded in time); returns when the last one healed (wall clock)."""
        start = time.monotonic()
        events = sorted([(f.at, "fault", f) for f in faults] +
                        [(f.at + f.heal_after, "heal", f) for f in faults], key=lambda e: e[0])
        stopped: dict[int, list[int]] = {}
        for at, what, f in events:
            time.sleep(max(0.0, start + at - time.monotonic()))
            proc = self.procs[f.node]
            if what == "fault":
                self.log.append(f"{time.time():.3f} {f.describe()}")
                if f.kind == "kill":
                    _signal([proc.pid], signal.SIGKILL)
                    self.killed[(self.addr(f.node), self.incarnations[f.node] - 1)] = time.time()
                elif proc.poll() is None:
                    stopped[f.node] = tree(proc.pid)
                    _signal(stopped[f.node], signal.SIGSTOP)
            elif f.kind == "kill":
                proc.wait(30)
                self.start(f.node)
            else:
                _signal(stopped.pop(f.node, []), signal.SIGCONT)
        return time.time()

    def outside_the_group(self) -> list[str]:
        """The nodes still running that do not train in the newest group (the one whose last
        step is the latest), with the incarnation the test started last."""
        found = groups(self.workdir)
        newest = max(found, key=lambda g: g.last).members if found else frozenset()
        return [f"node{n}" for n, p in self.procs.items()
                if p.poll() is None and (self.addr(n), self.incarnations[n] - 1) not in newest]

    def finish(self, timeout: float) -> tuple[dict[str, int | None], list[str]]:
        """Releases the workers once every agent still running trains in one group (at most
        ``timeout``): a node released while it was between rounds (its store given up for
        another host's, a restart) would find the job over and its store host gone, and could
        only time out. Returns the exit code of every agent (None: hung) and the nodes that
        were still outside the group at the release (a liveness miss of their own)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.outside_the_group():
            time.sleep(0.2)
        outside = self.outside_the_group()
        self.agents.release()
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + timeout
        for node, proc in self.procs.items():
            try:
                code: int | None = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
                self._dump_stacks(proc)
            if code == 1 and FINISHED_WITHOUT_IT in self.agents.output(proc):
                code = 0  # stopped (or restarted) while the others finished: told so, clearly
            codes[f"node{node}"] = code
        return codes, outside

    @staticmethod
    def _dump_stacks(proc: subprocess.Popen[bytes]) -> None:
        """An agent that did not exit in time: SIGABRT, which its fault handler
        (``PYTHONFAULTHANDLER``) answers with every thread's stack on its console, where
        ``last_lines`` finds it (where it waited, for a report that cannot be replayed)."""
        _signal([proc.pid], signal.SIGABRT)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def stacks(self, node: str) -> str:
        """The threads' stacks an agent wrote when aborted (``_dump_stacks``), short: each
        thread's four innermost frames (file:line function), threads apart by ``||``."""
        proc = self.procs.get(int(node.removeprefix("node")))
        out = self.agents.output(proc) if proc is not None else ""
        at = out.rfind("Fatal Python error")
        threads: list[list[str]] = []
        for ln in out[at:].splitlines() if at >= 0 else []:
            if ln.startswith(("Thread", "Current thread")):
                threads.append([])
            elif threads and (m := re.search(r'File "(.+)", line (\d+) in (\S+)', ln)):
                name = os.path.basename(m.group(1))
                if not (name == "threading.py" and m.group(3) in _THREAD_START):
                    threads[-1].append(f"{name}:{m.group(2)} {m.group(3)}")
        return " || ".join(" < ".join(t[:4]) for t in threads)[:4000]

    def last_lines(self, node: str, count: int = 8) -> str:
        """The last lines ``node`` ("node2", as ``finish`` names it) wrote: why it exited so,
        in a report that shows only the failures' messages."""
        proc = self.procs.get(int(node.removeprefix("node")))
        if proc is None:
            return ""
        lines = [ln for ln in self.agents.output(proc).splitlines() if ln.strip()]
        return " | ".join(lines[-count:])

    def violations(self) -> list[str]:
        """(a) and (c) over everything the job recorded."""
        found = groups(self.workdir)
        bad = [f"(a) two groups at once: {x.describe()} | {y.describe()}" for x, y in overlaps(found)]
        for x, y in zip(found, found[1:]):
            # A fresh run (round 1 again) is allowed only once every member of the last group
            # was killed: nobody was left to carry the run's records.
            lost = all(self.killed.get(m, y.first) < y.first for m in x.members)
            if y.attempt <= x.attempt and not lost:
                bad.append(f"(c) round went backwards: {x.describe()} then {y.describe()}")
            if y.restarts < x.restarts and not lost:
                bad.append(f"(c) restart count went backwards: {x.describe()} then {y.describe()}")
        for proc in self.agents.procs:
            # A node's rounds strictly increase. Not its store's epochs: a node that took a live
            # host for lost and served a stale store (seeded from an older round) gives it up
            # for the older epoch's newer rounds (failover.py, which store is newest).
            out = self.agents.output(proc)
            seen = [int(v) for v in re.findall(r"\[elasticstore-run\] round (\d+):", out)]
            if any(b <= a for a, b in zip(seen, seen[1:])):
                bad.append(f"(c) {proc.name}: rounds not increasing: {seen}")  # type: ignore[attr-defined]
        return bad

    def cleanup(self) -> None:
        for pids in [tree(p.pid) for p in self.agents.procs if p.poll() is None]:
            _signal(pids, signal.SIGCONT)
        self.agents.cleanup_quiet()
