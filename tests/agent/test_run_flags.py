"""elasticstore-run's flags: torchrun's defaults, both spellings, PET_* fallback, refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from elasticstore.run import UsageError, parse

EP = ["--rdzv-endpoint", "127.0.0.1:29400"]


def test_torchrun_defaults() -> None:
    rs = parse(["train.py"], {})
    a = rs.agent
    assert (rs.min_nodes, rs.max_nodes, a.nproc, a.max_restarts) == (1, 1, 1, 0)
    assert (a.monitor_interval, a.role, a.shutdown_timeout, a.kind) == (0.1, "default", 30.0, "script")
    assert a.signals == tuple(int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT))
    assert rs.backend == "elasticstore" and a.warm and a.args == ()
    assert dict(a.extra_env) == {}  # one worker: OMP_NUM_THREADS untouched


def test_dashed_and_underscored_spellings_and_script_args() -> None:
    for flag in ("--nproc-per-node", "--nproc_per_node"):
        rs = parse([flag, "3", "--max_restarts=2", "--nnodes", "1:4", *EP, "t.py", "--lr", "1"], {})
        assert rs.agent.nproc == 3 and rs.agent.max_restarts == 2
        assert (rs.min_nodes, rs.max_nodes) == (1, 4) and rs.agent.args == ("--lr", "1")
    assert dict(rs.agent.extra_env) == {"OMP_NUM_THREADS": "1"}
    assert dict(parse(["--nproc-per-node", "2", "t.py"], {"OMP_NUM_THREADS": "4"}).agent.extra_env) == {}


def test_pet_environment_fallback_and_flag_precedence() -> None:
    env = {"PET_NPROC_PER_NODE": "4", "PET_NNODES": "2", "PET_RDZV_ENDPOINT": "10.0.0.1:1234",
           "PET_MAX_RESTARTS": "5", "PET_MODULE": "1", "PET_RDZV_CONF": "join_timeout=9"}
    rs = parse(["pkg.mod"], env)
    assert (rs.agent.nproc, rs.min_nodes, rs.endpoint, rs.agent.max_restarts) == (4, 2, "10.0.0.1:1234", 5)
    assert rs.agent.kind == "module" and dict(rs.rdzv_conf) == {"join_timeout": "9"}
    assert parse(["--nproc-per-node", "2", "pkg.mod"], env).agent.nproc == 2
    assert parse(["t.py"], {"PET_STANDALONE": "1"}).backend == "elasticstore"


def test_backends_and_their_notices() -> None:
    assert parse(["--rdzv-backend", "c10d", *EP, "t.py"], {}).notices[0].startswith("--rdzv-backend c10d")
    rs = parse(["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "127.0.0.1:2379", "t.py"], {})
    assert rs.backend == "etcd" and "etcd v3" in rs.notices[0]
    st = parse(["--rdzv-backend", "static", "--nnodes", "2", "--node-rank", "1", "t.py"], {})
    assert st.endpoint == "127.0.0.1:29500" and dict(st.rdzv_conf)["rank"] == "1"
    sa = parse(["--standalone", "--rdzv-id", "x", "t.py"], {})
    assert sa.endpoint.startswith("127.0.0.1:") and sa.agent.run_id != "x"


def test_start_methods_and_output_flags() -> None:
    assert not parse(["--start-method", "spawn", "t.py"], {}).agent.warm
    rs = parse(["--no-python", "--nproc-per-node", "2", "-r", "3", "-t", "0:1,1:2",
                "--local-ranks-filter", "0", "./a.out"], {})
    assert rs.agent.kind == "exec" and not rs.agent.warm
    assert rs.agent.redirects == {0: 3, 1: 3} and rs.agent.tee == {0: 1, 1: 2}
    assert rs.agent.local_ranks_filter == frozenset({0})


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--nnodes", "3:2", *EP, "t.py"], "--nnodes"),
        (["--nnodes", "x", "t.py"], "--nnodes"),
        (["--nproc-per-node", "many", "t.py"], "--nproc-per-node"),
        (["--nproc-per-node", "0", "t.py"], "--nproc-per-node"),
        (["--rdzv-backend", "zookeeper", "t.py"], "--rdzv-backend"),
        (["--max-restarts", "-1", "t.py"], "--max-restarts"),
        (["--monitor-interval", "0", "t.py"], "--monitor-interval"),
        (["--redirects", "7", "t.py"], "--redirects"),
        (["--start-method", "thread", "t.py"], "--start-method"),
        (["--signals-to-handle", "SIGNOPE", "t.py"], "--signals-to-handle"),
        (["--nnodes", "1:2", "t.py"], "--rdzv-endpoint"),
        (["--nnodes", "2", "--node-rank", "2", "t.py"], "--node-rank"),
        (["--rdzv-conf", "'=5'", "t.py"], "--rdzv-conf"),
        (["--rdzv-backend", "static", "--nnodes", "2", "--node-rank", "2", "t.py"], "--node-rank"),
        (["--rdzv-conf", "novalue", "t.py"], "--rdzv-conf"),
        (["--logs-specs", "x", "t.py"], "--logs-specs"),
        (["--numa-binding", "bogus", "t.py"], "--numa-binding"),
        (["--rdzv-endpoint", "localhost:0", "--nnodes", "2", "t.py"], "--rdzv-endpoint"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "localhost:0", "t.py"], "--rdzv-endpoint"),
        (["--rdzv-endpoint", "h:1", "--node-rank", "1", "--nnodes", "1:2", "t.py"], "--nnodes"),
        (["--nproc-per-node", "xpu", "t.py"], "--nproc-per-node"),
        (["--event-log-handler", "bogus", "t.py"], "--event-log-handler"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(UsageError, match=f"^{flag}: "):
        parse(argv, {})


def test_bad_flag_exits_2_with_one_line() -> None:
    for argv in (["--nnodes", "3:2", "t.py"], ["--logs-specs", "x", "t.py"]):
        proc = subprocess.run([sys.executable, "-m", "elasticstore.run", *argv],
                              capture_output=True, text=True, timeout=60, env=dict(os.environ))
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and argv[0] in lines[0], proc.stderr


@pytest.mark.parametrize(
    "conf, key, why",
    [
        ("join_timeout=soon", "join_timeout", "not a number of seconds"),
        ("last_call_timeout=-1", "last_call_timeout", "positive"),
        ("is_host=maybe", "is_host", "not a boolean"),
        ("bogus_key=1", "bogus_key", "unknown key"),
        ("protocol=https", "protocol", "needs cacert"),
        ("token_file=/nonexistent/elasticstore-token", "token_file", "No such file"),
    ],
)
def test_bad_rdzv_conf_is_a_usage_error_naming_the_key(conf: str, key: str, why: str) -> None:
    with pytest.raises(UsageError, match="^--rdzv-conf: ") as err:
        parse(["--rdzv-conf", conf, "--nnodes", "2", *EP, "t.py"], {})
    assert key in str(err.value) and why in str(err.value)
    with pytest.raises(UsageError, match=f"^--rdzv-conf: .*{key}"):
        parse(["--nnodes", "2", *EP, "t.py"], {"PET_RDZV_CONF": conf})


def test_bad_rdzv_conf_exits_2_before_the_banner() -> None:
    argv = ["--nnodes", "2", *EP, "--rdzv-conf", "join_timeout=soon", "t.py"]
    proc = subprocess.run([sys.executable, "-m", "elasticstore.run", *argv],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--rdzv-conf" in lines[0] and "join_timeout" in lines[0], proc.stderr


def test_rdzv_conf_parsed_into_the_settings_once() -> None:
    rs = parse(["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1", "--rdzv-conf",
                "join_timeout=7,is_host=0", "t.py"], {})
    r = rs.rendezvous
    assert (r.host, r.port, r.join_timeout, r.is_host, r.min_nodes) == ("10.0.0.1", 29400, 7.0, False, 2)
    etcd = parse(["--rdzv-backend", "etcd", "--nnodes", "2", "--rdzv-endpoint", "h1:1,h2:2", "t.py"], {})
    assert (etcd.rendezvous.host, etcd.rendezvous.port, etcd.rendezvous.endpoints) == ("h1", 1, ("h1:1", "h2:2"))
    assert parse(["--nnodes", "2", "--rdzv-endpoint", "[::1]", "--rdzv-backend", "etcd", "t.py"],
                 {}).rendezvous.port == 2379
    static = parse(["--nnodes", "2", "--node-rank", "1", "t.py"], {}).rendezvous
    assert (static.rank, static.host, static.port) == (1, "127.0.0.1", 29500)


def test_legacy_launch_flags() -> None:
    assert parse(["t.py"], {}, legacy=True).agent.legacy_local_rank_arg
    assert not parse(["--use-env", "t.py"], {}, legacy=True).agent.legacy_local_rank_arg
    assert not parse(["--use_env", "t.py"], {}, legacy=True).agent.legacy_local_rank_arg
    assert not parse(["t.py"], {"PET_USE_ENV": "1"}, legacy=True).agent.legacy_local_rank_arg


def test_torchrun_default_backend_for_the_command_line() -> None:
    st = parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                "--master-port", "1234", "t.py"], {})
    assert (st.backend, st.endpoint, dict(st.rdzv_conf)["rank"]) == ("static", "10.0.0.1:1234", "1")
    assert parse(["--nnodes", "2", "t.py"], {}).endpoint == "127.0.0.1:29500"
    one = parse(["--master-addr", "localhost", "--master-port", "1234", "t.py"], {})
    assert (one.backend, one.endpoint) == ("static", "localhost:1234")
    assert parse(["t.py"], {}).backend == "elasticstore"  # standalone, as torchrun's c10d there
    assert parse(["--nnodes", "2", *EP, "t.py"], {}).backend == "elasticstore"
    assert parse(["--rdzv-backend", "c10d", "--nnodes", "2", *EP, "t.py"], {}).backend == "elasticstore"


def test_abbreviated_long_flags_as_torchrun() -> None:
    rs = parse(["--nproc-per", "2", "--redirect", "3", "--max-restart", "4", "t.py"], {})
    assert (rs.agent.nproc, rs.agent.redirects, rs.agent.max_restarts) == (2, {0: 3, 1: 3}, 4)
    with pytest.raises(UsageError, match="ambiguous option: --monitor could match --monitor-interval"):
        parse(["--monitor", "1", "t.py"], {})


def test_quoted_rdzv_conf() -> None:
    for text in ("'join_timeout=5,last_call_timeout=1,timeout=5'",
                 "\"'join_timeout=5,last_call_timeout=1,timeout=5'\"",
                 'join_timeout="5",last_call_timeout=\'1\',timeout=5'):
        rs = parse(["--rdzv-conf", text, *EP, "t.py"], {})
        assert dict(rs.rdzv_conf) == {"join_timeout": "5", "last_call_timeout": "1", "timeout": "5"}


def test_quotes_left_in_by_torchs_rdzv_conf_parser() -> None:
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    from elasticstore.rendezvous.settings import RendezvousSettings

    for text in ("'join_timeout=5,last_call_timeout=1,timeout=5'", 'join_timeout="5",last_call_timeout=1'):
        s = RendezvousSettings.from_config(run_id="r", endpoint="127.0.0.1:1", min_nodes=1,
                                           max_nodes=1, local_addr=None,
                                           config=_parse_rendezvous_config(text))
        assert (s.join_timeout, s.last_call_timeout) == (5.0, 1.0)


def test_heartbeat_timeouts() -> None:
    a = parse(["t.py"]).agent
    assert (a.heartbeat_timeout, a.first_heartbeat_timeout) == (600.0, 1800.0)
    a = parse(["--heartbeat-timeout", "3", "--first_heartbeat_timeout", "0", "t.py"]).agent
    assert (a.heartbeat_timeout, a.first_heartbeat_timeout) == (3.0, None)
    a = parse(["--heartbeat-t", "7", "t.py"], {"PET_FIRST_HEARTBEAT_TIMEOUT": "60"}).agent
    assert (a.heartbeat_timeout, a.first_heartbeat_timeout) == (7.0, 60.0)
    for bad in ("-1", "x", "nan"):
        with pytest.raises(UsageError, match="--heartbeat-timeout"):
            parse(["--heartbeat-timeout", bad, "t.py"])


def test_rdzv_endpoint_port_0_is_a_free_port_hosted_here_on_one_node() -> None:
    # torchrun --rdzv-endpoint localhost:0 (torchtitan's run script): one node, any free port.
    for backend in ([], ["--rdzv-backend", "c10d"], ["--rdzv-backend", "static"]):
        rs = parse([*backend, "--rdzv-endpoint", "localhost:0", "t.py"], {})
        host, _, port = rs.endpoint.rpartition(":")
        assert host == "localhost" and int(port) > 0 and rs.rendezvous.port == int(port), rs.endpoint
        assert rs.backend == "static" or rs.rendezvous.is_host
    with pytest.raises(UsageError, match="port 0 .* needs --nnodes 1"):
        parse(["--rdzv-endpoint", "localhost:0", "--nnodes", "1:2", "t.py"], {})


def test_node_rank_with_rdzv_endpoint_and_no_backend_is_torchruns_static() -> None:
    # torchrun's --rdzv-backend defaults to static: the endpoint is node rank 0's store.
    for argv, env in ((["--node-rank", "1"], {}), ([], {"PET_NODE_RANK": "1"})):
        rs = parse(["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:1234", *argv, "t.py"], env)
        assert (rs.backend, rs.endpoint, rs.rendezvous.rank) == ("static", "10.0.0.1:1234", 1)
    # Without --node-rank every torchrun node would be rank 0: ours, ranks by arrival.
    assert parse(["--nnodes", "2", *EP, "t.py"], {}).backend == "elasticstore"
    # A backend that cannot take it: said, never silently dropped (torchrun warns too).
    rs = parse(["--rdzv-backend", "c10d", "--nnodes", "2", *EP, "--node-rank", "1", "t.py"], {})
    assert any(n.startswith("--node-rank 1: ignored") for n in rs.notices), rs.notices


def test_torchs_rdzv_conf_keys_are_mapped_or_noticed() -> None:
    conf = "read_timeout=7,keep_alive_interval=2,keep_alive_max_attempt=4,store_type=tcp,heartbeat_timeout=9"
    rs = parse(["--rdzv-backend", "c10d", "--nnodes", "2", *EP, "--rdzv-conf", conf, "t.py"], {})
    assert (rs.rendezvous.store_timeout, rs.rendezvous.lease_ttl) == (7.0, 8.0)
    assert [n.split(":")[0] for n in rs.notices[1:]] == ["--rdzv-conf heartbeat_timeout",
                                                          "--rdzv-conf store_type=tcp"]
    assert parse(["--nnodes", "2", *EP, "--rdzv-conf", "keep_alive_interval=3", "t.py"],
                 {}).rendezvous.lease_ttl == 9.0  # torch's default of 3 attempts
    etcd = parse(["--rdzv-backend", "etcd-v2", "--nnodes", "2", "--rdzv-endpoint", "h:2379",
                  "--rdzv-conf", "protocol=https,ca_cert=/ca,ssl_cert=/c,ssl_cert_key=/k", "t.py"], {})
    assert (etcd.rendezvous.cacert, etcd.rendezvous.cert, etcd.rendezvous.key) == ("/ca", "/c", "/k")
    for bad, why in (("store_type=file", "FileStore"), ("read_timeout=1,store_timeout=2", "twice"),
                     ("keep_alive_max_attempt=0", "positive integer"),
                     ("keep_alive_interval=5,lease_ttl=3", "twice")):
        with pytest.raises(UsageError, match=f"^--rdzv-conf: .*{why}"):
            parse(["--nnodes", "2", *EP, "--rdzv-conf", bad, "t.py"], {})


def test_nproc_per_node_names_as_torchruns() -> None:
    from torch.distributed.run import determine_local_world_size

    for name in ("auto", "cpu"):
        assert parse(["--nproc-per-node", name, "t.py"], {}).agent.nproc == determine_local_world_size(name)
    with pytest.raises(ValueError, match="Xpu is not available"):
        determine_local_world_size("xpu")
    with pytest.raises(UsageError, match="^--nproc-per-node: xpu: XPU is not available"):
        parse(["--nproc-per-node", "xpu", "t.py"], {})


def test_nproc_per_node_custom_device_and_auto_on_any_accelerator() -> None:
    # A custom device (torch's PrivateUse1, renamed): torchrun counts its devices; auto counts
    # torch.accelerator's. In a process of its own: the rename cannot be undone.
    code = """
import torch
from torch.distributed.run import determine_local_world_size
from elasticstore.run import parse
class Fake:
    @staticmethod
    def is_available(): return True
    @staticmethod
    def device_count(): return 3
torch.utils.rename_privateuse1_backend("fakedev")
torch._register_device_module("fakedev", Fake)
print(determine_local_world_size("fakedev"), parse(["--nproc-per-node", "fakedev", "t.py"], {}).agent.nproc)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3", "3"], proc.stdout


def test_torchrun_only_flags_and_their_pet_variables_are_never_ignored() -> None:
    # --logs-specs names a torchrun.logs_specs entry point (test_logs_specs.py); PET_ too
    with pytest.raises(UsageError, match="^--logs-specs: 'x': no entry point of that name"):
        parse(["t.py"], {"PET_LOGS_SPECS": "x"})
    assert parse(["t.py"], {"PET_DUPLICATE_STDERR_FILTERS": "a,,b,c"}).agent.duplicate_filters == {
        "stderr": ("a,b", "c")}
    # torch has no PET_NUMA_BINDING; here it is the flag's, as every other PET_ variable
    with pytest.raises(UsageError, match="^--numa-binding: socket: needs CUDA devices"):
        parse(["t.py"], {"PET_NUMA_BINDING": "socket"})
    assert parse(["t.py"], {"PET_VIRTUAL_LOCAL_RANK": "1"}).agent.virtual_local_rank
    assert parse(["--virtual-local-rank", "t.py"], {}).agent.virtual_local_rank
    with pytest.raises(UsageError, match="^--virtual-local-rank: 2 workers but CUDA_VISIBLE_DEVICES=3"):
        parse(["--virtual-local-rank", "--nproc-per-node", "2", "t.py"], {"CUDA_VISIBLE_DEVICES": "3"})
    # --numa-binding places rank i near CUDA device i: refused with the reason where there is none.
    with pytest.raises(UsageError, match="^--numa-binding: node: needs CUDA devices"):
        parse(["--numa-binding", "node", "t.py"], {})


def test_python_exec_and_loglevel() -> None:
    rs = parse(["t.py"], {"PYTHON_EXEC": "/opt/py/bin/python3"})
    assert rs.agent.python == "/opt/py/bin/python3" and not rs.agent.warm
    assert any(n.startswith("PYTHON_EXEC=/opt/py/bin/python3: workers start as plain") for n in rs.notices)
    assert parse(["t.py"], {"PYTHON_EXEC": sys.executable}).agent.warm  # the same interpreter
    assert parse(["t.py"], {"LOGLEVEL": "info"}).log_level == 20
    assert parse(["t.py"], {}).log_level is None
    with pytest.raises(UsageError, match="^LOGLEVEL: 'LOUD'"):
        parse(["t.py"], {"LOGLEVEL": "LOUD"})


def test_fork_server_origin_is_parsed_once() -> None:
    """``ELASTICSTORE_FORK_SERVER``: ``forked`` (the default) or ``fresh``; anything else is a
    usage error naming the variable."""
    assert parse(["t.py"], {}).fork_server
    assert parse(["t.py"], {"ELASTICSTORE_FORK_SERVER": "Forked"}).fork_server
    assert not parse(["t.py"], {"ELASTICSTORE_FORK_SERVER": "fresh"}).fork_server
    with pytest.raises(UsageError, match="^ELASTICSTORE_FORK_SERVER: 'copy': expected 'forked' or 'fresh'"):
        parse(["t.py"], {"ELASTICSTORE_FORK_SERVER": "copy"})
