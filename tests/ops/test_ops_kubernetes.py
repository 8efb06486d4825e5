"""examples/kubernetes: every manifest parses, and the fields that wire them together (names,
ports, env, commands) agree with each other and with elasticstore-run's and elasticstore's flags.
The PET_* variables Kubeflow's training operator derives from ``elasticPolicy`` are rebuilt here
(its documented behaviour); nothing is run on a cluster."""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import pytest

from elasticstore import cli, run
from paths import ROOT

yaml = pytest.importorskip("yaml")
tomllib = pytest.importorskip("tomllib")  # Python 3.11+

DIR = os.path.join(ROOT, "examples", "kubernetes")


def docs() -> list[dict[str, Any]]:
    found = []
    for path in sorted(glob.glob(os.path.join(DIR, "*.yaml"))):
        with open(path) as f:
            found += [d for d in yaml.safe_load_all(f) if d]
    return found


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in docs() if d["kind"] == kind]


def scripts() -> set[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["project"]["scripts"]) | {"elasticstore-server"}


def operator_env(job: dict[str, Any]) -> dict[str, str]:
    """What Kubeflow sets from elasticPolicy, then the container's own env on top."""
    pol, name = job["spec"]["elasticPolicy"], job["metadata"]["name"]
    env = {"PET_RDZV_BACKEND": pol["rdzvBackend"], "PET_NNODES": f"{pol['minReplicas']}:{pol['maxReplicas']}",
           "PET_MAX_RESTARTS": str(pol["maxRestarts"]), "PET_NPROC_PER_NODE": str(pol["nProcPerNode"]),
           "PET_RDZV_ENDPOINT": f"{name}-worker-0:{pol.get('rdzvPort', 29400)}"}
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", "10.0.0.7")  # valueFrom: the pod's IP
    return env


def test_every_manifest_parses() -> None:
    kinds = sorted(d["kind"] for d in docs())
    assert kinds == ["ClusterTrainingRuntime", "PyTorchJob", "PyTorchJob", "Service", "Service",
                     "StatefulSet", "StatefulSet", "TrainJob"]


@pytest.mark.parametrize("job", by_kind("PyTorchJob"), ids=lambda j: j["metadata"]["name"])
def test_pytorchjob_wiring(job: dict[str, Any]) -> None:
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    (container,) = worker["template"]["spec"]["containers"]
    assert container["name"] == "pytorch"  # the training operator's convention
    assert container["command"][0] in scripts()
    pol = job["spec"]["elasticPolicy"]
    assert pol["minReplicas"] <= worker["replicas"] <= pol["maxReplicas"]
    env = operator_env(job)
    rs = run.parse(container["args"], env)
    assert rs.backend == run.BACKENDS[pol["rdzvBackend"]]
    assert (rs.min_nodes, rs.max_nodes) == (pol["minReplicas"], pol["maxReplicas"])
    assert rs.agent.nproc == pol["nProcPerNode"] and rs.agent.max_restarts == pol["maxRestarts"]
    assert rs.agent.run_id == job["metadata"]["name"] and rs.local_addr == "10.0.0.7"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert rs.agent.metrics_port == ports["metrics"] and rs.agent.metrics_addr == "0.0.0.0"
    if rs.backend == "elasticstore":
        assert rs.endpoint == f"{job['metadata']['name']}-worker-0:{ports['rdzv']}"
        assert pol["rdzvPort"] == ports["rdzv"]
    else:
        (etcd,) = [s for s in by_kind("StatefulSet") if s["metadata"]["name"] == "rdzv-etcd"]
        (svc,) = [s for s in by_kind("Service") if s["metadata"]["name"] == etcd["spec"]["serviceName"]]
        client = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "client")
        expected = [f"rdzv-etcd-{i}.{svc['metadata']['name']}:{client}"
                    for i in range(etcd["spec"]["replicas"])]
        assert rs.endpoint.split(",") == expected
        assert svc["spec"]["selector"] == etcd["spec"]["template"]["metadata"]["labels"]
        script = etcd["spec"]["template"]["spec"]["containers"][0]["args"][0]
        for i in range(etcd["spec"]["replicas"]):
            assert f"rdzv-etcd-{i}=http://rdzv-etcd-{i}.rdzv-etcd:2380" in script


def test_store_server_wiring() -> None:
    (sts,) = [s for s in by_kind("StatefulSet") if s["metadata"]["name"] == "elasticstore"]
    (svc,) = [s for s in by_kind("Service") if s["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert svc["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    server, exporter = sts["spec"]["template"]["spec"]["containers"]
    assert server["command"] == ["elasticstore-server"]
    args = dict(zip(server["args"][::2], server["args"][1::2]))
    # elasticstore-server takes the same core flags as `elasticstore server`.
    ns = cli._parser().parse_args(["server", *server["args"]])
    assert ns.host == "0.0.0.0" and ns.port == int(args["--port"])
    targets = {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}
    assert targets["store"] == ns.port == server["ports"][0]["containerPort"]
    assert server["readinessProbe"]["tcpSocket"]["port"] == ns.port
    assert exporter["command"] == ["elasticstore"]
    ms = cli._parser().parse_args(exporter["args"])
    assert ms.command == "metrics" and ms.addr == ("127.0.0.1", ns.port)
    assert targets["metrics"] == ms.metrics_port == exporter["ports"][0]["containerPort"]


# Kubeflow Trainer v2's torch plugin: the variables it gives the trainer's "node" container (and
# refuses in a TrainJob's own env), and the port it opens for the JobSet's headless Service.
TRAINER_PORT = 29500
TRAINER_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                    "PET_MASTER_PORT"}


def trainer_env(job: dict[str, Any], runtime: dict[str, Any]) -> dict[str, str]:
    """What the Trainer sets for node 1 of ``job``, then the TrainJob's own env on top."""
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    env = {"PET_NNODES": str(trainer.get("numNodes", runtime["spec"]["mlPolicy"]["numNodes"])),
           "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")), "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": str(TRAINER_PORT)}
    for item in trainer.get("env", []):
        env[item["name"]] = item.get("value", "10.0.0.7")  # valueFrom: the pod's IP
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in a container's command and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def test_trainjob_wiring() -> None:
    (job,) = by_kind("TrainJob")
    ref, trainer, name = job["spec"]["runtimeRef"], job["spec"]["trainer"], job["metadata"]["name"]
    (runtime,) = [r for r in by_kind(ref["kind"]) if r["metadata"]["name"] == ref["name"]]
    group = job["apiVersion"].split("/")[0]
    assert ref["apiGroup"] == group == runtime["apiVersion"].split("/")[0] == "trainer.kubeflow.org"
    assert "torch" in runtime["spec"]["mlPolicy"]  # the torch plugin: the PET_* variables
    (rjob,) = [r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]
               if r["template"]["metadata"]["labels"].get(
                   "trainer.kubeflow.org/trainjob-ancestor-step") == "trainer"]
    (container,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
    assert rjob["name"] == container["name"] == "node"  # the names the torch plugin looks for
    assert not TRAINER_RESERVED & {e["name"] for e in trainer.get("env", [])}
    assert container["command"] == trainer["command"] == ["elasticstore-run"]
    env = trainer_env(job, runtime)
    args = [expand(a, env) for a in trainer["args"]]
    assert not [a for a in args if "$(" in a]  # every reference has its variable
    rs = run.parse(args, env)
    assert rs.backend == "elasticstore"
    assert rs.min_nodes == rs.max_nodes == trainer["numNodes"]  # Trainer v2: a fixed node count
    assert rs.agent.nproc == trainer["numProcPerNode"] and rs.agent.max_restarts == 3
    assert rs.agent.run_id == name and rs.local_addr == "10.0.0.7"
    assert rs.rendezvous.join_timeout == 300
    host, port = rs.endpoint.rsplit(":", 1)
    # Pod 0 of replicated job "node" under the JobSet's headless Service, named after the job.
    pod, service = host.split(".")
    assert (pod, service) == (f"{name}-{rjob['name']}-0-0", name)
    assert all(len(label) <= 63 for label in (pod, service))  # DNS labels
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(port) == ports["rdzv"] == TRAINER_PORT
    assert rs.agent.metrics_port == ports["metrics"] and rs.agent.metrics_addr == "0.0.0.0"
