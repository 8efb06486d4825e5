"""``--logs-specs NAME`` (and ``PET_LOGS_SPECS``) side by side with torchrun: a LogsSpecs class
registered as a ``torchrun.logs_specs`` entry point (a dist-info on PYTHONPATH) places each
local rank's files; both launchers write the same files with the same contents."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent

PLUGIN = '''
import json, os
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std, to_map

class FlatLogsSpecs(LogsSpecs):
    """Flat files <log_dir>/<role>-<rank>-a<restart>.{out,err,json}; the envs it got recorded."""

    @property
    def root_log_dir(self):
        return str(self._root_log_dir)

    def reify(self, envs):
        n = len(envs)
        redirs, tees = to_map(self._redirects, n), to_map(self._tee, n)
        d = LogsDest(filtered_stdout=os.path.join(self._root_log_dir, "filtered.out"))
        for lr, env in envs.items():
            rd = redirs[lr] | tees[lr]
            base = os.path.join(self._root_log_dir,
                                f"{env['ROLE_NAME']}-{env['RANK']}-a{env['TORCHELASTIC_RESTART_COUNT']}")
            d.stdouts[lr] = base + ".out" if rd & Std.OUT else ""
            d.stderrs[lr] = base + ".err" if rd & Std.ERR else ""
            if tees[lr] & Std.OUT and (not self._local_ranks_filter or lr in self._local_ranks_filter):
                d.tee_stdouts[lr] = d.stdouts[lr]
            d.error_files[lr] = env["TORCHELASTIC_ERROR_FILE"] = base + ".json"
        with open(os.path.join(self._root_log_dir, "envs.jsonl"), "a") as f:
            f.write(json.dumps({lr: sorted(env) for lr, env in envs.items()}) + "\\n")
        return d
'''

SCRIPT = '''
import os, sys, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"out {rank} attempt {restart}", flush=True)
    print(f"err {rank} attempt {restart}", file=sys.stderr, flush=True)
    if rank == "0" and restart == "0":
        open("rank0-printed", "w").close()  # in the launcher's working directory
    if rank == "1" and restart == "0":
        deadline = time.monotonic() + 60  # rank 0's lines are written before the failure
        while not os.path.exists("rank0-printed") and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("rank 1 fails once")

main()
'''


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    info = site / "flatlogs-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "flatlogs.py").write_text(PLUGIN)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flatlogs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[torchrun.logs_specs]\nflat = flatlogs:FlatLogsSpecs\n")
    return site


def _env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**env, **extra}


def _files(root: Path) -> dict[str, str]:
    """Every file below ``root``, its contents; an error file: only its message."""
    out = {}
    for p in sorted(root.iterdir()):
        text = p.read_text()
        if p.suffix == ".json":
            text = json.loads(text)["message"]["message"]
        elif p.name == "envs.jsonl":
            text = "".join(sorted(text.splitlines(keepends=True)))
        out[p.name] = text
    return out


def test_a_logs_specs_entry_point_places_the_same_files_as_under_torchrun(
        site: Path, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    procs = {}
    for launcher in ("torchrun", "elasticstore-run"):
        logs = tmp_path / launcher / "logs"
        logs.mkdir(parents=True)
        cmd = [str(VENV_BIN / launcher), "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "--logs-specs", "flat", "--log-dir", str(logs), "-r", "3",
               "-t", "1", "--local-ranks-filter", "0", "--duplicate-stdout-filters", "out",
               str(tmp_path / "train.py")]
        procs[launcher] = subprocess.Popen(cmd, env=_env(site), cwd=tmp_path / launcher,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    try:
        for launcher, p in procs.items():
            out, err = p.communicate(timeout=120)
            results[launcher] = (p.returncode, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for launcher, (code, out, err) in results.items():
        assert code == 0, (launcher, out, err)
        assert "[default0]:out 0 attempt 1" in out, (launcher, out)  # -t 1: teed to the console
        assert "out 1 attempt" not in out, (launcher, out)  # the plugin keeps rank 1 off it
        assert "err 0 attempt" not in out + err, (launcher, err)  # -r 3 alone: the file only
    torch_files = _files(tmp_path / "torchrun" / "logs")
    ours = _files(tmp_path / "elasticstore-run" / "logs")
    assert ours == torch_files
    assert torch_files["default-1-a0.json"] == "RuntimeError: rank 1 fails once"
    assert torch_files["default-0-a1.err"] == "err 0 attempt 1\n"
    assert torch_files["filtered.out"] == "[default0]:out 0 attempt 1\n"


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_missing_logs_specs_name_is_a_usage_error_naming_the_flag(
        site: Path, tmp_path: Path, how: str) -> None:
    """torchrun's --logs-specs has no PET_ fallback: it ignores PET_LOGS_SPECS and runs the script;
    elasticstore-run takes it as the flag (no PET_ variable is ignored)."""
    (tmp_path / "t.py").write_text("print('never')\n")
    argv = ["--logs-specs", "nosuch"] if how == "flag" else []
    env = _env(site, **({"PET_LOGS_SPECS": "nosuch"} if how == "env" else {}))
    runs = {}
    for launcher in ("torchrun", "elasticstore-run"):
        runs[launcher] = subprocess.run(
            [str(VENV_BIN / launcher), "--standalone", *argv, str(tmp_path / "t.py")],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    ours, torch = runs["elasticstore-run"], runs["torchrun"]
    assert ours.returncode == 2 and "never" not in ours.stdout
    assert ours.stderr.startswith("elasticstore-run: error: --logs-specs: 'nosuch': no entry point "
                                  "of that name in the torchrun.logs_specs group"), ours.stderr
    if how == "flag":
        assert torch.returncode != 0 and "never" not in torch.stdout
        assert "torchrun.logs_specs[nosuch]" in torch.stderr, torch.stderr
    else:
        assert torch.returncode == 0 and "never" in torch.stdout


LAUNCH = '''
import socket, sys
which, logs, script = sys.argv[1:4]
if which == "torch":
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
else:
    from elasticstore.launcher import LaunchConfig, elastic_launch
from torch.distributed.elastic.multiprocessing import Std
from flatlogs import FlatLogsSpecs

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="flat", max_restarts=1,
                      logs_specs=FlatLogsSpecs(log_dir=logs, redirects=Std.ALL, tee=Std.OUT),
                      rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", monitor_interval=0.1)
print(sorted(elastic_launch(config, sys.executable)("-u", script)))
'''


def test_elastic_launch_takes_any_logs_specs_as_torchs(site: Path, tmp_path: Path) -> None:
    """elasticstore.launcher with a LogsSpecs other than DefaultLogsSpecs: the files of torch's
    elastic_launch with the same config."""
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "launch.py").write_text(LAUNCH)
    procs = {}
    for which in ("torch", "elasticstore"):
        logs = tmp_path / which
        logs.mkdir()
        procs[which] = subprocess.Popen(
            [sys.executable, str(tmp_path / "launch.py"), which, str(logs), str(tmp_path / "train.py")],
            env=_env(site), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for which, p in procs.items():
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0 and out.splitlines()[-1] == "[0, 1]", (which, out, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    theirs = _files(tmp_path / "torch")
    assert _files(tmp_path / "elasticstore") == theirs
    assert theirs["default_role-1-a0.json"] == "RuntimeError: rank 1 fails once"
