"""What the launcher's own process imports for a job: torch (its store is a
``torch.distributed.Store``), but not the training side's heavy parts. The agent reads the
heartbeat layout and the snapshot replicas' files from ``elasticstore.train``; importing those must
not load ``torch.distributed.checkpoint`` (about 1 s of every agent's start here), which only the
workers' snapshot writer needs. A real ``elasticstore-run`` job, its agent's modules read at exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# Runs elasticstore-run's entry point in this process; at exit (in the agent itself, not in a
# process forked from it) writes which of the watched modules it had loaded.
DRIVER = """
import atexit, json, os, sys
pid, out = os.getpid(), sys.argv.pop(1)
WATCHED = ("torch", "elasticstore.agent.agent", "elasticstore.replicas.service",
           "elasticstore.train.heartbeat_layout", "torch.distributed.checkpoint",
           "torch.distributed.tensor", "elasticstore.train.snapshots.writer")

def report():
    if os.getpid() == pid:
        with open(out, "w") as f:
            json.dump({name: name in sys.modules for name in WATCHED}, f)

atexit.register(report)
from elasticstore.run import main_exit
sys.argv[0] = "elasticstore-run"
main_exit()
"""


def test_the_agent_of_a_job_does_not_import_the_snapshot_writer(tmp_path: object) -> None:
    workdir = str(tmp_path)
    script = os.path.join(workdir, "train.py")
    with open(script, "w") as f:
        f.write("import torch.distributed as dist\n"
                "dist.init_process_group('gloo')\n"
                "dist.barrier()\n"
                "dist.destroy_process_group()\n")
    out = os.path.join(workdir, "modules.json")
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, out, "--standalone", "--nproc-per-node", "2", script],
        cwd=workdir, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out) as f:
        loaded = json.load(f)
    # The agent ran a job: it has its own parts and the ones it reads from train/.
    assert loaded["torch"] and loaded["elasticstore.agent.agent"], loaded
    assert loaded["elasticstore.replicas.service"], loaded
    assert loaded["elasticstore.train.heartbeat_layout"], loaded
    # ... and none of the workers' checkpointing side.
    assert not loaded["torch.distributed.checkpoint"], loaded
    assert not loaded["torch.distributed.tensor"], loaded
    assert not loaded["elasticstore.train.snapshots.writer"], loaded


def test_the_training_names_still_load_from_their_packages() -> None:
    import elasticstore.train as train
    import elasticstore.train.snapshots as snapshots

    for name in train.__all__:
        assert getattr(train, name) is not None, name
        assert name in dir(train), name
    for name in snapshots.__all__:
        assert getattr(snapshots, name) is not None, name
    from elasticstore.train import Snapshots
    from elasticstore.train.snapshots.writer import Snapshots as Written

    assert Snapshots is Written
    try:
        train.not_a_name  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as e:
        assert "not_a_name" in str(e)
    else:
        raise AssertionError("an unknown name did not raise AttributeError")
