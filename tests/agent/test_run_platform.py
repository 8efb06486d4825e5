"""What platforms read from the launcher, checked side by side with torchrun (torch 2.13): torch's
file timer for the workers (``TORCHELASTIC_ENABLE_FILE_TIMER``), the launcher's own
``TORCHELASTIC_ERROR_FILE``, and the exit code after a signal (docs/agent.md, "Exit codes and
what platforms read"). One command, both launchers (``LAUNCHERS``), real workers."""

from __future__ import annotations

import glob
import json
import os
import signal
import time

import pytest
from agent_nodes import agents, alive, until
from paths import program

LAUNCHERS = {"elasticstore-run": "elasticstore.run", "torchrun": "torch.distributed.run"}
JOB = program("platform_job.py")


def _pids(workdir: str) -> list[int]:
    pids = []
    for path in glob.glob(os.path.join(workdir, "start-*")):
        with open(path) as f:
            text = f.read()
        if text.isdigit():  # not while the worker is still writing it
            pids.append(int(text))
    return pids


def _kill_left(workdir: str) -> None:
    """torchrun leaves its workers running when it dies: end them (ours are contained)."""
    for pid in _pids(workdir):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _marks(workdir: str, name: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(workdir, f"{name}-*")))


@pytest.mark.slow  # ~15-45 s per launcher on a loaded 2-core machine
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_file_timer_kills_an_overrunning_worker_side_by_side(tmp_path: object, launcher: str) -> None:
    """``with expires(after=1):`` overrun in rank 0: both launchers' timer servers kill that
    worker. torchrun's then kills its own agent (exit 137, no restart: torch's FileTimerServer);
    ours handles it as a worker failure: a restart, and the job finishes."""
    fifo = os.path.join(str(tmp_path), "timer.fifo")
    env = {"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "TORCHELASTIC_TIMER_FILE": fifo}
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    with agents(str(tmp_path)) as a:
        try:
            agent = a.start(flags, ["--dir", a.dir, "--mode", "timer"], env=env, script=JOB,
                            module=LAUNCHERS[launcher])
            code = a.wait(agent, 240)
            out = a.output(agent)
        finally:
            _kill_left(a.dir)
    marks = _marks(a.dir, "start") + _marks(a.dir, "done")
    assert "done-0-0" not in marks, out  # killed inside its timer (it sleeps 60 s there)
    if launcher == "torchrun":
        assert code == -signal.SIGKILL or code == 128 + signal.SIGKILL, (code, out)
        assert "start-1-0" not in marks, out
    else:
        assert code == 0, out
        assert {"done-1-0", "done-1-1"} <= set(marks), (marks, out)
        assert "file timer: scope" in out and "failed with signal SIGKILL; restart 1/1" in out, out
        assert not os.path.exists(fifo), "the FIFO is removed at the end"


@pytest.mark.slow  # ~10-30 s per launcher
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_launcher_error_file_gets_the_root_cause_side_by_side(tmp_path: object, launcher: str) -> None:
    """TorchX and Kubeflow set the launcher's TORCHELASTIC_ERROR_FILE and read it on failure:
    the root cause's ``@record`` file, with ``errorCode`` its exit code."""
    target = os.path.join(str(tmp_path), "launcher-error.json")
    flags = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0"]
    with agents(str(tmp_path)) as a:
        try:
            agent = a.start(flags, ["--dir", a.dir, "--mode", "raise"], script=JOB,
                            env={"TORCHELASTIC_ERROR_FILE": target}, module=LAUNCHERS[launcher])
            code = a.wait(agent, 240)
            out = a.output(agent)
        finally:
            _kill_left(a.dir)
    assert code == 1, out
    with open(target) as f:
        data = json.load(f)
    message = data["message"]
    assert message["message"] == "RuntimeError: boom from rank 0", data
    assert message["errorCode"] == 1, data
    assert "boom from rank 0" in message["extraInfo"]["py_callstack"], data
    assert set(message) == {"message", "extraInfo", "errorCode"}, data


@pytest.mark.slow  # ~10-30 s per launcher
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_exit_code_and_error_file_after_sigterm_side_by_side(tmp_path: object, launcher: str) -> None:
    """SIGTERM to the launcher: the workers are stopped by both; ours exits 128 + 15, torchrun
    1 (or 134 when its interpreter aborts at exit: "terminate called without an active
    exception"); both record the signal in the launcher's error file."""
    target = os.path.join(str(tmp_path), "launcher-error.json")
    flags = ["--standalone", "--nproc-per-node", "1"]
    with agents(str(tmp_path)) as a:
        try:
            agent = a.start(flags, ["--dir", a.dir, "--mode", "sleep"], script=JOB,
                            env={"TORCHELASTIC_ERROR_FILE": target}, module=LAUNCHERS[launcher])
            until(lambda: _pids(a.dir), 180, "the worker started")
            worker = _pids(a.dir)[0]
            agent.send_signal(signal.SIGTERM)
            code = a.wait(agent, 120)
            out = a.output(agent)
            deadline = time.monotonic() + 30
            while alive(worker) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not alive(worker), out
        finally:
            _kill_left(a.dir)
    if launcher == "torchrun":
        assert code in (1, 128 + signal.SIGABRT, -signal.SIGABRT), (code, out)
    else:
        assert code == 128 + signal.SIGTERM, (code, out)
    with open(target) as f:
        data = json.load(f)
    assert data["message"]["message"] == f"SignalException: Process {agent.pid} got signal: 15", data
