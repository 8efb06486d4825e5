"""examples/train_ddp.py: under torch's own launcher a worker failure is recovered from the last
checkpoint and ends with exactly the weights of an uninterrupted run; resumed at another world size
every sample of each epoch is seen exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from paths import ROOT

EXAMPLE = Path(ROOT) / "examples" / "train_ddp.py"
SIZE, BATCH, EPOCHS = 1024, 32, 2
COMMON = ["--epochs", str(EPOCHS), "--dataset-size", str(SIZE), "--batch-size", str(BATCH),
          "--checkpoint-every", "10", "--log-every", "8", "--seed", "3"]


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Runs ``cmd`` in a session of its own; on timeout the whole session is killed."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd} did not finish within {timeout}s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def torchrun(
    tmp: Path, name: str, *extra: str, restarts: int = 0
) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "--max-restarts", str(restarts), str(EXAMPLE), *COMMON,
                "--checkpoint-dir", str(tmp / name), "--summary", str(tmp / f"{name}.json"),
                *extra], cwd=tmp)


def summary(tmp: Path, name: str, result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stdout[-4000:]
    return json.loads((tmp / f"{name}.json").read_text())


def assert_each_sample_once_per_epoch(stats: dict[str, list[float]]) -> None:
    expected = [float(SIZE), SIZE * (SIZE - 1) / 2, (SIZE - 1) * SIZE * (2 * SIZE - 1) / 6]
    assert stats == {str(e): expected for e in range(EPOCHS)}


@pytest.mark.slow
@pytest.mark.timeout(600)  # two launcher runs of ~10 s each; far more on an overloaded machine
def test_worker_failure_under_torchrun_ends_with_the_same_weights(tmp_path: Path) -> None:
    clean = summary(tmp_path, "clean", torchrun(tmp_path, "clean"))
    result = torchrun(tmp_path, "failed", "--fail-at-step", "27", "--fail-rank", "1", restarts=1)
    failed = summary(tmp_path, "failed", result)
    assert "failing on purpose at step 27" in result.stdout
    assert "resumed from step 20" in result.stdout
    assert failed["restart_count"] == 1 and clean["restart_count"] == 0
    assert failed["weights_sha256"] == clean["weights_sha256"]
    assert failed["final_loss"] == clean["final_loss"]
    assert failed["steps"] == clean["steps"] == EPOCHS * SIZE // (2 * BATCH)
    assert_each_sample_once_per_epoch(clean["epoch_stats"])
    assert_each_sample_once_per_epoch(failed["epoch_stats"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_at_another_world_size_sees_each_sample_once(tmp_path: Path) -> None:
    """Two ranks until one fails (no restart), then one process resumes from the checkpoint."""
    result = torchrun(tmp_path, "job", "--fail-at-step", "27", "--fail-rank", "1")
    assert result.returncode != 0 and "failing on purpose at step 27" in result.stdout
    assert not (tmp_path / "job.json").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    resumed = run([sys.executable, str(EXAMPLE), *COMMON, "--checkpoint-dir", str(tmp_path / "job"),
                   "--summary", str(tmp_path / "job.json")], cwd=tmp_path, env=env)
    assert "resumed from step 20 (epoch 1, 256 samples consumed) at world size 1" in resumed.stdout
    final = summary(tmp_path, "job", resumed)
    assert final["world_size"] == 1
    assert final["steps"] == 20 + (SIZE - 256) // BATCH
    assert_each_sample_once_per_epoch(final["epoch_stats"])
