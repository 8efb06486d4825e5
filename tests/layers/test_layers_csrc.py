"""The C++ tree's layering and its op table, checked by reading files (no processes).

csrc/ is in layers: wire/ (codecs, auth, buffers, log, ops.def) <- net/ (host lookups, socket
options) <- server/ and client/ (never each other) <- python/ (the _C module); server_main.cpp,
the server binary, uses wire/, net/ and server/ only. Every include of a project header names it
from csrc/ ("wire/protocol.hpp"). The native protocol's operations are the rows of
csrc/wire/ops.def, and Python reads them from ``_C.OPS``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elasticstore import _C

CSRC = Path(__file__).resolve().parents[2] / "csrc"
LAYERS = ("wire", "net", "server", "client", "python")
# What each layer (and the server binary) may include besides itself.
ALLOWED: dict[str, set[str]] = {
    "wire": set(),
    "net": {"wire"},
    "server": {"wire", "net"},
    "client": {"wire", "net"},
    "python": {"wire", "net", "server", "client"},
    "server_main.cpp": {"wire", "net", "server"},
}
MAX_LINES = 400
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
OP_ROW = re.compile(r'^ELASTICSTORE_OP\((\w+),\s*(\d+),\s*"(\w+)",\s*"(\w+)",\s*(\w+),\s*(\w+)\)',
                    re.MULTILINE)


def _sources() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".hpp", ".def"))


def _layer(path: Path) -> str:
    rel = path.relative_to(CSRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.name


def test_every_source_is_in_a_layer() -> None:
    strays = [str(p.relative_to(CSRC)) for p in _sources() if _layer(p) not in ALLOWED]
    assert not strays, f"files outside csrc/{{{','.join(LAYERS)}}}/: {strays}"


def test_includes_name_headers_from_csrc() -> None:
    bad = [f"{p.relative_to(CSRC)}: {inc}" for p in _sources()
           for inc in INCLUDE.findall(p.read_text())
           if inc.split("/")[0] not in LAYERS or not (CSRC / inc).is_file()]
    assert not bad, f"includes not of the form \"<layer>/<file>\" under csrc/: {bad}"


def test_no_layer_includes_one_above_it() -> None:
    bad = []
    for p in _sources():
        layer = _layer(p)
        for inc in INCLUDE.findall(p.read_text()):
            target = inc.split("/")[0]
            if target != layer and target not in ALLOWED[layer]:
                bad.append(f"{p.relative_to(CSRC)} includes {inc}")
    assert not bad, f"upward or sideways includes: {bad}"


def test_modules_stay_small() -> None:
    big = {str(p.relative_to(CSRC)): n for p in _sources()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"files over {MAX_LINES} lines (split them by job): {big}"


def _op_rows() -> list[tuple[str, int, str]]:
    rows = OP_ROW.findall((CSRC / "wire" / "ops.def").read_text())
    return [(call, int(code), kind.lower()) for _enum, code, _wire, call, kind, _h in rows]


def test_python_op_table_is_ops_def() -> None:
    rows = _op_rows()
    assert rows, "no ELASTICSTORE_OP rows parsed from ops.def"
    assert [code for _, code, _ in rows] == list(range(1, len(rows) + 1))
    assert list(_C.OPS) == rows


def test_etcd_store_counts_under_the_native_op_names() -> None:
    """EtcdStore counts its calls under the names in _C.OPS: connecting and each store op.
    Imported here, so the other checks need no etcd client (the ``elasticstore[etcd]`` extra)."""
    pytest.importorskip("etcd3", reason="EtcdStore needs the elasticstore[etcd] extra")
    pytest.importorskip("grpc", reason="EtcdStore needs the elasticstore[etcd] extra")
    from elasticstore.stores.etcd import EtcdStore

    counted = {name for name, attr in vars(EtcdStore).items() if hasattr(attr, "__wrapped__")}
    renamed = {"connect": "_open", "compare_set": "compare_set_ex"}
    expected = {renamed.get(name, name) for name, _code, kind in _C.OPS
                if kind in ("session", "store")}
    assert counted == expected
