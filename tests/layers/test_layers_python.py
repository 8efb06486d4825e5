"""The layering of the Python package, checked on its source (ast, no imports, no processes):
the stores (``elasticstore/stores/``) are a layer with a public API, imported by the layers above
and importing none of them; no layer imports one it must not (``docs/architecture.md``, "The
rules"); the agent takes from the rendezvous, past its Protocol, and from ``train/`` only data;
and every module stays small."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "elasticstore"
STORES = PACKAGE / "stores"
# The commands: nothing imports them but their entry points (and __init__.py, init_method's
# scheme; launch.py runs run.py, which parses runflags.py's flags). The Python launch API
# (launcher/: torch's elastic_launch, which parses its config as run.py's flags) and the
# schedulers' input layer (schedulers/: Slurm's environment read into run.py's flags) are
# commands too.
COMMANDS = ("run", "runflags", "runvalues", "launch", "cli", "init_method", "launcher", "schedulers")
# The old top-level paths, kept for users' imports: the package itself imports the current ones.
OLD_PATHS = ("store", "etcd_store", "server", "server_limits", "prefix_store", "call_stats", "_conf")
# What each layer (a package under elasticstore/) must not import, by its first name under
# elasticstore. errors.py and _C are every layer's.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "stores": ("rendezvous", "agent", "ops", "train", *COMMANDS),
    "rendezvous": ("agent", "ops", "train", *COMMANDS),
    "agent": ("ops", *COMMANDS),
    "ops": ("agent", *COMMANDS),
    "train": ("stores", "rendezvous", "agent", "ops", *COMMANDS),
    "replicas": ("rendezvous", "agent", "ops", *COMMANDS),
}
# What the agent may import from the rendezvous and from train/, and nothing else of them: the
# Protocol (api), and data: the round store's key names (state.AgentKeys), the bounded record
# parsers (records), the finished-run marker (closing.FINISHED), and the heartbeat board's layout
# that the workers' heartbeats write (train/heartbeat_layout).
AGENT_TAKES: dict[str, set[str] | None] = {
    "elasticstore.rendezvous.api": None,  # any name: the Protocol and its types
    "elasticstore.rendezvous.state": {"AgentKeys"},
    "elasticstore.rendezvous.records": None,  # any name: parsing only
    "elasticstore.rendezvous.closing": {"FINISHED"},
    "elasticstore.train.heartbeat_layout": None,  # any name: the layout, standard library only
}
MAX_LINES = 400
# Modules allowed over MAX_LINES, each with the reason. None today.
LONG_MODULES: dict[str, str] = {}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, absolute module, names imported from it) for every import of ``path``, type-only
    and function-level imports included."""
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            yield node.lineno, module, [alias.name for alias in node.names]


def _targets(module: str, names: list[str]) -> Iterator[str]:
    """The modules of the package an import names: ``from elasticstore import x`` names
    ``elasticstore.x``; ``from elasticstore.rendezvous import registry`` the submodule, and
    ``from elasticstore.rendezvous import RoundState`` the package (its ``__init__``)."""
    if module == "elasticstore":
        yield from (f"{module}.{n}" for n in names)
    elif module.startswith("elasticstore."):
        base = PACKAGE.parent.joinpath(*module.split("."))
        subs = [n for n in names if (base / n).is_dir() or (base / f"{n}.py").is_file()]
        yield from (f"{module}.{n}" for n in subs)
        if not names or len(subs) < len(names):
            yield module


def _layer_of(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _in_stores(path: Path) -> bool:
    return STORES in path.parents


def _private_store_methods() -> set[str]:
    """The underscore names that classes under stores/ define (methods and attributes)."""
    names: set[str] = set()
    for path in STORES.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    if isinstance(item, ast.FunctionDef) and _private(item.name):
                        names.add(item.name)
    return names


def test_the_scan_sees_the_package() -> None:
    names = {_module_name(p) for p in _modules()}
    assert {"elasticstore.stores.api", "elasticstore.stores.native.store",
            "elasticstore.stores.etcd.store", "elasticstore.rendezvous.etcd"} <= names
    found = {m for _, m, _ in _imports(PACKAGE / "rendezvous" / "backend.py")}
    assert "elasticstore.stores.api" in found


def test_nothing_outside_the_stores_imports_their_private_names() -> None:
    bad = []
    for path in _modules():
        if _in_stores(path):
            continue
        for line, module, names in _imports(path):
            if module != "elasticstore.stores" and not module.startswith("elasticstore.stores."):
                continue
            parts = module.split(".")[2:]
            hidden = [p for p in parts if _private(p)] + [n for n in names if _private(n)]
            if hidden:
                bad.append(f"{path.relative_to(PACKAGE)}:{line}: {module} {hidden}")
    assert not bad, "private names of elasticstore.stores imported from outside it:\n" + \
        "\n".join(bad)


def test_nothing_outside_the_stores_calls_their_private_methods() -> None:
    private = _private_store_methods()
    bad = []
    for path in _modules():
        if _in_stores(path):
            continue
        own: set[str] = set()  # what the module's own classes define: self._x is theirs
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                own.add(node.name)
        for node in ast.walk(tree):
            mine = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in ("self", "cls")
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and node.attr not in own and not mine):
                bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: .{node.attr}")
    assert not bad, "private methods of the stores used from outside them:\n" + "\n".join(bad)


def test_the_scan_sees_imports_of_submodules() -> None:
    assert set(_targets("elasticstore", ["_C", "errors"])) == {"elasticstore._C",
                                                               "elasticstore.errors"}
    assert set(_targets("elasticstore.rendezvous", ["registry"])) == {
        "elasticstore.rendezvous.registry"}
    assert set(_targets("elasticstore.rendezvous", ["ElasticRendezvousHandler"])) == {
        "elasticstore.rendezvous"}
    assert list(_targets("torch.distributed", ["Store"])) == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_layer_imports_one_it_must_not(layer: str) -> None:
    """The stores import no layer above them; the rendezvous neither the agent, ops nor train/;
    the agent not ops; ops not the agent; train/ none of the stores, the rendezvous, the agent or
    ops; and none of them a command."""
    assert (PACKAGE / layer).is_dir()
    bad = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module, names in _imports(path):
            for target in _targets(module, names):
                parts = target.split(".")
                if len(parts) > 1 and parts[1] in FORBIDDEN[layer]:
                    bad.append(f"{path.relative_to(PACKAGE)}:{line}: {target}")
    assert not bad, f"imports from elasticstore.{layer} that the layering forbids:\n" + \
        "\n".join(bad)


def test_nothing_imports_a_command_or_an_old_path() -> None:
    """Nothing imports a command but another command and ``__init__.py`` (the scheme of
    ``init_method.py``); nothing in the package imports an old path."""
    bad = []
    for path in _modules():
        for line, module, names in _imports(path):
            for target in _targets(module, names):
                name = target.split(".")[1]
                command = name in COMMANDS and _layer_of(path) not in COMMANDS and not (
                    path == PACKAGE / "__init__.py" and name == "init_method")
                if command or name in OLD_PATHS:
                    bad.append(f"{path.relative_to(PACKAGE)}:{line}: {target}")
    assert not bad, "commands imported from below them, or old paths imported:\n" + "\n".join(bad)
    assert all((PACKAGE / f"{name}.py").is_file() or (PACKAGE / name / "__init__.py").is_file()
               for name in (*COMMANDS, *OLD_PATHS))


def test_the_agent_takes_only_data_from_the_rendezvous_and_train() -> None:
    """Past the Protocol (``rendezvous/api.py``), the agent imports from the rendezvous only key
    names, record parsing and a constant, and from train/ only the heartbeat board's layout."""
    bad = []
    for path in sorted((PACKAGE / "agent").rglob("*.py")):
        for line, module, names in _imports(path):
            for target in _targets(module, names):
                if target.split(".")[1] not in ("rendezvous", "train"):
                    continue
                allowed = AGENT_TAKES.get(target, set())
                extra = sorted(set(names) - allowed) if allowed is not None else []
                if target not in AGENT_TAKES or extra:
                    bad.append(f"{path.relative_to(PACKAGE)}:{line}: {target} {extra or names}")
    assert not bad, "the agent imports more than the Protocol and data from rendezvous/train:\n" + \
        "\n".join(bad)
    found = {t for p in (PACKAGE / "agent").rglob("*.py") for _, m, n in _imports(p)
             for t in _targets(m, n)}
    assert set(AGENT_TAKES) <= found, f"listed but not imported: {set(AGENT_TAKES) - found}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_size(path: Path) -> None:
    name = str(path.relative_to(PACKAGE))
    lines = len(path.read_text().splitlines())
    if name in LONG_MODULES:
        return
    assert lines <= MAX_LINES, f"{name}: {lines} lines (split it by job, or list it with a reason)"


def test_listed_long_modules_still_exist_and_are_long() -> None:
    for name in LONG_MODULES:
        path = PACKAGE / name
        assert path.exists(), f"{name} is listed as long but does not exist"
        assert len(path.read_text().splitlines()) > MAX_LINES, f"{name} is no longer long"
