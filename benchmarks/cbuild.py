"""The small C/C++ helpers of the benchmarks, compiled on first use, and the no_rdns re-exec.

Both are built into a per-user temp dir (rebuilt when the source is newer): tcp_pingpong.cpp
(see pingpong.py) and no_rdns.c, which report.py and conftest.py preload by re-executing
themselves (torch's TCPStore client does a reverse DNS lookup per connect).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import procs


def build(src_name: str, out_name: str, argv: list) -> str:
    """Compiles benchmarks/<src_name> once into a per-user temp dir (rebuilt when newer)."""
    src = os.path.join(procs.HERE, src_name)
    out_dir = os.path.join(tempfile.gettempdir(), f"elasticstore-bench-{os.getuid()}")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, out_name)
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(src):
        subprocess.run(argv + ["-o", out + ".tmp", src], check=True, timeout=300)
        os.replace(out + ".tmp", out)
    return out


def no_rdns_shim() -> str:
    """no_rdns.so (see no_rdns.c), for LD_PRELOAD."""
    cc = os.environ.get("CC", "cc")
    return build("no_rdns.c", "no_rdns.so", [cc, "-O2", "-shared", "-fPIC", "-ldl"])


def reexec_without_rdns(argv: list) -> None:
    """Re-executes this process (argv) with the no_rdns shim preloaded, once."""
    if os.environ.get("ELASTICSTORE_BENCH_NO_RDNS") == "1":
        return
    shim = no_rdns_shim()
    env = dict(os.environ, ELASTICSTORE_BENCH_NO_RDNS="1")
    env["LD_PRELOAD"] = ":".join(x for x in (shim, env.get("LD_PRELOAD")) if x)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + argv, env)


def rdns_mode() -> str:
    return "shimmed" if os.environ.get("ELASTICSTORE_BENCH_NO_RDNS") == "1" else "real"
