"""The layering of the Python package, checked on its source (ast, no imports, no processes):
the stores (``elasticstore/stores/``) are a layer with a public API, imported by the layers above
and importing none of them, and every module stays small."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "elasticstore"
STORES = PACKAGE / "stores"
# The layers above the stores: a module under stores/ imports none of them.
UPPER = ("rendezvous", "agent", "ops", "train", "run", "launch", "cli", "init_method")
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


def test_the_stores_import_no_layer_above_them() -> None:
    bad = []
    for path in STORES.rglob("*.py"):
        for line, module, _ in _imports(path):
            parts = module.split(".")
            if parts[0] == "elasticstore" and len(parts) > 1 and parts[1] in UPPER:
                bad.append(f"{path.relative_to(PACKAGE)}:{line}: {module}")
    assert not bad, "upward imports from elasticstore.stores:\n" + "\n".join(bad)


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
