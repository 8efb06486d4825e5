"""torch's own TCPStore client on the elasticstore server: env:// scripts, torchrun's c10d
rendezvous, and clients that misbehave. (The conformance suite runs torch's client against our
server as one of its store kinds.)"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

import elasticstore
from spawned import cli_server, closed_by_server, kill_all, wait_until
from paths import PROGRAMS, program

JOB = program("tcpstore_job.py")
JOB_TIMEOUT_S = 180.0
VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)


@pytest.fixture
def cli_server_proc() -> Iterator[tuple[str, int, subprocess.Popen[str]]]:
    """``elasticstore server`` in its own process, as a job would run it."""
    with cli_server("--host", "127.0.0.1") as server:
        yield server.host, server.port, server.proc


def _run_all(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        kill_all(procs)
        pytest.fail(f"processes did not finish within {timeout}s")
    finally:
        kill_all(procs)
    for code, out, err in results:
        assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err[-4000:]}"
    return results


def _job_results(results_dir: str) -> list[dict[str, object]]:
    """The job's results, one file per worker (see ``tcpstore_job.report``): workers share a
    stdout under torchrun, where two JSON lines once interleaved into one."""
    results = []
    for name in sorted(os.listdir(results_dir)):
        if name.startswith("rank-") and name.endswith(".json"):
            with open(os.path.join(results_dir, name)) as f:
                results.append(json.load(f))
    return sorted(results, key=lambda r: r["rank"])  # type: ignore[no-any-return]


def _check_job(results: list[dict[str, object]], world: int) -> None:
    assert [r["rank"] for r in results] == list(range(world))
    assert all(r["sum"] == world * (world + 1) / 2 for r in results)
    evens = [r + 1 for r in range(world) if r % 2 == 0]
    assert all(r["even_sum"] == sum(evens) for r in results if r["even_sum"] is not None)


def test_job_results_survive_interleaved_stdout(tmp_path: pathlib.Path) -> None:
    """Two workers write to one stdout pipe, one of them in pieces (as a line could be split
    under torchrun): the harness reads each worker's own result file, whole."""
    results_dir = str(tmp_path)
    code = (
        "import os, sys, time\n"
        f"sys.path.insert(0, {PROGRAMS!r})\n"
        "import tcpstore_job\n"
        "rank = int(sys.argv[1])\n"
        "if rank == 0:\n"
        "    os.write(1, b'{\"rank\": 0, \"partial')  # a line cut in two\n"
        "    time.sleep(0.3)\n"
        "else:\n"
        "    time.sleep(0.1)\n"
        "tcpstore_job.report({'rank': rank, 'sum': 3.0})\n"
    )
    read, write = os.pipe()
    env = dict(os.environ, ELASTICSTORE_JOB_RESULTS=results_dir)
    workers = [subprocess.Popen([sys.executable, "-c", code, str(rank)], stdout=write, env=env)
               for rank in range(2)]
    os.close(write)
    with os.fdopen(read) as shared:
        stdout = shared.read()
    assert [w.wait(timeout=60) for w in workers] == [0, 0]
    with pytest.raises(json.JSONDecodeError):  # what parsing the shared stdout ran into
        [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert _job_results(results_dir) == [{"rank": 0, "sum": 3.0}, {"rank": 1, "sum": 3.0}]


def test_env_script_runs_unchanged_on_our_server(
    cli_server_proc: tuple[str, int, subprocess.Popen[str]], tmp_path: pathlib.Path,
) -> None:
    """Four workers with MASTER_ADDR/MASTER_PORT at our server, as torchrun launches them
    (TORCHELASTIC_USE_AGENT_STORE tells torch the store is hosted elsewhere)."""
    host, port, server = cli_server_proc
    world = 4
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            MASTER_ADDR=host,
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RESTART_COUNT="0",
            ELASTICSTORE_JOB_RESULTS=str(tmp_path),
        )
        procs.append(
            subprocess.Popen([sys.executable, JOB], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    _run_all(procs, JOB_TIMEOUT_S)
    results = _job_results(str(tmp_path))
    _check_job(results, world)
    assert server.poll() is None, "the server must outlive the job"
    probe = elasticstore.Store(host, port, timeout=timedelta(seconds=10))
    assert probe.num_keys() > 0  # the job's keys live on our server


def test_torchrun_c10d_rendezvous_on_our_server(
    cli_server_proc: tuple[str, int, subprocess.Popen[str]], tmp_path: pathlib.Path,
) -> None:
    """torchrun's own c10d rendezvous: 2 agents (127.0.0.2, 127.0.0.3) x 2 workers."""
    host, port, _ = cli_server_proc
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    agents = []
    for node in (2, 3):
        cmd = torchrun + [
            "--nnodes=2",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host}:{port}",
            "--rdzv-id=compat-job",
            "--rdzv-conf=is_host=false",
            f"--local-addr=127.0.0.{node}",
            "--max-restarts=0",
            JOB,
        ]
        env = dict(os.environ, ELASTICSTORE_JOB_RESULTS=str(tmp_path))  # workers inherit it
        agents.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        )
    _run_all(agents, JOB_TIMEOUT_S)
    results = _job_results(str(tmp_path))
    _check_job(results, 4)
    probe = elasticstore.Store(host, port, timeout=timedelta(seconds=10))
    assert any("compat-job" in key for key in probe.list_keys()), "the rendezvous ran on our server"


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"\x00" + struct.pack("<I", 0xDEADBEEF), "wrong magic"),
        (VALIDATE + b"\x63", "unknown opcode 99"),
        (VALIDATE + b"\x03" + struct.pack("<Q", 1 << 40), "key of 1099511627776 bytes"),
        (VALIDATE + b"\x03" + struct.pack("<Q", 5) + b"/ha", None),  # half-sent, then closed
    ],
    ids=["wrong-magic", "unknown-opcode", "huge-key", "half-sent-frame"],
)
def test_misbehaving_torch_client_closes_only_itself(
    payload: bytes, reason: str | None, capfd: pytest.CaptureFixture[str]
) -> None:
    with elasticstore.StoreServer() as server:
        torch_client = dist.TCPStore(server.host, server.port, is_master=False, timeout=timedelta(seconds=10))
        torch_client.set("before", "1")
        bad = _connect(server.port)
        bad.sendall(payload)
        if reason is None:
            bad.shutdown(socket.SHUT_WR)
        assert closed_by_server(bad)
        bad.close()
        # The well-behaved client on the same server is unaffected.
        torch_client.set("after", "2")
        assert torch_client.get("before") == b"1"
        assert torch_client.check(["before", "after"])
        wait_until(lambda: server.stats()["connections"] == 1, 10, "the bad connection to be reaped")
        if reason is not None:
            err = capfd.readouterr().err
            assert "elasticstore: closing connection 127.0.0.1:" in err and reason in err, err


def test_add_on_text_closes_with_a_logged_reason(capfd: pytest.CaptureFixture[str]) -> None:
    """torch's protocol has no error reply for ADD; the server says why it closes."""
    with elasticstore.StoreServer() as server:
        native = elasticstore.Store(server.host, server.port, timeout=timedelta(seconds=10))
        native.set("text", "not a number")
        torch_client = dist.TCPStore(server.host, server.port, is_master=False, timeout=timedelta(seconds=5))
        with pytest.raises(dist.DistError):
            torch_client.add("text", 1)
        assert native.get("text") == b"not a number"  # nothing lost
        err = capfd.readouterr().err
        assert 'ADD on key "text" whose value is not a decimal int64' in err, err


def test_compare_set_creating_a_key_wakes_torch_waiters() -> None:
    with elasticstore.StoreServer() as server:
        waiter = dist.TCPStore(server.host, server.port, is_master=False, timeout=timedelta(seconds=10))
        setter = dist.TCPStore(server.host, server.port, is_master=False, timeout=timedelta(seconds=10))
        import threading

        woke: list[float] = []
        thread = threading.Thread(target=lambda: (waiter.wait(["created"]), woke.append(time.monotonic())))
        thread.start()
        wait_until(lambda: server.stats()["waiters"] == 1, 10, "the WAIT to be parked")
        assert setter.compare_set("created", "", "v") == b"v"
        thread.join(10)
        assert woke, "compare_set creating the key did not wake the waiter"
