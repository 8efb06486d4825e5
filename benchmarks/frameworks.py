"""Warm restarts with the frameworks people train with: worker SIGKILL -> the new round's first
training step, for a plain torch DDP script, Lightning ``Trainer(strategy="ddp")`` and Hugging
Face ``Trainer`` (``framework_job.py``; gloo, CPU, one node, 2 workers), under

- ``elasticstore-run`` (warm start, preloading what the workers imported: its default),
- ``elasticstore-run --no-preload-imports`` (warm start with torch only),
- ``torchrun`` (``--standalone``, c10d), in the same run.

Each cell: start the launcher, wait until every worker took its first step and then ``--settle``
seconds (the fork server preloads while the job trains), SIGKILL rank 1, time until every worker
of the new round took its first step. Lightning, transformers and accelerate must be installed
(measured with ``pip install lightning==2.6.6 transformers==5.24.0 accelerate==1.15.0``); a
framework that is not is skipped. Results: ``results/frameworks.md``.

    python benchmarks/frameworks.py [--frameworks torch,lightning,hf] [--repeat 1] [--settle 10]
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import signal
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))

from agent_nodes import Agents, until  # noqa: E402

JOB = os.path.join(HERE, "framework_job.py")
NPROC = 2
LIMIT = float(os.environ.get("FRAMEWORKS_BENCH_LIMIT", "120"))  # seconds: "did not recover"
PEERS = {
    "elasticstore-run": ("elasticstore.run", []),
    "elasticstore-run --no-preload-imports": ("elasticstore.run", ["--no-preload-imports"]),
    "torchrun": ("torch.distributed.run", []),
}
NEEDS = {"torch": "torch", "lightning": "lightning", "hf": "transformers"}


def _steps(workdir: str, attempt: int) -> dict[int, float]:
    found = {}
    for path in glob.glob(os.path.join(workdir, f"step-{attempt}-*")):
        if not path.endswith(".tmp"):
            with open(path) as f:
                found[int(path.rsplit("-", 1)[1])] = float(f.read())
    return found


def _pid(workdir: str, attempt: int, rank: int) -> int:
    import json

    with open(os.path.join(workdir, f"start-{attempt}-{rank}.json")) as f:
        return int(json.load(f)["pid"])


def cell(framework: str, peer: str, settle: float) -> dict[str, Any]:
    module, flags = PEERS[peer]
    with tempfile.TemporaryDirectory(prefix="fw_bench_") as workdir:
        a = Agents(workdir)
        try:
            t0 = time.time()
            agent = a.start(["--standalone", "--nproc-per-node", str(NPROC), "--max-restarts", "3",
                             *flags], ["--framework", framework, "--dir", workdir],
                            name="launcher", script=JOB, module=module,
                            env={"OMP_NUM_THREADS": "1"})
            until(lambda: len(_steps(workdir, 0)) == NPROC or agent.poll() is not None, 300,
                  "the first steps")
            if agent.poll() is not None:
                return {"error": a.output(agent)[-2000:]}
            cold = max(_steps(workdir, 0).values()) - t0
            time.sleep(settle)
            killed = time.time()
            os.kill(_pid(workdir, 0, 1), signal.SIGKILL)
            deadline = time.monotonic() + LIMIT
            while time.monotonic() < deadline and agent.poll() is None:
                attempts = sorted({int(p.split("-")[-2]) for p in glob.glob(
                    os.path.join(workdir, "step-*")) if not p.endswith(".tmp")})
                new = [att for att in attempts if att > 0 and len(_steps(workdir, att)) == NPROC]
                if new:
                    steps = _steps(workdir, new[0])
                    out = a.output(agent)
                    pre = [ln.split(": ", 1)[1] for ln in out.splitlines()
                           if "preloaded for this round:" in ln]
                    refused = [ln.split("] ", 1)[1] for ln in out.splitlines()
                               if "not preloaded: " in ln or ", whose import looks up " in ln]
                    return {"cold": cold, "recover": max(steps.values()) - killed,
                            "preloaded": pre[-1] if pre else "", "refused": refused}
                time.sleep(0.02)
            return {"error": f"no new round's first step within {LIMIT:.0f}s",
                    "tail": a.output(agent)[-1500:]}
        finally:
            open(os.path.join(workdir, "stop"), "w").close()
            a.cleanup_quiet()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", default="torch,lightning,hf")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--settle", type=float, default=10.0)
    args = p.parse_args()
    rows = []
    for fw in args.frameworks.split(","):
        if importlib.util.find_spec(NEEDS[fw]) is None:
            print(f"{fw}: {NEEDS[fw]} is not installed, skipped", flush=True)
            continue
        for peer in args.peers.split(","):
            for _ in range(args.repeat):
                r = cell(fw, peer, args.settle)
                rows.append((fw, peer, r))
                print(f"{fw:10s} {peer:40s} " + (
                    f"cold {r['cold']:.2f}s  kill -> first step {r['recover']:.2f}s"
                    if "recover" in r else f"ERROR {r}"), flush=True)
                for line in r.get("refused", []):
                    print(f"    {line}", flush=True)
    print("\n| framework | launcher | cold start -> first step | worker SIGKILL -> new round's first step | preloaded |")
    print("|---|---|---|---|---|")
    for fw, peer, r in rows:
        if "recover" in r:
            print(f"| {fw} | {peer} | {r['cold']:.2f} s | **{r['recover']:.2f} s** | {r['preloaded'][:80]} |")
        else:
            print(f"| {fw} | {peer} | - | {r.get('error', '')[:80]} | |")


if __name__ == "__main__":
    main()
