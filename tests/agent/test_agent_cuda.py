"""Warm start on a CUDA machine (skipped without a CUDA device): the fork server never initialises
CUDA (no /dev/nvidia* device opened or mapped; ``import torch`` may map the driver library, which
is not an initialisation), before or after its workers ran; each forked worker initialises CUDA
itself and runs device work; a failed worker's restart forks from the same fork server and works
again; NCCL (one worker per device) and gloo next to CUDA."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import pytest
import torch
from agent_nodes import agents
from paths import program

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

PROBE = program("cuda_probe.py")


def _records(d: str) -> list[dict[str, Any]]:
    found = []
    for path in sorted(glob.glob(os.path.join(d, "cuda-*.json"))):
        with open(path) as f:
            found.append(json.load(f))
    return found


@pytest.mark.parametrize("backend,nproc", [("gloo", 2), ("nccl", 1)])
def test_forked_workers_initialise_cuda_and_the_fork_server_never_does(
        tmp_path: Any, backend: str, nproc: int) -> None:
    d = str(tmp_path)
    nproc = min(nproc * max(1, torch.cuda.device_count()), 2) if backend == "nccl" else nproc
    with agents(d) as a:
        agent = a.start(["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1"],
                        ["--dir", d, "--backend", backend, "--fail-rank", str(nproc - 1)],
                        script=PROBE)
        assert a.wait(agent, 300) == 0, a.output(agent)
        out = a.output(agent)
    recs = _records(d)
    print("\n".join(json.dumps(r) for r in recs))
    assert sorted((r["attempt"], r["rank"]) for r in recs) == sorted(
        (att, r) for att in (0, 1) for r in range(nproc))
    for r in recs:
        assert r["preloaded"], r  # warm: torch was imported before the script
        assert not r["cuda_initialised_at_start"], r
        assert r["opened_gpu"], r  # the probe sees its own CUDA context
        assert not r["parent_opened_gpu"] and not r["parent_opened_gpu_after"], r
        assert r["all_reduce"] == (nproc * (nproc + 1) / 2 if backend == "nccl" else nproc)
    parents = {r["parent"] for r in recs}
    assert len(parents) == 1, f"the restart forked from another process: {parents}\n{out}"
    took = ", ".join(f"{r['cuda_first_op_seconds']:.2f}s" for r in recs)
    print(f"CUDA first op in a forked worker: {took}")
