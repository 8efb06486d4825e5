"""The end of a job: a node whose workers finished is never taken for a lost node, whichever
node's workers finish first (the one hosting the stores, or the other); and a finished run id is
refused on an external store until ``elasticstore forget``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from agent_nodes import agents, free_port, node_flags, until

import elasticstore

pytestmark = pytest.mark.slow

PROMPT = 30.0  # s from the later node's workers finishing to both agents' exit (drain: 120 s)
LINGER = 4.0  # s the later node's workers linger after training


@pytest.mark.parametrize("rdzv_host", ["rank0", "rank1"])
@pytest.mark.parametrize("first", ["host", "other"])
def test_nodes_finishing_seconds_apart_both_exit_0_promptly(tmp_path: object, first: str,
                                                            rdzv_host: str) -> None:
    """2 nodes x 2 workers; one worker fails once (a round replaced), then training to the end;
    one node's workers finish ``LINGER`` s after the other's. The node hosting the rendezvous
    store is rank 0 (it hosts the round's store too) or rank 1 (rank 0 hosts the round's)."""
    host = "127.0.0.2" if rdzv_host == "rank0" else "127.0.0.3"  # ranks follow the addresses
    other = "127.0.0.3" if host == "127.0.0.2" else "127.0.0.2"
    late = other if first == "host" else host
    port = free_port(host)
    with agents(str(tmp_path)) as a:
        procs = {}
        for addr in ("127.0.0.2", "127.0.0.3"):
            args = ["--dir", str(tmp_path), "--fail-rank", "3", "--fail-attempt", "0"] + (
                ["--exit-delay", str(LINGER)] if addr == late else [])
            flags = node_flags(addr, port, "2", 2, "--max-restarts", "1")
            flags[flags.index("--rdzv-endpoint") + 1] = f"{host}:{port}"
            procs[addr] = a.start(flags, script_args=args, name=addr)
        until(lambda: len(a.inits(1)) == 4 or any(p.poll() is not None for p in procs.values()),
              180, "4 workers of the second attempt past init_process_group")
        assert len(a.inits(1)) == 4, {n: a.output(p) for n, p in procs.items()}
        a.release()
        codes = {}
        released = time.monotonic()
        for addr, proc in procs.items():
            codes[addr] = a.wait(proc, PROMPT + LINGER + 150)
        took = time.monotonic() - released
        outs = {addr: a.output(proc) for addr, proc in procs.items()}
        print(f"rendezvous host {rdzv_host}, {first} first: both agents exited {took:.1f}s "
              f"after the release")
        assert codes == {"127.0.0.2": 0, "127.0.0.3": 0}, outs
        for out in outs.values():
            assert "succeeded" in out and "not every node finished" not in out, outs
            last = out.split("[elasticstore-run] round 2:")[-1]
            assert "round ended" not in last and "round 3" not in last, outs  # not a lost peer
        assert took < PROMPT + LINGER, outs


@contextmanager
def _native() -> Iterator[tuple[list[str], str]]:
    with elasticstore.StoreServer("127.0.0.2", 0) as server:  # an external store
        yield ["--rdzv-endpoint", server.address], "job"


@contextmanager
def _etcd() -> Iterator[tuple[list[str], str]]:
    etcd_cluster = pytest.importorskip("etcd_cluster")
    pytest.importorskip("etcd3")
    cluster = etcd_cluster.shared()
    yield (["--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints[0],
            "--rdzv-conf", "lease_ttl=2"], f"job-{uuid.uuid4().hex[:8]}")


def _launch(workdir: str, store: list[str], run_id: str, addr: str) -> tuple[int, str, int]:
    """One 1:2 node with one worker that finishes at once: (exit code, output, workers started)."""
    os.makedirs(workdir)
    open(os.path.join(workdir, "release"), "w").close()
    with agents(workdir) as a:
        proc = a.start([*store, "--rdzv-id", run_id, "--local-addr", addr, "--nnodes", "1:2",
                        "--nproc-per-node", "1", "--rdzv-conf", "last_call_timeout=0.5"],
                       name=addr)
        code = a.wait(proc, 120)
        return code, a.output(proc), len(a.starts())


@pytest.mark.parametrize("store", [_native, _etcd], ids=["native", "etcd"])
def test_finished_run_id_is_refused_until_forget(tmp_path: object, store: Any) -> None:
    with store() as (flags, run_id):
        code, out, started = _launch(f"{tmp_path}/first", flags, run_id, "127.0.0.3")
        assert (code, started) == (0, 1), out
        for name, addr in (("again", "127.0.0.3"), ("late", "127.0.0.4")):  # relaunch, late node
            code, out, started = _launch(f"{tmp_path}/{name}", flags, run_id, addr)
            assert code == 1 and started == 0, out
            assert f"rendezvous {run_id!r} is closed (finished: a job with this run id already " \
                   f"succeeded); to reuse the run id, remove its keys: elasticstore forget" in out, out
            assert "refused (the run id finished before)" in out, out
        hint = out.split("remove its keys: elasticstore ")[1].split("\n")[0].split()
        forgot = subprocess.run([sys.executable, "-m", "elasticstore.cli", *hint],
                                capture_output=True, text=True, timeout=60)
        assert forgot.returncode == 0, forgot.stderr
        code, out, started = _launch(f"{tmp_path}/after_forget", flags, run_id, "127.0.0.4")
        assert (code, started) == (0, 1), out
        assert "round 1:" in out, out
