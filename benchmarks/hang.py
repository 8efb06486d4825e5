"""Hang -> restarted group running: one rank of a gloo job stops making progress (it stops calling
``elasticstore.train.heartbeat()``), for ``elasticstore-run`` and torchrun on the same script in
the same run.

The script is ``tests/helpers/programs/hang_train.py``: 2 workers per node, 40 all-reduce steps
of 0.05 s, a heartbeat per step; in its first attempt rank ``--hang-rank`` stops at step 10
(``--hang sleep``: it sleeps in user code; ``--hang stop``: it SIGSTOPs itself) and writes the
time into ``hang``; every other rank then blocks in its next all_reduce. Every worker writes
``init-<attempt>-<rank>`` once past ``init_process_group``. The figure is the time from the
``hang`` stamp to the moment every rank of a restarted group (attempt >= 1) is past
``init_process_group``; the hang event in the agents' ``events.jsonl`` splits it into detection
(silence -> hung rank killed) and restart (-> every rank of the new group past init).

Cells (``--cells``, in this order):

- ``sleep``, ``stop``: ``elasticstore-run --standalone --nproc-per-node 2 --max-restarts 1
  --heartbeat-timeout 3``, the rank 1 hanging either way;
- ``2x2``: two simulated nodes (127.0.0.2, 127.0.0.3; ``--nnodes 2``, 2 workers each, the native
  rendezvous on 127.0.0.2), ``--heartbeat-timeout 3``, rank 3 (on the second node) sleeping;
- ``default``: ``elasticstore-run`` as ``sleep`` but with its default heartbeat timeout (600 s);
- ``torchrun-sleep``, ``torchrun-stop``: ``python -m torch.distributed.run --standalone
  --nproc-per-node 2 --max-restarts 1 --monitor-interval 0.1``. torchrun has no hang detection
  (the script's ``heartbeat()`` is a no-op there).

``elasticstore-run`` runs as ``python -m elasticstore.run`` of the interpreter running this
benchmark; every elasticstore-run cell also gets ``--log-dir`` (for ``events.jsonl``). Every wait is
bounded: a cell whose group is not running again ``--bound`` seconds (45) after the hang counts as
"not within the bound", is stopped (SIGTERM to its agents, SIGKILL to their process groups and to
every process they started, by pid, 5 s later: torchrun leaves its workers behind) and is not
sampled again. After each sample no process it started may be left: every descendant of its
agents seen during the run (sampled every 0.2 s) and every process in their sessions is checked.

    python benchmarks/hang.py [--repeat 3] [--bound 45] [--cells sleep,stop,2x2,default,...]
        [--out benchmarks/results/hang]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from procs import install_sigterm_handler, set_pdeathsig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(ROOT, "tests", "helpers", "programs", "hang_train.py")
CELLS = ("sleep", "stop", "2x2", "default", "torchrun-sleep", "torchrun-stop")
START_LIMIT = 90.0  # seconds from the launch to the hang (cold start of the agents and workers)
EXIT_LIMIT = 60.0  # seconds for a recovered job to finish its steps and exit
GRACE = 5.0  # seconds between SIGTERM and SIGKILL when a cell is stopped
DEFAULT_HEARTBEAT_TIMEOUT = 600.0  # elasticstore-run's default (agent/config.py)


@dataclass(frozen=True)
class Cell:
    name: str
    launcher: str  # "elasticstore-run" or "torchrun"
    hang: str  # "sleep" or "stop"
    nodes: int
    heartbeat_timeout: float | None  # None: the launcher's default

    @property
    def hang_rank(self) -> int:
        return 2 * self.nodes - 1

    @property
    def world(self) -> int:
        return 2 * self.nodes

    def label(self) -> str:
        where = "1 node x 2" if self.nodes == 1 else f"{self.nodes} nodes x 2"
        return f"{where}, rank {self.hang_rank} {'sleeps' if self.hang == 'sleep' else 'SIGSTOPped'}"

    def timeout_text(self) -> str:
        if self.launcher == "torchrun":
            return "— (no hang detection)"
        if self.heartbeat_timeout is None:
            return f"default ({DEFAULT_HEARTBEAT_TIMEOUT:g} s)"
        return f"{self.heartbeat_timeout:g} s"


def cell(name: str) -> Cell:
    return {
        "sleep": Cell("sleep", "elasticstore-run", "sleep", 1, 3.0),
        "stop": Cell("stop", "elasticstore-run", "stop", 1, 3.0),
        "2x2": Cell("2x2", "elasticstore-run", "sleep", 2, 3.0),
        "default": Cell("default", "elasticstore-run", "sleep", 1, None),
        "torchrun-sleep": Cell("torchrun-sleep", "torchrun", "sleep", 1, None),
        "torchrun-stop": Cell("torchrun-stop", "torchrun", "stop", 1, None),
    }[name]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _session(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[3])  # state, ppid, pgrp, session
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class Job:
    """One sample: its agents (each the leader of its own session) and every process they
    started, remembered as psutil handles (pid + start time: a reused pid is never signalled)."""

    cell: Cell
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="hangbench-"))
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    seen: dict[tuple[int, float], psutil.Process] = field(default_factory=dict)
    port: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def command(self, addr: str) -> list[str]:
        c = self.cell
        script = [SCRIPT, "--dir", self.workdir, "--hang", c.hang, "--hang-rank", str(c.hang_rank)]
        common = ["--nproc-per-node", "2", "--max-restarts", "1"]
        if c.launcher == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", *common,
                    "--monitor-interval", "0.1", *script]
        flags = [*common, "--log-dir", os.path.join(self.workdir, "logs")]
        if c.heartbeat_timeout is not None:
            flags += ["--heartbeat-timeout", f"{c.heartbeat_timeout:g}"]
        if c.nodes == 1:
            return [sys.executable, "-m", "elasticstore.run", "--standalone", *flags, *script]
        return [sys.executable, "-m", "elasticstore.run", "--nnodes", str(c.nodes),
                "--rdzv-backend", "elasticstore", "--rdzv-endpoint", f"127.0.0.2:{self.port}",
                "--rdzv-id", f"hangbench-{os.getpid()}-{self.port}", "--local-addr", addr,
                *flags, *script]

    def shown_command(self) -> str:
        """The first agent's command line as the results show it (D: the sample's directory)."""
        return shown(" ".join(self.command(next(iter(self.agents)))), self.workdir, self.port)

    def start(self) -> None:
        addrs = ["127.0.0.1"] if self.cell.nodes == 1 else \
            [f"127.0.0.{2 + i}" for i in range(self.cell.nodes)]
        if self.cell.nodes > 1:
            self.port = _free_port("127.0.0.2")
        for addr in addrs:  # the first one hosts the rendezvous store
            log = open(os.path.join(self.workdir, f"agent-{addr}.log"), "wb")  # noqa: SIM115
            self.agents[addr] = subprocess.Popen(self.command(addr), stdout=log,
                                                 stderr=subprocess.STDOUT, cwd=self.workdir,
                                                 start_new_session=True,
                                                 preexec_fn=set_pdeathsig)
            log.close()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.remember()
            self._stop.wait(0.2)

    def remember(self) -> None:
        """Records every live descendant of the agents (orphans reparented away from them are
        still killed and checked by the handle recorded while they were descendants)."""
        for proc in list(self.agents.values()):
            try:
                kids = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                continue
            with self._lock:
                for p in kids:
                    try:
                        self.seen.setdefault((p.pid, p.create_time()), p)
                    except psutil.Error:
                        pass

    # -- what the files say ------------------------------------------------------------------

    def hang_time(self) -> float | None:
        return _read_time(os.path.join(self.workdir, "hang"))

    def restarted(self) -> dict[int, float]:
        """rank -> earliest time a worker of a later attempt (>= 1) was past init_process_group."""
        found: dict[int, float] = {}
        for path in glob.glob(os.path.join(self.workdir, "init-*-*")):
            _, att, rank = os.path.basename(path).split("-")
            t = _read_time(path)
            if int(att) >= 1 and t is not None:
                found[int(rank)] = min(t, found.get(int(rank), t))
        return found

    def events(self) -> list[dict[str, Any]]:
        out = []
        for path in glob.glob(os.path.join(self.workdir, "logs", "**", "events.jsonl"),
                              recursive=True):
            with open(path, errors="replace") as f:
                for line in f:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass
        return sorted(out, key=lambda e: e.get("wall", 0.0))

    def tail(self, n: int = 600) -> dict[str, str]:
        tails = {}
        for addr in self.agents:
            try:
                with open(os.path.join(self.workdir, f"agent-{addr}.log"), errors="replace") as f:
                    tails[addr] = f.read()[-n:]
            except OSError:
                tails[addr] = ""
        return tails

    def live_states(self) -> dict[str, int]:
        """The states of the processes the agents started that still run ({'S': 3, 'T': 1})."""
        states: dict[str, int] = {}
        with self._lock:
            procs = list(self.seen.values())
        for p in procs:
            try:
                st = p.status()
            except psutil.Error:
                continue
            if st != psutil.STATUS_ZOMBIE:
                states[st] = states.get(st, 0) + 1
        return states

    # -- the end ----------------------------------------------------------------------------

    def stop(self) -> list[str]:
        """Ends every process of the job (bounded) and returns what was still running after
        that ('pid cmdline'); empty when nothing is left."""
        self.remember()
        running = [p for p in self.agents.values() if p.poll() is None]
        for proc in running:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GRACE
        for proc in running:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.remember()
        self._stop.set()
        sessions = {p.pid for p in self.agents.values()}
        for proc in self.agents.values():  # the session's groups, then every process by pid
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        with self._lock:
            procs = list(self.seen.values())
        for p in procs:
            try:
                p.kill()  # psutil checks the start time: a reused pid is left alone
            except psutil.Error:
                pass
        for proc in self.agents.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10  # gone or a zombie (not always reaped at once here)
        left = procs
        while left and time.monotonic() < deadline:
            left = [p for p in left if _status(p) not in (None, psutil.STATUS_ZOMBIE)]
            time.sleep(0.05)
        for pid in psutil.pids():  # anything else still in one of the agents' sessions
            if pid != os.getpid() and _session(pid) in sessions and \
                    all(p.pid != pid for p in left):
                try:
                    left.append(psutil.Process(pid))
                except psutil.Error:
                    pass
        report = []
        for p in left:
            try:
                report.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)
        return report


def shown(command: str, workdir: str, port: int) -> str:
    """``command`` without this machine's paths, directory and port."""
    command = command.replace(f"{sys.executable} -m elasticstore.run", "elasticstore-run")
    command = command.replace(sys.executable, "python").replace(workdir, "D")
    command = command.replace(ROOT + os.sep, "")
    return command.replace(f":{port} ", ":PORT ").replace(f"-{port} ", "-PORT ") if port else command


def _status(p: psutil.Process) -> str | None:
    try:
        return str(p.status())
    except psutil.Error:
        return None


def _read_time(path: str) -> float | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return float(text) if text else None
    except (OSError, ValueError):
        return None


def sample(c: Cell, bound: float) -> dict[str, Any]:
    """One run of a cell: launch, wait for the hang, then (bounded) for the restarted group."""
    job = Job(c)
    out: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        job.start()
        out["command"] = job.shown_command()
        t_hang = None
        while time.monotonic() - t0 < START_LIMIT:
            t_hang = job.hang_time()
            if t_hang is not None or any(p.poll() is not None for p in job.agents.values()):
                break
            time.sleep(0.02)
        if t_hang is None:
            out.update(error=f"no hang within {START_LIMIT:g} s of the launch", tail=job.tail())
            return out
        out["start_to_hang"] = time.monotonic() - t0
        ready: dict[int, float] = {}
        while time.time() < t_hang + bound:
            ready = job.restarted()
            if len(ready) == c.world or all(p.poll() is not None for p in job.agents.values()):
                break
            time.sleep(0.02)
        if len(ready) < c.world:
            agents_up = sum(p.poll() is None for p in job.agents.values())
            out.update(seconds=None, restarted_ranks=sorted(ready), agents_running=agents_up,
                       live=job.live_states(), exit_codes=[p.poll() for p in job.agents.values()])
            if agents_up == len(job.agents):
                out["note"] = (f"still hung {bound:g} s after the hang: every agent running, no "
                               f"rank of a new group past init_process_group")
            else:
                out.update(note="an agent exited without a restarted group", tail=job.tail())
            return out
        last = max(ready.values())
        out["seconds"] = last - t_hang
        hangs = [e for e in job.events() if e.get("event") == "hang"]
        if hangs:
            out["detect"] = hangs[0]["wall"] - t_hang
            out["restart"] = last - hangs[0]["wall"]
            out["hang_event"] = {k: hangs[0].get(k) for k in ("host", "rank", "silent_seconds",
                                                              "why")}
            out["detected_on"] = sorted({e.get("host") for e in hangs})
        codes: list[int | None] = []
        deadline = time.monotonic() + EXIT_LIMIT
        for proc in job.agents.values():
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        out["exit_codes"] = codes
        if codes != [0] * len(codes):
            out["tail"] = job.tail()
        return out
    finally:
        left = job.stop()
        if left:
            out["left_running"] = left  # killed now; a bug of the launcher or of this script


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run_cell(c: Cell, repeat: int, bound: float) -> dict[str, Any]:
    row: dict[str, Any] = {"cell": c.name, "launcher": c.launcher, "hang": c.hang,
                           "nodes": c.nodes, "hang_rank": c.hang_rank,
                           "heartbeat_timeout": c.heartbeat_timeout, "label": c.label(),
                           "samples": []}
    for i in range(repeat):
        s = sample(c, bound)
        print(json.dumps({"cell": c.name, "sample": i,
                          **{k: v for k, v in s.items() if k not in ("tail", "command")}}),
              flush=True)
        row["samples"].append(s)
        if s.get("seconds") is None:
            break  # not within the bound (or failed): another sample would wait as long again
    row["command"] = row["samples"][0].get("command")
    done = [s for s in row["samples"] if s.get("seconds") is not None]
    if done and len(done) == len(row["samples"]):
        row["seconds"] = _stats([s["seconds"] for s in done])
        for part in ("detect", "restart"):
            if all(part in s for s in done):
                row[part] = _stats([s[part] for s in done])
    else:
        row["seconds"] = None
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cells", default=",".join(CELLS))
    p.add_argument("--repeat", type=int, default=3, help="samples per cell (a cell not within "
                   "the bound is sampled once)")
    p.add_argument("--bound", type=float, default=45.0,
                   help="seconds after the hang before a cell counts as still hung")
    p.add_argument("--out", default=os.path.join(HERE, "results", "hang"))
    p.add_argument("--from", dest="source", metavar="JSON",
                   help="re-render the table and the plot of an earlier run, no measuring")
    args = p.parse_args()
    if args.source:
        with open(args.source) as f:
            res = json.load(f)
        with open(args.out + ".md", "w") as f:
            f.write(render(res))
        print(render(res))
        plot(res, args.out + ".png")
        return
    names = [n for n in args.cells.split(",") if n]
    for n in names:
        if n not in CELLS:
            p.error(f"unknown cell {n!r}; cells: {', '.join(CELLS)}")
    import torch
    from machine import machine

    install_sigterm_handler()  # SIGTERM: the running sample's finally still stops its processes

    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    rows = [run_cell(cell(n), args.repeat, args.bound) for n in names]
    res = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
           "torch": torch.__version__, "bound": args.bound, "repeat": args.repeat,
           "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
           "wall_seconds": round(time.monotonic() - t0, 1), "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    table = render(res)
    with open(args.out + ".md", "w") as f:
        f.write(table)
    print(table)
    plot(res, args.out + ".png")
    leftovers = [x for r in rows for s in r["samples"] for x in s.get("left_running", [])]
    if leftovers:
        print(f"processes left running (killed): {leftovers}", file=sys.stderr)
        sys.exit(1)


def _range(st: dict[str, float]) -> str:
    if st["min"] == st["max"]:
        return f"{st['median']:.2f} s"
    return f"{st['median']:.2f} s ({st['min']:.2f}-{st['max']:.2f})"


def _never(r: dict[str, Any], bound: float) -> str:
    s = r["samples"][-1]
    if s.get("error"):
        return f"— ({s['error']})"
    if r["launcher"] == "torchrun":
        return f"still hung after {bound:g} s (no hang detection)"
    if r["heartbeat_timeout"] is None:
        return f"not within {bound:g} s (default timeout {DEFAULT_HEARTBEAT_TIMEOUT:g} s)"
    return f"not within {bound:g} s ({s.get('note', '')})"


def render(res: dict[str, Any]) -> str:
    bound = res["bound"]
    rows = res["rows"]
    torchrun_never = any(r["launcher"] == "torchrun" and r["seconds"] is None for r in rows)
    m = res["machine"]
    lines = [f"Run of {res['when']}: {m['cores']} cores, {m['cpu']}, {m['kernel']}, Python "
             f"{m['python']}, torch {res['torch']}; 1-min load {res['load_1min'][0]} before, "
             f"{res['load_1min'][1]} after; {res['repeat']} sample(s) per cell, a cell not "
             f"within {bound:g} s sampled once.", "",
             "| launcher | scenario | heartbeat timeout | samples | hang -> restarted group past "
             "init (median, range) | detection / restart | vs torchrun |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        n = len(r["samples"])
        if r["seconds"] is not None:
            fig = f"**{_range(r['seconds'])}**"
            parts = (f"{r['detect']['median']:.2f} s / {r['restart']['median']:.2f} s"
                     if "detect" in r and "restart" in r else "")
            up = math.ceil(r["seconds"]["median"] / bound * 100) / 100
            ratio = f"< {up:.2f}x (torchrun still hung at {bound:g} s)" if torchrun_never else ""
        else:
            fig, parts, ratio = _never(r, bound), "", ""
        lines.append(f"| {r['launcher']} | {r['label']} | {_timeout_text(r)} | {n} | {fig} | {parts} "
                     f"| {ratio} |")
    notes = ["", "Figures: from the moment the rank stopped beating (the `hang` file's stamp) to "
             "the last rank of the restarted group past `init_process_group`; detection: to the "
             "agent's `hang` event (stacks taken, the hung rank SIGKILLed); restart: from there "
             "to the last rank past init."]
    notes.append("The agent reads the heartbeat board every tenth of the timeout (0.3 s at 3 s, at "
                 "most 1 s), so it acts 0-0.3 s past a 3 s timeout; taking the stacks first costs "
                 "about 0.07 s. On two nodes only the hung rank's node acts: the other node's "
                 "silent ranks wait in all_reduce (their stacks show it), so its agent waits one "
                 "more timeout for the node with the cause.")
    quick = next((r for r in rows if r["cell"] == "sleep" and r["seconds"] is not None), None)
    if any(r["cell"] == "default" and r["seconds"] is None for r in rows) and quick:
        poll = min(1.0, max(0.05, DEFAULT_HEARTBEAT_TIMEOUT / 10))
        rest = quick["restart"]["median"] if "restart" in quick else 0.0
        notes.append(f"With the default timeout the agent acts once the rank has been silent "
                     f"{DEFAULT_HEARTBEAT_TIMEOUT:g} s, on its next read of the board (every "
                     f"{poll:g} s at that timeout); with the restart measured here ({rest:.2f} s) "
                     f"the group runs again about {DEFAULT_HEARTBEAT_TIMEOUT:g}-"
                     f"{DEFAULT_HEARTBEAT_TIMEOUT + poll + 0.1 + rest:.0f} s after the hang (not "
                     f"measured).")
    if torchrun_never:
        notes.append("torchrun watches only exit codes: a rank that stops making progress is "
                     "never detected; the only backstop is the collective timeout of "
                     "`init_process_group` (gloo: 30 min by default), after which the blocked "
                     "peer's all_reduce fails and torchrun restarts the group (not measured).")
    done = [s for r in rows for s in r["samples"] if s.get("seconds") is not None]
    bad = [s["exit_codes"] for s in done if s.get("exit_codes") != [0] * len(s["exit_codes"])]
    if done:
        notes.append("Every restarted job finished its steps and exited 0." if not bad else
                     f"Restarted jobs that did not exit 0 (agents' codes): {bad}.")
    notes += ["", "Commands (D: the sample's directory; `elasticstore-run` ran as `python -m "
              "elasticstore.run`; two nodes: the same on 127.0.0.3):", ""]
    notes += [f"- `{r['cell']}`: `{r['command']}`" for r in rows if r.get("command")]
    return "\n".join(lines + notes) + "\n"


def _timeout_text(r: dict[str, Any]) -> str:
    return cell(r["cell"]).timeout_text()


def plot(res: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    bound = res["bound"]
    rows = res["rows"][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.5))
    names = []
    for i, r in enumerate(rows):
        how = "no hang detection" if r["launcher"] == "torchrun" else \
            f"heartbeat timeout {_timeout_text(r)}"
        names.append(f"{r['launcher']}, {r['label']}\n({how})")
        if r["seconds"] is not None:
            st = r["seconds"]
            ax.barh(i, st["median"], color="tab:blue",
                    xerr=[[st["median"] - st["min"]], [st["max"] - st["median"]]], capsize=3)
            ax.text(st["max"] + bound * 0.01, i, f" {st['median']:.2f} s", va="center",
                    fontsize=8)
        else:
            color = "tab:red" if r["launcher"] == "torchrun" else "tab:orange"
            ax.barh(i, bound, color="none", edgecolor=color, hatch="//")
            what = "never detected" if r["launcher"] == "torchrun" else \
                f"default timeout {DEFAULT_HEARTBEAT_TIMEOUT:g} s"
            ax.text(bound * 0.5, i, f"> {bound:g} s ({what})", ha="center", va="center",
                    fontsize=8, color=color, backgroundcolor="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlim(0, bound * 1.08)
    ax.set_xlabel("seconds from the hang to every rank of the restarted group past "
                  "init_process_group", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    m = res["machine"]
    ax.set_title(f"A rank hangs: {res['when']} - {m['cores']} cores {m['cpu']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
