"""Rules of the agent-rendezvous layering, checked by reading files (no processes): the agent
calls the rendezvous through its Protocol only (no ``getattr`` probes for its methods), and the
backend registry is the one table of backend names (torchrun's entry points, ``--rdzv-backend``,
``elasticstore status/stop/forget --rdzv-backend``)."""

from __future__ import annotations

import ast
import pathlib
import tomllib

from elasticstore.rendezvous import registry

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "elasticstore"


def _protocol_members() -> set[str]:
    tree = ast.parse((PACKAGE / "rendezvous" / "api.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "AgentRendezvous":
            return {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    raise AssertionError("rendezvous/api.py defines no AgentRendezvous")


def test_agent_calls_the_rendezvous_without_getattr_probes() -> None:
    members = _protocol_members()
    assert {"round", "end_round", "closed_reason", "hosts_store", "serve_until_left",
            "publish_status", "watch_round", "set_finished", "next_rendezvous"} <= members
    found = []
    for path in sorted((PACKAGE / "agent").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
                name = node.args[1]
                if not isinstance(name, ast.Constant) or name.value in members:
                    found.append(f"{path.name}:{node.lineno}")
    assert not found, f"getattr on a rendezvous handler in agent/: {found}"


def test_agent_keys_of_the_rounds_store_come_from_the_rendezvous_state() -> None:
    for path in sorted((PACKAGE / "agent").glob("*.py")):
        assert "elasticstore/agent/" not in path.read_text(), path.name


def test_registry_matches_torchruns_entry_points() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    entry = project["project"]["entry-points"]["torchrun.handlers"]
    rows = {row.name: f"elasticstore.rendezvous.plugin:{row.plugin}" for row in registry.BACKENDS}
    assert entry == rows
    from elasticstore.rendezvous import plugin

    for row in registry.BACKENDS:
        creator = getattr(plugin, row.plugin)()
        assert creator is getattr(plugin, row.plugin)(), row.name  # torch refuses a second one


def test_every_backend_name_is_accepted_everywhere() -> None:
    from elasticstore import run
    from elasticstore.cli import _parser

    assert set(run.BACKENDS) == set(registry.names())
    for row in registry.BACKENDS:
        for name in row.names:
            assert registry.backend(name) is row and run.BACKENDS[name] == row.label
    jobs = {n for n in registry.names() if registry.backend(n).connector is not None}
    assert jobs == {"elasticstore", "c10d", "elasticstore-etcd", "etcd", "etcd-v2"}
    for name in jobs:
        args = _parser().parse_args(["status", "--rdzv-id", "j", "--rdzv-backend", name])
        assert args.rdzv_backend == name


def test_registry_names_are_unique() -> None:
    seen: dict[str, str] = {}
    for row in registry.BACKENDS:
        for name in row.names:
            assert name not in seen, f"{name} names {seen.get(name)} and {row.name}"
            seen[name] = row.name


def test_a_handler_without_elasticstores_parts_is_adapted_once() -> None:
    from elasticstore.rendezvous.api import AgentRendezvous, BasicRendezvous, as_agent_rendezvous
    from elasticstore.rendezvous.handler import ElasticRendezvousHandler
    from elasticstore.rendezvous.static import StaticRendezvousHandler

    static = registry.backend("static")
    settings = static.settings(run_id="r", endpoint="127.0.0.1:1", min_nodes=2, max_nodes=2,
                               local_addr=None, config={"rank": "1"})
    handler = static.create_handler(settings)  # connects nowhere until next_rendezvous
    assert isinstance(handler, StaticRendezvousHandler) and not isinstance(handler, AgentRendezvous)
    adapted = as_agent_rendezvous(handler, 0.1)
    assert isinstance(adapted, BasicRendezvous) and isinstance(adapted, AgentRendezvous)
    assert adapted.round is None and adapted.closed_reason() is None and not adapted.hosts_store
    assert adapted.get_backend() == "elasticstore-static" and adapted.use_agent_store
    watch = adapted.watch_round()
    assert watch is not None
    watch.close()
    assert watch.wait(5.0) is False  # closed: returns at once
    assert as_agent_rendezvous(adapted, 0.1) is adapted
    members = {m for m in dir(AgentRendezvous) if not m.startswith("_")}
    assert members <= set(dir(ElasticRendezvousHandler))


def test_agent_and_rendezvous_modules_stay_small() -> None:
    long = [f"{p.relative_to(PACKAGE)}: {n}" for d in ("agent", "rendezvous")
            for p in sorted((PACKAGE / d).glob("*.py"))
            if (n := len(p.read_text().splitlines())) > 400]
    assert not long, long
