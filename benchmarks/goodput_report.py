"""What ``goodput.py`` makes of its runs: the restarts an example recorded (``restarts``), the
tables (``render``: one per example) and the figure (``plot``)."""

from __future__ import annotations

import json
import signal
from typing import Any

LIMIT_DEFAULT = 300.0
LAUNCHERS = ("elasticstore-run", "torchrun")


def restarts(events_path: str) -> list[dict[str, Any]]:
    """Every start but the first, from the example's ``--events`` file (rank 0 of each start
    writes a ``start`` line, then a ``step`` line every step): the step it resumed from, every
    rank's restore source, the newest step the previous start reached (``reached``), the steps
    trained again (``redone``: ``reached - step``) and the seconds from the previous start's last
    step to this start's first (``gap_s``; None when it took no step)."""
    try:
        with open(events_path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill: none here so far, but never fatal
            continue
    events.sort(key=lambda e: e["time"])
    out: list[dict[str, Any]] = []
    reached: int | None = None
    last_t: float | None = None
    for e in events:
        if e["event"] == "start":
            if reached is not None:  # rank 0 snapshots a step before it records it: a
                # restart may resume from one step past the newest it recorded (nothing redone)
                reached = max(reached, e["step"])
                out.append({"step": e["step"], "world": e["world"], "sources": e["sources"],
                            "reached": reached, "redone": reached - e["step"],
                            "gap_s": None, "last_step_t": last_t})
            reached = e["step"]
        elif e["event"] == "step":
            if out and out[-1]["gap_s"] is None and out[-1]["last_step_t"] is not None \
                    and reached == out[-1]["step"]:
                out[-1]["gap_s"] = e["time"] - out[-1]["last_step_t"]
            reached = max(reached or 0, e["step"])
            last_t = e["time"]
    for r in out:
        del r["last_step_t"]
    return out


def _kind(sources: list[str | None]) -> str:
    """One restart's sources: ``memory``, ``peer``, ``disk``, ``nothing`` (step 0), or a mix."""
    kinds = sorted({s or "nothing (step 0)" for s in sources})
    return "+".join(kinds)


def sources_cell(rs: list[dict[str, Any]]) -> str:
    if not rs:
        return "—"
    counts: dict[str, int] = {}
    for r in rs:
        k = _kind(r["sources"])
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{k} ×{n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def redone_cell(rs: list[dict[str, Any]]) -> str:
    if not rs:
        return "—"
    steps = [r["redone"] for r in rs]
    gaps = [r["gap_s"] for r in rs if r["gap_s"] is not None]
    gap = f"; {sum(gaps) / len(gaps):.1f} s from last step to next" if gaps else ""
    if len(steps) <= 6:
        return f"{', '.join(map(str, steps))} (sum {sum(steps)}){gap}"
    return f"mean {sum(steps) / len(steps):.1f}, max {max(steps)} (sum {sum(steps)}){gap}"


def _errors(r: dict[str, Any]) -> str:
    """Ranks that stopped on their background DCP checkpoint's error, not on an injected
    failure: in the interrupted run (and the uninterrupted one)."""
    return f"{r.get('checkpoint_errors', 0)} ({r.get('baseline_checkpoint_errors', 0)})"


def _exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def outcome(r: dict[str, Any]) -> tuple[str, str]:
    """The interrupted run's time, or what became of it, and the goodput cell when there is
    none: from what ``run_job`` recorded (``done``, ``seconds``, ``codes``: the first node's
    agent first, None for one still running when the job was given up)."""
    if r.get("done"):  # no goodput: the uninterrupted run did not finish
        return f"{r['seconds']:.1f} s", "— (uninterrupted run not done)"
    codes = r.get("codes") or [None]
    if codes[0] is None:  # the first node's agent was still running at the limit
        return f"not done in {r.get('limit', LIMIT_DEFAULT):g} s", "— (not done)"
    exits = [_exit(c) for c in codes]
    if len(exits) == 1:
        what = exits[0]
    elif len(set(exits)) == 1:
        what = f"{exits[0]} from {'both agents' if len(exits) == 2 else 'every agent'}"
    else:
        what = ", ".join(exits)
    return f"failed ({what}) at {r['seconds']:.1f} s", "— (failed)"


def _cells(r: dict[str, Any]) -> list[str]:
    took, none = outcome(r)
    gp = f"**{r['goodput']:.2f}**" if r.get("goodput") is not None else none
    same = {True: "identical", False: "differ", None: "n/a (world size changed)"}[
        r.get("same_weights")] if r.get("done") else "—"
    return [r["scenario"], f"{r['interval']:g} s", r["launcher"], str(r.get("failures", 0)),
            f"{r['baseline_seconds']:.1f} s", took, gp, same]


HEAD = ["scenario", "failure every", "launcher", "failures", "uninterrupted", "interrupted",
        "goodput", "final weights"]


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


def render(rows: list[dict[str, Any]]) -> str:
    """The DDP rows (``example`` absent or ``ddp``) as they always were; the FSDP2 rows in a
    table of their own with where each restart resumed from and the steps it trained again."""
    ddp = [r for r in rows if r.get("example", "ddp") == "ddp"]
    fsdp = [r for r in rows if r.get("example") == "fsdp"]
    lines = _table(HEAD, [_cells(r) for r in ddp]) if ddp else []
    if fsdp:
        every = sorted({r.get("checkpoint_every") for r in fsdp}, key=str)
        if lines:
            lines.append("")
        lines.append("FSDP2 (`examples/train_fsdp.py`), a DCP checkpoint on disk every "
                     f"{'/'.join(map(str, every))} steps under both launchers; restarts: every "
                     "start after the first, by where its ranks' state came from; steps redone: "
                     "the newest step reached before it minus the step it resumed from.")
        lines.append("")
        lines += _table([*HEAD, "restarts resumed from", "steps redone per restart",
                         "ranks stopped by a DCP write error"],
                        [[*_cells(r), sources_cell(r.get("restarts") or []),
                          redone_cell(r.get("restarts") or []), _errors(r)] for r in fsdp])
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fsdp = [r for r in rows if r.get("example") == "fsdp"]
    fig, axes = plt.subplots(1, 2 if fsdp else 1, figsize=(10, 3.4) if fsdp else (5, 3.2),
                             squeeze=False)
    ax = axes[0][0]
    for launcher in LAUNCHERS:
        pts = sorted((r["interval"], r.get("goodput") or 0.0) for r in rows
                     if r["launcher"] == launcher and r["scenario"] == "worker"
                     and r.get("example", "ddp") == "ddp")
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=launcher)
    ax.set_xlabel("seconds between worker failures (DDP, one node, 2 workers)")
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    if fsdp:
        ax = axes[0][1]
        scenarios = list(dict.fromkeys(r["scenario"] for r in fsdp))
        width = 0.38
        for i, launcher in enumerate(LAUNCHERS):
            xs, ys = [], []
            for j, s in enumerate(scenarios):
                for r in fsdp:
                    if r["scenario"] == s and r["launcher"] == launcher:
                        xs.append(j + (i - 0.5) * width)
                        ys.append(r.get("goodput") or 0.0)
                        if r.get("goodput") is None:  # say why there is no bar
                            ax.text(xs[-1], 0.02, outcome(r)[1].strip("— ()"), rotation=90,
                                    ha="center", va="bottom", fontsize=7)
            if xs:
                ax.bar(xs, ys, width, label=launcher)
        ax.set_xticks(range(len(scenarios)))
        ax.set_xticklabels(scenarios, fontsize=7)
        every = "/".join(f"{i:g}" for i in sorted({r["interval"] for r in fsdp}))
        ax.set_title(f"FSDP2, a failure every {every} s (0: not done or failed)", fontsize=9)
        ax.set_ylim(0, 1.1)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
