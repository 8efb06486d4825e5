"""examples/train_ddp.py under elasticstore-run, two simulated nodes (127.0.0.2, 127.0.0.3): a
worker killed mid-run ends with exactly the weights of an uninterrupted run at the same world size;
a node lost mid-run (its agent SIGKILLed, ``--nnodes 1:2``) ends with every sample of each epoch
seen exactly once; and ``scripts/demo``'s driver (examples/elastic_demo.py) succeeds."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from agent_nodes import Agents, agents, free_port, node_flags, until
from paths import ROOT

pytestmark = pytest.mark.slow

EXAMPLE = os.path.join(ROOT, "examples", "train_ddp.py")
DEMO = os.path.join(ROOT, "examples", "elastic_demo.py")
BATCH, EPOCHS = 32, 2
CONF = ["--rdzv-conf", "last_call_timeout=1"]


def train_args(workdir: str, name: str, size: int, *extra: str) -> list[str]:
    return ["--epochs", str(EPOCHS), "--dataset-size", str(size), "--batch-size", str(BATCH),
            "--checkpoint-every", "10", "--log-every", "8", "--seed", "3",
            "--checkpoint-dir", os.path.join(workdir, name), "--summary",
            os.path.join(workdir, f"{name}.json"), *extra]


def summary(workdir: str, name: str) -> Any:
    with open(os.path.join(workdir, f"{name}.json")) as f:
        return json.load(f)


def assert_each_sample_once_per_epoch(stats: dict[str, list[float]], size: int) -> None:
    expected = [float(size), size * (size - 1) / 2, (size - 1) * size * (2 * size - 1) / 6]
    assert stats == {str(e): expected for e in range(EPOCHS)}


def events(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def checkpoint_steps(directory: str) -> list[int]:
    return [int(re.findall(r"\d+", os.path.basename(p))[0])
            for p in glob.glob(os.path.join(directory, "ckpt-*.pt"))]


def finish(a: Agents, procs: list[Any], timeout: float = 90) -> None:
    for proc in procs:
        assert a.wait(proc, timeout) == 0, a.output(proc)[-4000:]


@pytest.mark.timeout(240)
def test_worker_killed_ends_with_the_weights_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """2 nodes x 1 worker; rank 1 exits at step 27 (checkpoint at 20, a snapshot every step):
    both nodes restart, resume from step 26 in their memory and end bit for bit where one agent
    with 2 workers, never interrupted, ends."""
    size, workdir, port = 1024, str(tmp_path), free_port()
    with agents(workdir) as a:
        nodes = [a.start(node_flags(host, port, "2", 1, *CONF, "--max-restarts", "1"),
                         train_args(workdir, "failed", size, "--fail-at-step", "27",
                                    "--fail-rank", "1"), name=f"n{i}", script=EXAMPLE)
                 for i, host in enumerate(("127.0.0.2", "127.0.0.3"), 1)]
        finish(a, nodes)
        ref = a.start(["--standalone", "--nproc-per-node", "2"], train_args(workdir, "clean", size),
                      name="ref", script=EXAMPLE)
        finish(a, [ref])
        out = "".join(a.output(p) for p in nodes)
    failed, clean = summary(workdir, "failed"), summary(workdir, "clean")
    assert "failing on purpose at step 27" in out and "restart 1/1" in out
    # From this node's memory, or from the other's when rank 0 was killed before its own
    # snapshot of step 26 was complete (a loaded machine): RAM either way, never disk.
    assert re.search(r"resumed from step 26 \(epoch 1, 640 samples consumed\) at world size 2, "
                     r"from (memory|peer)\b", out), out
    assert failed["restart_count"] == 1 and clean["restart_count"] == 0
    assert failed["world_size"] == clean["world_size"] == 2
    assert failed["weights_sha256"] == clean["weights_sha256"]
    assert failed["final_loss"] == clean["final_loss"]
    assert failed["steps"] == clean["steps"] == EPOCHS * size // (2 * BATCH)
    assert_each_sample_once_per_epoch(failed["epoch_stats"], size)
    assert_each_sample_once_per_epoch(clean["epoch_stats"], size)


@pytest.mark.timeout(240)
def test_node_lost_mid_run_sees_each_sample_once_per_epoch(tmp_path: Path) -> None:
    """2 nodes x 2 workers (--nnodes 1:2); once a checkpoint is written at world size 4 the agent
    on 127.0.0.3 is SIGKILLed with its workers; the other node resumes alone at world size 2."""
    size, workdir, port = 2048, str(tmp_path), free_port()
    log = os.path.join(workdir, "events.jsonl")
    ckpt = os.path.join(workdir, "job")
    args = train_args(workdir, "job", size, "--events", log, "--step-time", "0.05")
    with agents(workdir) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "1:2", 2, *CONF, "--max-restarts", "1"), args,
                     name="n1", script=EXAMPLE)
        n2 = a.start(node_flags("127.0.0.3", port, "1:2", 2, *CONF, "--max-restarts", "1"), args,
                     name="n2", script=EXAMPLE)

        def first_step_at_4() -> int | None:
            return next((e["step"] for e in events(log)
                         if e["event"] == "first_step" and e["world"] == 4), None)

        at4 = until(first_step_at_4, 120, "the first step at world size 4")
        until(lambda: any(s > at4 for s in checkpoint_steps(ckpt)), 60,
              "a checkpoint written at world size 4")
        os.kill(n2.pid, signal.SIGKILL)
        assert a.wait(n2, 10) == -signal.SIGKILL
        finish(a, [n1])
        out = a.output(n1)
    final = summary(workdir, "job")
    assert final["world_size"] == 2, out[-4000:]
    assert re.search(r"resumed from step \d+ \(epoch \d, \d+ samples consumed\) "
                     r"at world size 2", out)
    assert "no restart spent" in out
    assert_each_sample_once_per_epoch(final["epoch_stats"], size)


@pytest.mark.timeout(240)
def test_demo_driver_recovers_and_says_ok(tmp_path: Path) -> None:
    """What ``bash scripts/demo`` runs after setting up the venv (here: this interpreter's)."""
    proc = subprocess.Popen([sys.executable, DEMO, "--workdir", str(tmp_path / "demo")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-6000:]
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"demo: OK — recovered in \d+\.\d\d s, final loss \d+\.\d{4}, weights "
                        r"identical to an uninterrupted run, every sample seen once per epoch "
                        r"\(\d+ s in all\)", last), out[-6000:]
    assert "demo: rounds:" in out and "round 2:" in out
