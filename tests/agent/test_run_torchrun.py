"""torchrun command lines that elasticstore-run runs as torchrun does (real launcher, real
workers): the default static rendezvous on --master-addr/--master-port, abbreviated flags, a
quoted --rdzv-conf, and the variables workers get."""

from __future__ import annotations

import os

from agent_nodes import agents, free_port


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
