"""Connect latency and per-operation latency with and without a token, against an
``elasticstore-server`` process on loopback. Prints medians and p99 in microseconds.

    python benchmarks/auth_cost.py [--connects N] [--ops N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sysconfig
import tempfile
import time
from datetime import timedelta

from elasticstore import Store


def _server(token_file: str | None) -> tuple[subprocess.Popen[str], int]:
    binary = os.path.join(sysconfig.get_path("scripts"), "elasticstore-server")
    argv = [binary, "--port", "0"] + (["--token-file", token_file] if token_file else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICSTORE_TOKEN")}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline().strip().rsplit(":", 1)[1])


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connects", type=int, default=500)
    parser.add_argument("--ops", type=int, default=5000)
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".token") as f:
        f.write(os.urandom(32).hex())
        f.flush()
        token = open(f.name).read()
        for label, token_file, tok in (("no token", None, ""), ("token", f.name, token)):
            proc, port = _server(token_file)
            try:
                connects: list[float] = []
                for _ in range(args.connects):
                    t0 = time.perf_counter()
                    s = Store("127.0.0.1", port, token=tok, timeout=timedelta(seconds=30))
                    connects.append(time.perf_counter() - t0)
                    s.close()
                store = Store("127.0.0.1", port, token=tok, timeout=timedelta(seconds=30))
                ops: list[float] = []
                for i in range(args.ops):
                    t0 = time.perf_counter()
                    store.set("k", str(i))
                    store.get("k")
                    ops.append((time.perf_counter() - t0) / 2)
                store.close()
            finally:
                proc.terminate()
                proc.wait()
            print(
                f"{label:9s} connect p50 {statistics.median(connects) * 1e6:7.1f} us "
                f"p99 {_pct(connects, 0.99):7.1f} us | op p50 {statistics.median(ops) * 1e6:6.1f} us "
                f"p99 {_pct(ops, 0.99):6.1f} us"
            )


if __name__ == "__main__":
    main()
