"""Slurm's environment read into the launcher's settings (``schedulers/``), as tables: the host
list syntax, what a job step gives, and that every flag (or ``PET_<FLAG>``) wins."""

from __future__ import annotations

import pytest

from elasticstore.run import UsageError, parse
from elasticstore.schedulers.hostlist import HostListError, expand

EXPANDED = [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-3,5],gpu[01-02]", ["n1", "n2", "n3", "n5", "gpu01", "gpu02"]),
    ("node[08-10]", ["node08", "node09", "node10"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("a,b[7],c", ["a", "b7", "c"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("rack[1-2]-gpu[001-002]", ["rack1-gpu001", "rack1-gpu002", "rack2-gpu001", "rack2-gpu002"]),
    ("n-[0-1].cluster", ["n-0.cluster", "n-1.cluster"]),
    (" n[1-2] ", ["n1", "n2"]),
]


@pytest.mark.parametrize(("text", "hosts"), EXPANDED, ids=[t for t, _ in EXPANDED])
def test_hostlist_expands_as_scontrol_show_hostnames(text: str, hosts: list[str]) -> None:
    assert expand(text) == hosts


@pytest.mark.parametrize("text", ["", "(null)", "n[1-3", "n1-3]", "n[[1]]", "n[3-1]", "n[a-b]",
                                  "n[1-]", "n[]", "a,,b", "n[1-99999999]"])
def test_hostlist_refuses_what_slurm_never_writes(text: str) -> None:
    with pytest.raises(HostListError, match="host list"):
        expand(text)


STEP = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost,n[2-3]",
        "SLURM_JOB_NODELIST": "localhost,n[2-4]", "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_NUM_TASKS": "3", "SLURMD_NODENAME": "localhost"}
ENDPOINT = "localhost:29634,n2:29634,n3:29634"  # port 29400 + job id % 1000


ALL = ("--rdzv-id", "--nnodes", "--rdzv-endpoint", "--local-addr")
# (flags, extra environment) -> (nnodes, run id, endpoint, local addr, backend), flags taken
CASES = [
    ([], {}, ("3:3", "1234", ENDPOINT, "127.0.0.1", "elasticstore"), ALL),
    (["--nnodes", "2:3"], {}, ("2:3", "1234", ENDPOINT, "127.0.0.1", "elasticstore"), ALL[:1] + ALL[2:]),
    (["--nnodes=2"], {}, ("2:2", "1234", ENDPOINT, "127.0.0.1", "elasticstore"), ALL[:1] + ALL[2:]),
    (["--rdzv-id", "mine", "--rdzv_endpoint", "h:1"], {},
     ("3:3", "mine", "h:1", "127.0.0.1", "elasticstore"), ("--nnodes", "--local-addr")),
    (["--local-addr", "127.0.0.2"], {}, ("3:3", "1234", ENDPOINT, "127.0.0.2", "elasticstore"), ALL[:3]),
    ([], {"PET_NNODES": "1:3", "PET_RDZV_ID": "pet"},
     ("1:3", "pet", ENDPOINT, "127.0.0.1", "elasticstore"), ALL[2:]),
    ([], {"SLURM_JOB_ID": "99"},
     ("3:3", "99", ENDPOINT.replace("29634", "29499"), "127.0.0.1", "elasticstore"), ALL),
    # torchrun's usual glue (static, by node rank): Slurm is not read at all
    (["--nnodes", "3", "--node-rank", "1", "--master-addr", "h", "--master-port", "5"], {},
     ("3:3", "none", "h:5", None, "static"), ()),
    # etcd's endpoint is not a job's node: not offered
    (["--rdzv-backend", "etcd", "--rdzv-endpoint", "e:2379"], {},
     ("3:3", "1234", "e:2379", None, "etcd"), ("--rdzv-id", "--nnodes")),
    # the batch script itself (no step): this node only
    ([], {"SLURM_STEP_ID": ""}, ("1:1", "1234", None, "127.0.0.1", "elasticstore"), ALL[:2]),
    # a name that does not resolve: no --local-addr (a notice says so)
    ([], {"SLURMD_NODENAME": "no-such-host.invalid"},
     ("3:3", "1234", ENDPOINT, None, "elasticstore"), ALL[:3]),
    # not a Slurm job: nothing read
    ([], {"SLURM_JOB_ID": ""}, ("1:1", "none", None, "127.0.0.1", "elasticstore"), ()),
]


@pytest.mark.parametrize(("flags", "env", "want", "taken"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_slurm_environment_gives_the_flags_left_out(flags: list[str], env: dict[str, str],
                                                   want: tuple[object, ...], taken: tuple[str, ...]) -> None:
    rs = parse([*flags, "--nproc-per-node", "1", "train.py"], {**STEP, **env})
    nnodes, run_id, endpoint, local_addr, backend = want
    assert f"{rs.min_nodes}:{rs.max_nodes}" == nnodes
    if run_id != "none":
        assert rs.agent.run_id == run_id
    if endpoint is not None:
        assert rs.endpoint == endpoint
    assert rs.local_addr == local_addr
    assert rs.backend == backend
    banner = [n for n in rs.notices if n.startswith("from Slurm")]
    if not taken:
        assert banner == []
        return
    assert len(banner) == 1, rs.notices  # the banner says what it took from Slurm
    assert [f for f in ALL if f + " " in banner[0]] == list(taken), banner


def test_batch_script_of_several_nodes_says_how_to_run_on_all() -> None:
    rs = parse(["train.py"], {**STEP, "SLURM_STEP_ID": ""})
    assert any("srun --ntasks-per-node=1" in n for n in rs.notices), rs.notices


@pytest.mark.parametrize(("env", "variable"), [
    ({"SLURM_STEP_NUM_TASKS": "6"}, "SLURM_STEP_NUM_TASKS"),  # srun -N3 -n6: two agents a node
    ({"SLURM_STEP_NODELIST": "n[1-"}, "SLURM_STEP_NODELIST"),
    ({"SLURM_STEP_NUM_NODES": "2"}, "SLURM_STEP_NUM_NODES"),
])
def test_a_step_that_does_not_fit_is_refused_naming_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(UsageError, match=variable):
        parse(["train.py"], {**STEP, **env})


def test_several_tasks_a_node_are_taken_when_nnodes_is_given() -> None:
    rs = parse(["--nnodes", "6", "train.py"], {**STEP, "SLURM_STEP_NUM_TASKS": "6"})
    assert (rs.min_nodes, rs.max_nodes) == (6, 6)
