"""torch's Python launch API on elasticstore's agent: one program launched with torch's
``elastic_launch`` and with ``elasticstore.launcher.elastic_launch`` (the import is the only
difference), its results compared: a function's return values by global rank (the function
pickled from the caller's own script, run warm by the fork server or in a fresh interpreter), a
failure as torch's ChildFailedError, a command entrypoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from agent_nodes import free_port
from paths import program

PROGRAM = program("launch_api.py")


def _launch(tmp: str, which: str, mode: str, start_method: str = "spawn") -> dict[str, Any]:
    out = os.path.join(tmp, f"{which}-{mode}-{start_method}.json")
    done = subprocess.run([sys.executable, PROGRAM, which, mode, str(free_port("127.0.0.1")), out,
                           start_method], cwd=tmp, capture_output=True, timeout=240)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
    with open(out) as f:
        report: dict[str, Any] = json.load(f)
    if mode in ("logs", "filters"):  # teed: torch's prefix on both (elsewhere ours prefixes, torch's not)
        report["console"] = sorted(ln for ln in done.stdout.decode().splitlines() if "says hello" in ln)
    return report


def _without_warm(report: dict[str, Any]) -> tuple[dict[str, Any], set[bool]]:
    warm = set()
    for value in report.get("result", {}).values():
        if isinstance(value, dict):
            warm.add(value.pop("warm"))
    return report, warm


@pytest.mark.slow  # two launches with torch imported by each worker: 10-25 s on 2 loaded cores
@pytest.mark.parametrize("mode", ["ok", "fail", "flaky", "command", "logs", "filters"])
def test_same_program_same_results_as_torchs_elastic_launch(tmp_path: object, mode: str) -> None:
    tmp = str(tmp_path)
    theirs, _ = _without_warm(_launch(tmp, "torch", mode))
    ours, _ = _without_warm(_launch(tmp, "elasticstore", mode))
    assert ours == theirs, (ours, theirs)
    if mode in ("logs", "filters"):  # torch's DefaultLogsSpecs: torchrun's layout under its directory
        filtered = ["attempt_0/filtered_stdout.log"] if mode == "filters" else []
        assert ours["files"] == [f"attempt_0/{r}/{s}.log" for r in (0, 1)
                                 for s in ("stderr", "stdout")] + filtered, ours
        assert ours["stdout_1"] == "trainer rank 1 says hello\n", ours
        assert ours["console"] == [f"[default_role{r}]:trainer rank {r} says hello" for r in (0, 1)], ours
    if mode == "filters":  # duplicate_stdout_filters: the matching teed lines, prefixed
        assert ours["filtered"] == "[default_role1]:trainer rank 1 says hello\n", ours
    if mode in ("ok", "flaky"):  # flaky: the values of the round after the restart
        assert sorted(ours["result"]) == ["0", "1"] and ours["result"]["0"]["sum"] == 30.0, ours
        assert {v["tag"] for v in ours["result"].values()} == {mode}, ours
    if mode == "fail":
        assert ours["failed"] == "trainer" and list(ours["failures"]) == ["1"], ours
        assert "rank 1 fails on purpose" in ours["failures"]["1"]["message"], ours


# spawn: fresh interpreters importing torch (slow, 5-20 s on 2 loaded cores); forkserver: 5 s
@pytest.mark.parametrize("start_method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])
def test_function_entrypoint_warm_or_fresh_returns_values_by_rank(tmp_path: object, start_method: str) -> None:
    ours, warm = _without_warm(_launch(str(tmp_path), "elasticstore", "ok", start_method))
    assert ours == {"result": {str(r): {"rank": r, "world": 2, "sum": 30.0, "tag": "ok", "local_rank": r}
                               for r in (0, 1)}}, ours
    assert warm == {start_method == "forkserver"}, warm
