"""torch's own agent (torchrun) with a node lost: the time from SIGKILL of one node (its agent
and its workers, as a process group) to the survivor's workers running again at the smaller
world size, ``--rdzv-backend=elasticstore`` against ``--rdzv-backend=c10d`` in the same run.

    python benchmarks/rendezvous_torchrun.py [--backends elasticstore,c10d] [--limit 120]

Two nodes (127.0.0.2 hosts the rendezvous, 127.0.0.3 is killed), ``--nnodes=1:2``, 2 gloo
workers each (``tests/helpers/programs/rdzv_train.py``), ``--monitor-interval=0.1``; both backends get
``last_call_timeout=1`` (torch accepts only integers). Every process is killed by its
process group at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "tests", "helpers", "programs", "rdzv_train.py")


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _torchrun(backend: str, addr: str, endpoint: str, outdir: Path) -> subprocess.Popen[bytes]:
    conf = "last_call_timeout=1,join_timeout=120"  # torch wants integers
    args = [
        sys.executable, "-m", "torch.distributed.run", f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}", "--rdzv-id=bench", "--nnodes=1:2", "--nproc-per-node=2",
        f"--local-addr={addr}", "--max-restarts=3", "--monitor-interval=0.1",
        f"--rdzv-conf={conf}", TRAIN, str(outdir), "400", "0.25",
    ]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    with open(outdir / f"torchrun-{addr}.log", "wb") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _wait(outdir: Path, pattern: str, count: int, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if len(list(outdir.glob(pattern))) >= count:
            return True
        time.sleep(0.05)
    return False


def node_lost(backend: str, limit: float = 120.0) -> float | None:
    """Seconds from SIGKILL of one node to the survivor's 2 workers running at world size 2."""
    with tempfile.TemporaryDirectory() as tmp:
        outdir = Path(tmp)
        endpoint = f"127.0.0.2:{_free_port('127.0.0.2')}"
        procs = [_torchrun(backend, a, endpoint, outdir) for a in ("127.0.0.2", "127.0.0.3")]
        try:
            if not _wait(outdir, "started-*-4", 4, limit):
                tails = "\n".join(p.read_text(errors="replace")[-3000:]
                                  for p in sorted(outdir.glob("torchrun-*.log")))
                raise RuntimeError(f"{backend}: the 2-node job did not start\n{tails}")
            killed = time.monotonic()
            os.killpg(procs[1].pid, signal.SIGKILL)
            if not _wait(outdir, "started-*-2", 2, limit):
                return None
            return time.monotonic() - killed
        finally:
            for proc in procs:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="elasticstore,c10d")
    parser.add_argument("--limit", type=float, default=120.0)
    args = parser.parse_args()
    results = {}
    for backend in args.backends.split(","):
        secs = node_lost(backend, args.limit)
        results[backend] = secs
        print(f"{backend:>14}: node lost -> survivor running at the smaller size: "
              f"{'>' + str(args.limit) if secs is None else f'{secs:.2f}'} s", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
