"""Records read back from a store are input: a bounded parse (size, depth), typed fields, and
human output that shows control characters as escapes. Real servers, the real CLI and agent."""

from __future__ import annotations

import json
import os
import zlib
import subprocess
import sys

import pytest
from agent_nodes import agents, node_flags

from elasticstore import Store, StoreServer
from elasticstore.ops.terminal import printable
from elasticstore.rendezvous.records import (MAX_RECORD_BYTES, MAX_RECORD_DEPTH, PACK_ABOVE,
                                             RecordError, number_field, pack_record, parse_json,
                                             parse_record)
from elasticstore.rendezvous.state import RoundState

ESC = "\x1b"
DEEP = ("[" * 100_000 + "]" * 100_000).encode()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elasticstore.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_parse_record_bounds_depth_and_size() -> None:
    ok = "[" * MAX_RECORD_DEPTH + "]" * MAX_RECORD_DEPTH
    assert parse_record(ok, "r") is not None
    too_deep = "[" * (MAX_RECORD_DEPTH + 1) + "]" * (MAX_RECORD_DEPTH + 1)
    for data in (too_deep, DEEP, b"{" * 10**6):
        with pytest.raises(RecordError, match="nested deeper"):
            parse_record(data, "the thing")
    # Brackets inside strings, escaped quotes included, are text, not nesting.
    text = json.dumps({"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\\"{{{{{{{{{{{{{{{{{{{{{{{"})
    assert parse_record(text, "r") == json.loads(text)
    with pytest.raises(RecordError, match="more than"):
        parse_record(b" " * (8 * 1024 * 1024 + 1), "big")
    with pytest.raises(RecordError, match="the thing: not JSON"):
        parse_record(b"{nope", "the thing")
    assert parse_json(DEEP) is None and parse_json(b"{nope") is None
    assert number_field({"x": 10**400}, "x") is None and number_field({"x": float("nan")}, "x") is None
    assert number_field({"x": True}, "x") is None and number_field({"x": 2}, "x") == 2.0


def test_a_large_record_is_stored_compressed_and_read_back_within_the_bounds() -> None:
    nodes = tuple(f"10.{i // 250}.{i % 250}.7-{40_000 + i}-0" for i in range(4096))
    small, large = RoundState(3, nodes[:10]), RoundState(3, nodes, nodes[:2])
    assert small.to_json().startswith(b"{")  # plain JSON, readable with any tool
    packed = large.to_json()
    assert not packed.startswith(b"{") and len(packed) < PACK_ABOVE
    assert RoundState.from_json(packed) == large and parse_json(packed)["round"] == 3
    assert pack_record(b"[]") == b"[]"
    bomb = pack_record(b" " * PACK_ABOVE + b"[" + b"0," * (MAX_RECORD_BYTES // 2) + b"0]")
    assert len(bomb) < 64 * 1024
    with pytest.raises(RecordError, match="once decompressed"):
        parse_record(bomb, "the round record")
    cut, prefix = packed[:-4], packed[:3]
    for data, why in ((cut, "cut short"), (packed + b"x", "followed by"),
                      (prefix + b"not zlib", "not a valid compressed record"),
                      (prefix + zlib.compress(b"[" * 100 + b"]" * 100), "nested deeper"),
                      (prefix + zlib.compress(b"{nope"), "not JSON")):
        with pytest.raises(RecordError, match=why):
            parse_record(data, "r")


def test_status_reads_a_compressed_round_record() -> None:
    nodes = tuple(f"127.1.{i // 200}.{i % 200 + 1}-{50_000 + i}-0" for i in range(2048))
    with StoreServer("127.0.0.2", 0) as server, Store(server.host, server.port) as st:
        record = RoundState(4, nodes).to_json()
        assert not record.startswith(b"{")  # compressed
        st.set("rdzv/j/ctl/round", record)
        js = cli("status", "--addr", server.address, "--rdzv-id", "j", "--json")
        assert js.returncode == 0, js.stderr
        got = json.loads(js.stdout)
        assert got["round"]["number"] == 4 and got["round"]["world_size"] == len(nodes)
        assert [m["node"] for m in got["members"]] == list(nodes)


def test_printable_escapes_every_control() -> None:
    assert printable(f"a{ESC}[2Jb\nc\td\x9b\u202ee\\") == "a\\x1b[2Jb\\nc\\td\\x9b\\u202ee\\\\"
    assert printable("plain 127.0.0.2-10-0 ünïcode") == "plain 127.0.0.2-10-0 ünïcode"


def _hostile_job(st: Store) -> list[str]:
    nodes = ["127.0.0.2-10-0", "127.0.0.3-11-0", "127.0.0.4-12-0"]
    st.set("rdzv/j/ctl/round", json.dumps({"schema": 1, "round": 2, "participants": nodes,
                                           "standby": [f"evil{ESC}]8;;http://x{ESC}\\"]}))
    st.set("rdzv/j/alive/" + nodes[0], "x")
    st.set(f"status/j/node/{nodes[0]}", json.dumps(
        {"state": f"running{ESC}[2J{ESC}[Hfake line", "round": 2, "local_workers": 4,
         "formed_at": 1e308, "rendezvous_seconds": "fast", "addr": 7}))
    st.set(f"status/j/node/{nodes[1]}", json.dumps(
        {"state": 5, "round": "2", "local_workers": "many", "failure_restarts": None}))
    st.set(f"status/j/node/{nodes[2]}", DEEP)
    st.set("status/j/failure", json.dumps(
        {"rank": 1, "host": f"h{ESC}[31m", "how": "exit code 1", "exit_code": 1,
         "message": "boom\nelasticstore: job j succeeded", "when": 10**400}))
    return nodes


def test_status_of_hostile_records_is_escaped_and_typed() -> None:
    with StoreServer("127.0.0.2", 0) as server, Store(server.host, server.port) as st:
        nodes = _hostile_job(st)
        out = cli("status", "--addr", server.address, "--rdzv-id", "j")
        assert out.returncode == 0, out.stderr
        assert ESC not in out.stdout and "Traceback" not in out.stderr, out
        assert "running\\x1b[2J\\x1b[Hfake line" in out.stdout
        assert "h\\x1b[31m" in out.stdout and "boom\\nelasticstore: job j succeeded" in out.stdout
        assert "evil\\x1b]8;;http://x\\x1b\\\\" in out.stdout
        lines = out.stdout.splitlines()
        assert not any(line.startswith("elasticstore: job") for line in lines)
        row = next(line for line in lines if nodes[1] in line)
        assert row.split()[-2:] == ["unknown", "(lost)"]  # "state": 5 is no state
        assert next(line for line in lines if nodes[2] in line).split()[-2:] == ["unknown", "(lost)"]
        js = cli("status", "--addr", server.address, "--rdzv-id", "j", "--json")
        assert js.returncode == 0, js.stderr
        members = json.loads(js.stdout)["members"]
        assert [m["state"] for m in members] == [f"running{ESC}[2J{ESC}[Hfake line", "unknown",
                                                 "unknown"]
        assert members[0]["addr"] == "127.0.0.2"  # 7 is no address: the node id's is used


def test_status_of_a_deep_round_record_is_one_line() -> None:
    with StoreServer("127.0.0.2", 0) as server, Store(server.host, server.port) as st:
        st.set("rdzv/j/ctl/round", DEEP)
        out = cli("status", "--addr", server.address, "--rdzv-id", "j")
        assert out.returncode == 1 and out.stdout == "", out
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "round record" in out.stderr and "nested deeper" in out.stderr, out.stderr


def test_ls_escapes_keys() -> None:
    with StoreServer("127.0.0.2", 0) as server, Store(server.host, server.port) as st:
        st.set(f"k{ESC}[2J{ESC}]0;title\x07", "v")
        out = cli("ls", "--addr", server.address)
        assert out.returncode == 0 and out.stdout == "k\\x1b[2J\\x1b]0;title\\x07\n", out


def test_agent_refuses_a_deep_round_record_with_a_clear_error(tmp_path: str) -> None:
    """An agent whose rendezvous store holds a deeply nested round record exits with one clear
    error instead of a RecursionError traceback."""
    with StoreServer("127.0.0.2", 0) as server, Store(server.host, server.port) as st:
        st.set("rdzv/job/ctl/round", DEEP)
        with agents(str(tmp_path)) as a:
            proc = a.start(node_flags("127.0.0.2", server.port, "1", 1,
                                      "--rdzv-conf", "join_timeout=20"))
            code = a.wait(proc, 120)
            out = a.output(proc)
            assert code != 0, out
            assert "RecursionError" not in out and "Traceback" not in out, out
            assert "round record" in out and "nested deeper" in out, out
            assert not os.listdir(str(tmp_path)) == []  # the agent's output file
