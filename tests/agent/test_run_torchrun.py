"""torchrun command lines that elasticstore-run runs as torchrun does (real launcher, real
workers): the default static rendezvous on --master-addr/--master-port, abbreviated flags, a
quoted --rdzv-conf, and the variables workers get. Where marked, the same command runs under
both launchers side by side (``LAUNCHERS``)."""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from types import SimpleNamespace

import pytest
from agent_nodes import agents, free_port, until
from paths import program

# The module each launcher runs as: ours, and torch 2.13's torchrun as the reference.
LAUNCHERS = {"elasticstore-run": "elasticstore.run", "torchrun": "torch.distributed.run"}


def _released(workdir: str) -> None:
    """Workers stop after their first all_reduce step."""
    open(os.path.join(workdir, "release"), "w").close()


def test_multi_node_without_rdzv_backend_runs_static_on_master_addr_and_port(tmp_path: object) -> None:
    port = free_port("127.0.0.2")
    with agents(str(tmp_path)) as a:
        _released(a.dir)
        nodes = []
        for rank, addr in ((0, "127.0.0.2"), (1, "127.0.0.3")):
            flags = ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(rank),
                     "--master-addr", "127.0.0.2", "--master-port", str(port), "--local-addr", addr]
            nodes.append(a.start(flags, name=f"n{rank}"))
        for node in nodes:
            assert a.wait(node, 240) == 0, a.output(node)
        starts = sorted(a.starts(), key=lambda s: s["rank"])
    assert [s["rank"] for s in starts] == [0, 1, 2, 3]
    for s in starts:
        env = s["env"]
        assert (env["WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("4", "2"), env
        assert env["GROUP_RANK"] == str(s["rank"] // 2), env
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.2", str(port)), env
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True", env
    assert "rendezvous static at 127.0.0.2:%d" % port in a.output(nodes[0])


def test_master_port_on_one_node_is_the_store_workers_reach(tmp_path: object) -> None:
    # torch's launcher test: init_method=tcp://localhost:<the --master-port it passed>.
    port = free_port("127.0.0.1")
    with agents(str(tmp_path)) as a:
        _released(a.dir)
        flags = ["--nnodes=1", "--nproc-per-node=2", "--master-addr=localhost",
                 f"--master-port={port}", "--monitor-interval=1", "--local-addr", "127.0.0.2"]
        agent = a.start(flags, ["--dir", a.dir, "--init-method", f"tcp://localhost:{port}"])
        assert a.wait(agent, 240) == 0, a.output(agent)
        starts = a.starts()
        assert sorted(a.inits(0)) == [0, 1], a.output(agent)
    for s in starts:
        assert (s["env"]["MASTER_ADDR"], s["env"]["MASTER_PORT"]) == ("localhost", str(port)), s["env"]


def test_abbreviated_flags_quoted_rdzv_conf_and_signals_to_handle(tmp_path: object) -> None:
    port = free_port("127.0.0.2")
    logs = os.path.join(str(tmp_path), "logs")
    with agents(str(tmp_path)) as a:
        _released(a.dir)
        # One node of 1:2: the round forms only through last_call_timeout=1 from the quoted value.
        flags = ["--nnodes", "1:2", "--nproc-per", "1", "--rdzv-endpoint", f"127.0.0.2:{port}",
                 "--rdzv-id", "quoted", "--local-addr", "127.0.0.2", "--log-dir", logs,
                 "--redirect", "1", "--max-restart", "0", "--signals-to-handle", "SIGTERM,SIGUSR1",
                 "--rdzv-conf", "'join_timeout=120,last_call_timeout=\"1\",timeout=5'"]
        agent = a.start(flags)
        assert a.wait(agent, 240) == 0, a.output(agent)
        (start,) = a.starts()
    assert start["env"]["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1", start["env"]
    with open(os.path.join(logs, "quoted", "attempt_0", "0", "stdout.log")) as f:
        assert f.read() == "rank 0 done at world size 1\n"


def _probes(workdir: str) -> dict[int, dict[str, object]]:
    found = {}
    for path in glob.glob(os.path.join(workdir, "probe-*.json")):
        with open(path) as f:
            info = json.load(f)
        found[int(info["env"]["RANK"])] = info
    return found


@pytest.mark.slow  # ~5-10 s per launcher
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_one_node_command_of_torch_users_side_by_side(tmp_path: object, launcher: str) -> None:
    """torchtitan's localhost:0, torch's c10d --rdzv-conf keys, ${local_rank} in the arguments,
    PYTHON_EXEC, LOGLEVEL and --virtual-local-rank: one command, both launchers, same result."""
    marker = os.path.join(str(tmp_path), "python-exec")
    wrapper = os.path.join(str(tmp_path), "py")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\necho "$@" >> {marker}\nexec {sys.executable} "$@"\n')
    os.chmod(wrapper, 0o755)
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--nproc-per-node", "2",
             "--rdzv-conf", "read_timeout=30,keep_alive_interval=2,keep_alive_max_attempt=3,store_type=tcp",
             "--virtual-local-rank"]
    env = {"PYTHON_EXEC": wrapper, "LOGLEVEL": "INFO", "CUDA_VISIBLE_DEVICES": "5,7"}
    with agents(str(tmp_path)) as a:
        agent = a.start(flags, ["--dir", a.dir, "--tag=lr${local_rank}", "$$x"], env=env,
                        script=program("warm_probe.py"), module=LAUNCHERS[launcher])
        assert a.wait(agent, 240) == 0, a.output(agent)
        out = a.output(agent)
    probes = _probes(str(tmp_path))
    assert sorted(probes) == [0, 1], out
    for rank, info in probes.items():
        env_seen: dict[str, str] = info["env"]  # type: ignore[assignment]
        assert info["argv"][-2:] == [f"--tag=lr{rank}", "$x"], info["argv"]  # type: ignore[index]
        assert (env_seen["LOCAL_RANK"], env_seen["CUDA_VISIBLE_DEVICES"]) == ("0", "57"[rank])
        assert env_seen["TORCHELASTIC_RESTART_COUNT"] == "0"
    with open(marker) as f:  # every worker started by PYTHON_EXEC
        assert sorted(line.split()[-2] for line in f) == ["--tag=lr0", "--tag=lr1"]
    # LOGLEVEL=INFO: the launcher's INFO records are shown (torch's glog-style lines, ours named).
    info_line = r"^I\d{4} " if launcher == "torchrun" else r"^\[elasticstore-run\] INFO elasticstore\."
    assert re.search(info_line, out, re.M), out


@pytest.mark.slow  # ~10-20 s per launcher
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_node_rank_with_rdzv_endpoint_and_no_backend_side_by_side(tmp_path: object, launcher: str) -> None:
    """torchrun's default backend is static: --node-rank with --rdzv-endpoint is each node's rank
    (node rank 0 hosts the store at the endpoint), whatever the order the nodes start in."""
    port = free_port("127.0.0.2")
    with agents(str(tmp_path)) as a:
        _released(a.dir)
        nodes = []
        for rank, addr in ((1, "127.0.0.3"), (0, "127.0.0.2")):  # node rank 1 first
            flags = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.2:{port}",
                     "--node-rank", str(rank), "--local-addr", addr]
            nodes.append(a.start(flags, name=f"n{rank}", module=LAUNCHERS[launcher],
                                 env={"ELASTICSTORE_TEST_NODE": str(rank)}))
            if rank == 1:
                until(lambda: "static" in a.output(nodes[0]) or launcher == "torchrun", 60, "node 1 up")
        for node in nodes:
            assert a.wait(node, 240) == 0, a.output(node)
        starts = a.starts()
    assert sorted((s["env"]["ELASTICSTORE_TEST_NODE"], s["env"]["GROUP_RANK"], s["rank"]) for s in starts) == [
        ("0", "0", 0), ("1", "1", 1)]


@pytest.mark.slow  # ~20-30 s per launcher
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_restart_count_stays_0_when_a_node_joins_side_by_side(tmp_path: object, launcher: str) -> None:
    """TORCHELASTIC_RESTART_COUNT counts restarts after failures: a node joining (the group
    restarted for a membership change) leaves it 0, as torchrun's agent does. torchrun runs
    torch's agent on our rendezvous (its plugin): with torch's c10d backend the grown round
    did not form within minutes on a loaded 2-core machine."""
    port = free_port("127.0.0.2")
    with agents(str(tmp_path)) as a:
        flags = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "elasticstore",
                 "--rdzv-endpoint", f"127.0.0.2:{port}", "--rdzv-id", "grow",
                 "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "2"]
        first = a.start([*flags, "--local-addr", "127.0.0.2"], name="n1", module=LAUNCHERS[launcher])
        until(lambda: a.inits(), 120, "the first node's worker past init_process_group")
        second = a.start([*flags, "--local-addr", "127.0.0.3"], name="n2", module=LAUNCHERS[launcher])
        until(lambda: len({s["rank"] for s in a.starts() if s["world"] == 2}) == 2, 120,
              "both workers of the grown round")
        a.release()
        for node in (first, second):
            assert a.wait(node, 120) == 0, a.output(node)
        grown = [s for s in a.starts() if s["world"] == 2]
    assert sorted(s["rank"] for s in grown) == [0, 1]
    for s in grown:
        assert s["env"]["TORCHELASTIC_RESTART_COUNT"] == "0", s["env"]
        if launcher == "elasticstore-run":
            assert s["env"]["ELASTICSTORE_ATTEMPT"] == "1", s["env"]  # the round still counts


def test_worker_command_and_environment_as_torchs_agent() -> None:
    """``${local_rank}`` (torch's macros.substitute) and --virtual-local-rank (torch's agent's
    _set_local_rank_env), checked against torch's own functions."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.utils.api import macros

    from elasticstore.agent.config import AgentSettings
    from elasticstore.agent.envs import worker_argv, worker_env

    args = ("--out=/x/${local_rank}/$local_rank", "$${local_rank}", "$HOME", "${other}")
    for kind, warm in (("script", True), ("script", False), ("exec", False), ("module", False)):
        s = AgentSettings(entrypoint="t${local_rank}.py", args=args, nproc=2, run_id="r", host="h",
                          kind=kind, warm=warm)
        for local in (0, 1):
            argv, _ = worker_argv(s, local)
            theirs = macros.substitute([s.entrypoint, *args], str(local))
            if kind == "exec":  # torchrun's --no-python: the entrypoint is the command, as given
                theirs[0] = s.entrypoint
            assert argv[-len(theirs):] == theirs, (kind, argv)
    info = SimpleNamespace(bootstrap_store_info=None, rank=0, world_size=1)
    s = AgentSettings(entrypoint="t.py", args=(), nproc=2, run_id="r", host="h", virtual_local_rank=True)
    for visible in (None, "3,6"):
        old = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        try:
            if visible is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
            for local in (0, 1):
                ours = worker_env(s, info, True, 0, local, local, 2, "/e")  # type: ignore[arg-type]
                theirs: dict[str, str | None] = {}
                LocalElasticAgent._set_local_rank_env(None, theirs, local,  # type: ignore[arg-type]
                                                      SimpleNamespace(virtual_local_rank=True))
                assert {k: ours[k] for k in theirs} == theirs
        finally:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            if old is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = old


@pytest.mark.slow  # ~8-15 s per launcher
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_duplicate_filters_side_by_side(tmp_path: object, launcher: str) -> None:
    """--duplicate-std{out,err}-filters: the teed ranks' matching lines, prefixed as on the
    console, in the attempt's filtered_std{out,err}.log (``,,`` is a comma in a filter)."""
    logs = os.path.join(str(tmp_path), "logs")
    script = os.path.join(str(tmp_path), "emit.py")
    with open(script, "w") as f:
        f.write("import os, sys\nr = os.environ['LOCAL_RANK']\n"
                "print(f'apple {r}'); print('banana'); print('kiwi,lime')\n"
                "print(f'cherry {r}', file=sys.stderr); print('plum', file=sys.stderr)\n")
    flags = ["--nproc-per-node", "2", "-t", "3", "--log-dir", logs, "--duplicate-stdout-filters",
             "apple,i,,l", "--duplicate-stderr-filters", "cherry"]
    with agents(str(tmp_path)) as a:
        agent = a.start(flags, [], script=script, module=LAUNCHERS[launcher])
        assert a.wait(agent, 240) == 0, a.output(agent)
    found = {}
    for stream in ("stdout", "stderr"):
        (path,) = glob.glob(os.path.join(logs, "*", "attempt_0", f"filtered_{stream}.log"))
        with open(path) as f:
            found[stream] = sorted(f.read().splitlines())
    assert found == {"stdout": ["[default0]:apple 0", "[default0]:kiwi,lime", "[default1]:apple 1",
                                "[default1]:kiwi,lime"],
                     "stderr": ["[default0]:cherry 0", "[default1]:cherry 1"]}, found
