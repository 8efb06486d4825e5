"""2 nodes x 2 workers: one worker SIGKILLed -> every worker restarts (warm) and the job finishes."""

from __future__ import annotations

import os
import signal
import time

import pytest
from agent_nodes import agents, free_port, node_flags, until

pytestmark = pytest.mark.slow

CONF = ["--rdzv-conf", "last_call_timeout=1", "--max-restarts", "3"]


def test_worker_sigkill_restarts_every_worker_warm(tmp_path: object) -> None:
    port = free_port()
    with agents(str(tmp_path)) as a:
        n1 = a.start(node_flags("127.0.0.2", port, "2", 2, *CONF), ["--dir", a.dir, "--child"], name="n1")
        n2 = a.start(node_flags("127.0.0.3", port, "2", 2, *CONF), ["--dir", a.dir, "--child"], name="n2")
        until(lambda: len(a.inits(0)) == 4, 120, "4 workers past init_process_group")
        first = {s["rank"]: s for s in a.starts()}
        killed_at = time.time()
        os.kill(first[3]["pid"], signal.SIGKILL)

        def restarted() -> int | None:
            later = {s["attempt"] for s in a.starts()} - {0}
            return next((att for att in later if len(a.inits(att)) == 4), None)

        attempt = until(restarted, 60, "every worker restarted past init_process_group")
        recovery = max(a.inits(attempt).values()) - killed_at
        print(f"worker SIGKILL -> 4 workers past init_process_group: {recovery:.3f}s")
        again = {s["rank"]: s for s in a.starts() if s["attempt"] == attempt}
        assert sorted(again) == [0, 1, 2, 3]
        for rank, s in again.items():
            assert s["pid"] != first[rank]["pid"]
            # Warm start: torch was imported before the script ran, forked within a moment.
            assert s["preloaded"] and s["fork_to_main"] < 0.5, s
            assert s["name"] == "__main__" and s["file"].endswith("agent_train.py")
            assert s["argv"][1:] == ["--dir", a.dir, "--child"]
            env = s["env"]
            assert env["TORCHELASTIC_RESTART_COUNT"] == str(attempt)  # the same on every worker
            assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(rank), "4", "2")
            assert env["GROUP_RANK"] == str(rank // 2) and env["GROUP_WORLD_SIZE"] == "2"
            assert env["ROLE_NAME"] == "default" and env["ROLE_WORLD_SIZE"] == "4"
            assert env["TORCHELASTIC_MAX_RESTARTS"] == "3" and env["TORCHELASTIC_RUN_ID"] == "job"
            assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
            assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["OMP_NUM_THREADS"] == "1"
            assert env["ELASTICSTORE_ADDR"] == f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
            assert (env["ELASTICSTORE_HOST"], env["ELASTICSTORE_PORT"]) == (
                env["MASTER_ADDR"], env["MASTER_PORT"])
            assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_{attempt}/{rank}/error.json")
        # The old workers and the children they started are gone.
        from agent_nodes import assert_gone

        assert_gone([s["pid"] for s in first.values()] + [s["child"] for s in first.values()], 5)
        a.release()
        assert a.wait(n1, 60) == 0, a.output(n1)
        assert a.wait(n2, 60) == 0, a.output(n2)
        out = a.output(n2)
        assert "restart 1/3" in out and "succeeded" in out
        assert "[127.0.0.3:3] rank 3 done at world size 4" in out
        assert "no restart spent" in a.output(n1)
