"""The agent's worker-output relay and its log files: -r/-t without --log-dir, a log file that
cannot be written, and links planted at the fixed paths under --log-dir (real elasticstore-run,
real workers)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from agent_nodes import agents

TOUCH_MARKER = "echo started > marker; echo out-line; exit 0"


def _one_node(log_dir: str | None, *extra: str) -> list[str]:
    flags = ["--no-python", "--nproc-per-node", "1", "--rdzv-id", "job", "--local-addr", "127.0.0.2"]
    return [*flags, *(["--log-dir", log_dir] if log_dir else []), *extra]


def test_redirects_without_log_dir_keep_output_in_a_printed_temporary_directory(tmp_path: object) -> None:
    tmp = os.path.join(str(tmp_path), "tmp")
    os.makedirs(tmp)
    with agents(str(tmp_path)) as a:
        agent = a.start(["--nproc-per-node", "1", "--local-addr", "127.0.0.2", "-r", "3"],
                        ["--dir", a.dir, "--fail-rank", "0"], env={"TMPDIR": tmp})
        assert a.wait(agent, 180) == 1, a.output(agent)
        out = a.output(agent)
    # As torchrun: the output is kept in a temporary log directory the launcher names.
    found = re.search(r"log directory set to: (\S+)", out)
    assert found, out
    assert found.group(1).startswith(tmp), out
    logs = glob.glob(os.path.join(found.group(1), "*", "attempt_0", "0", "stderr.log"))
    assert len(logs) == 1, (out, os.listdir(found.group(1)))
    with open(logs[0]) as f:
        err = f.read()
    assert "Traceback (most recent call last)" in err and "rank 0 fails on purpose" in err, err
    # Redirected: not on the console.
    assert not [ln for ln in out.splitlines() if ln.startswith("[127.0.0.2:0] Traceback")], out


@pytest.fixture
def full_dir(tmp_path: object) -> Iterator[str]:
    """A 64 KiB tmpfs: writes past it fail with ENOSPC (needs root to mount)."""
    path = os.path.join(str(tmp_path), "full")
    os.makedirs(path)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (running as uid %d)" % os.geteuid())
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", path],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=True, timeout=60)


def test_full_log_file_is_reported_once_and_the_worker_runs_on(tmp_path: object, full_dir: str) -> None:
    script = ("for i in range(3000):\n    print(f'line {i} ' + 'x' * 100, flush=True)\n"
              "open('finished', 'w').close()")
    with agents(str(tmp_path)) as a:
        agent = a.start(_one_node(full_dir, "-r", "1"), ["-c", script], script=sys.executable)
        code = a.wait(agent, 180)
        out = a.output(agent)
    assert code == 0, out
    assert os.path.exists(os.path.join(a.dir, "finished")), out
    reports = [ln for ln in out.splitlines() if "stdout.log: No space left on device" in ln]
    assert len(reports) == 1, out
    assert "the worker runs on" in reports[0], out
    with open(os.path.join(full_dir, "job", "attempt_0", "0", "stdout.log"), "rb") as f:
        assert f.read().startswith(b"line 0 "), "the file got what fitted"


@pytest.mark.parametrize("planted", ["events.jsonl", "attempt_0", "attempt_0/0/stdout.log"])
def test_links_planted_under_log_dir_are_refused_and_their_targets_untouched(
    tmp_path: object, planted: str
) -> None:
    logs = os.path.join(str(tmp_path), "logs")
    victim_dir = os.path.join(str(tmp_path), "elsewhere")
    os.makedirs(os.path.join(victim_dir, "0"))
    victim = os.path.join(victim_dir, "0", "stdout.log") if planted == "attempt_0" else \
        os.path.join(victim_dir, "victim")
    with open(victim, "w") as f:
        f.write("precious\n")
    link = os.path.join(logs, "job", planted)
    os.makedirs(os.path.dirname(link))
    os.symlink(victim_dir if planted == "attempt_0" else victim, link)
    before = os.stat(victim)
    with agents(str(tmp_path)) as a:
        agent = a.start(_one_node(logs), ["-c", TOUCH_MARKER], script="/bin/sh")
        code = a.wait(agent, 120)
        out = a.output(agent)
    assert code == 1, out
    assert f"--log-dir: {link} is a symbolic link: refusing to follow it" in out, out
    with open(victim) as f:
        assert f.read() == "precious\n"
    after = os.stat(victim)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert sorted(os.listdir(victim_dir)) == (["0"] if planted == "attempt_0" else ["0", "victim"])
    assert not os.path.exists(os.path.join(a.dir, "marker")), "no worker starts"
