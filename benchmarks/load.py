"""Load: many concurrent native connections doing mixed operations against ``elasticstore-server``,
beside hostile connections (garbage, slowloris partial frames, half-open/silent sockets), then
checks that nothing was lost (every counter exact, every read saw its own last write) and reports
latency percentiles and the server's peak RSS.

    python benchmarks/load.py --connections 4096 --ops 1000 --hostile 1000

Raises RLIMIT_NOFILE for itself and the server. One asyncio loop drives every connection (raw
sockets, the native protocol), so on a small machine the client, not the server, is the limit.
``tests/stores/test_load.py`` runs a smaller configuration of the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import signal
import struct
import subprocess
import sys
import sysconfig
import time
from array import array
from dataclasses import dataclass, field

OP_HELLO, OP_SET, OP_GET, OP_ADD, OP_PING = 1, 2, 3, 5, 18
_HDR = struct.Struct("<IBI")


def _b(x: bytes) -> bytes:
    return struct.pack("<I", len(x)) + x


def frame(op: int, rid: int, payload: bytes = b"") -> bytes:
    return _HDR.pack(5 + len(payload), op, rid) + payload


HELLO = b"ESTO" + frame(OP_HELLO, 0, struct.pack("<I", 1) + _b(b"load"))


def raise_nofile(want: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = min(hard, max(soft, want))
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return new


def server_binary() -> str:
    return os.path.join(sysconfig.get_path("scripts"), "elasticstore-server")


def start_server(*flags: str) -> tuple[subprocess.Popen[str], int]:
    """The server raises its open-file limit to the hard limit itself. No preexec_fn: run in a
    process that used gRPC (the test suite's workers), a child that runs Python code between
    fork and exec can be aborted by gRPC's fork handlers (tests/stores/test_server_resources.py)."""
    proc = subprocess.Popen(
        [server_binary(), "--host", "127.0.0.1", "--port", "0", "--log-level", "error", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("elasticstore server listening on"):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc, int(line.strip().rsplit(":", 1)[1])


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Result:
    connections: int = 0
    ops: int = 0
    errors: list[str] = field(default_factory=list)
    latencies_us: array = field(default_factory=lambda: array("d"))
    shared_adds: int = 0
    own_counts: dict[int, int] = field(default_factory=dict)
    hostile_opened: int = 0
    hostile_closed_by_server: int = 0
    seconds: float = 0.0


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes,
                   rid: int) -> tuple[int, bytes]:
    writer.write(data)
    hdr = await reader.readexactly(9)
    body, status, got = _HDR.unpack(hdr)
    payload = await reader.readexactly(body - 5)
    if got != rid:
        raise RuntimeError(f"reply id {got} for request {rid}")
    return status, payload


async def good_client(cid: int, port: int, ops: int, res: Result, start: asyncio.Event) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(HELLO)
        hdr = await reader.readexactly(9)
        await reader.readexactly(_HDR.unpack(hdr)[0] - 5)
        res.connections += 1
        await start.wait()
        own = f"c{cid}".encode()
        mine = f"k{cid}".encode()
        last = b""
        lat = res.latencies_us
        for i in range(ops):
            kind = i % 5
            if kind == 0:
                req = frame(OP_ADD, i, _b(b"shared") + struct.pack("<q", 1))
            elif kind == 1:
                req = frame(OP_ADD, i, _b(own) + struct.pack("<q", 1))
            elif kind == 2:
                last = str(i).encode()
                req = frame(OP_SET, i, _b(mine) + _b(last) + b"\x00")
            elif kind == 3:
                req = frame(OP_GET, i, _b(mine) + struct.pack("<I", 0))
            else:
                req = frame(OP_PING, i, struct.pack("<Q", i))
            t0 = time.perf_counter()
            status, payload = await _request(reader, writer, req, i)
            lat.append((time.perf_counter() - t0) * 1e6)
            if status != 0:
                res.errors.append(f"conn {cid} op {i}: status {status} {payload[:80]!r}")
                return
            if kind == 0:
                res.shared_adds += 1
            elif kind == 1:
                res.own_counts[cid] = res.own_counts.get(cid, 0) + 1
                if struct.unpack("<q", payload)[0] != res.own_counts[cid]:
                    res.errors.append(f"conn {cid}: own counter {payload!r} != {res.own_counts[cid]}")
            elif kind == 3 and payload[4:4 + len(last)] != last:
                res.errors.append(f"conn {cid}: read {payload!r}, wrote {last!r}")
            res.ops += 1
    except (OSError, asyncio.IncompleteReadError, RuntimeError) as e:
        res.errors.append(f"conn {cid}: {type(e).__name__}: {e}")
    finally:
        writer.close()


async def _closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    """True when the server closed the connection (EOF, or a reset: it closes a socket with
    unread input) within ``within`` seconds."""
    try:
        while await asyncio.wait_for(reader.read(65536), within):
            pass
        return True
    except ConnectionError:
        return True
    except asyncio.TimeoutError:
        return False


async def hostile_client(kind: str, hid: int, port: int, res: Result, stop: asyncio.Event) -> None:
    rng = random.Random(hid)
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        res.hostile_opened += 1
        try:
            closed = asyncio.create_task(_closed_by_server(reader, 30))
            if kind == "garbage":  # bytes that are no protocol, or a native frame gone wrong
                junk = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300)))
                writer.write(rng.choice([junk, HELLO + junk, b"ESTO" + junk]))
            elif kind == "slowloris":  # a request started and trickled one byte at a time
                writer.write(HELLO + frame(OP_SET, 1, _b(b"s") + _b(b"x" * 4096) + b"\x00")[:20])
                for _ in range(100):
                    await asyncio.sleep(0.2)
                    if closed.done() or writer.is_closing():
                        break
                    writer.write(b"x")
            else:  # half-open: the preamble, then silence with the write side shut
                writer.write(b"ESTO")
                if writer.can_write_eof():
                    writer.write_eof()
            if await closed:
                res.hostile_closed_by_server += 1
        except (OSError, asyncio.IncompleteReadError):
            res.hostile_closed_by_server += 1
        finally:
            writer.close()


async def run(port: int, connections: int, ops: int, hostile: int) -> Result:
    res = Result()
    start, stop = asyncio.Event(), asyncio.Event()
    goods = []
    for base in range(0, connections, 256):  # connect in waves within the listen backlog
        batch = [asyncio.create_task(good_client(c, port, ops, res, start))
                 for c in range(base, min(connections, base + 256))]
        goods += batch
        while res.connections < min(connections, base + 256) and not res.errors:
            await asyncio.sleep(0.01)
    kinds = ["garbage", "slowloris", "half-open"]
    bad = [asyncio.create_task(hostile_client(kinds[h % 3], h, port, res, stop)) for h in range(hostile)]
    t0 = time.perf_counter()
    start.set()
    await asyncio.gather(*goods)
    res.seconds = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*bad)
    return res


async def read_counters(port: int, connections: int) -> tuple[int, dict[int, int]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(HELLO)
    hdr = await reader.readexactly(9)
    await reader.readexactly(_HDR.unpack(hdr)[0] - 5)

    async def add0(key: bytes, rid: int) -> int:
        _, payload = await _request(reader, writer, frame(OP_ADD, rid, _b(key) + struct.pack("<q", 0)), rid)
        return struct.unpack("<q", payload)[0]

    shared = await add0(b"shared", 1)
    own = {c: await add0(f"c{c}".encode(), 2 + c) for c in range(connections)}
    writer.close()
    return shared, own


def percentile(values: array, q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=4096)
    p.add_argument("--ops", type=int, default=1000)
    p.add_argument("--hostile", type=int, default=1000)
    args = p.parse_args(argv)
    raise_nofile(2 * (args.connections + args.hostile) + 256)
    proc, port = start_server("--frame-timeout-ms", "2000", "--handshake-timeout-ms", "2000")
    try:
        res = asyncio.run(run(port, args.connections, args.ops, args.hostile))
        shared, own = asyncio.run(read_counters(port, args.connections))
        rss = peak_rss_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    exact = shared == res.shared_adds and own == {c: res.own_counts.get(c, 0) for c in own}
    print(f"connections {args.connections} x {args.ops} ops, hostile {args.hostile} "
          f"({res.hostile_opened} opened, {res.hostile_closed_by_server} closed by the server)")
    print(f"ops {res.ops} in {res.seconds:.1f} s ({res.ops / max(res.seconds, 1e-9):.0f}/s), "
          f"p50 {percentile(res.latencies_us, 0.5):.0f} us, p99 {percentile(res.latencies_us, 0.99):.0f} us")
    print(f"errors {len(res.errors)}, counters exact {exact} (shared {shared}), "
          f"server peak RSS {rss:.1f} MiB")
    for e in res.errors[:10]:
        print("  ", e)
    closed_all = res.hostile_closed_by_server == res.hostile_opened
    return 0 if exact and closed_all and not res.errors and res.ops == args.connections * args.ops else 1


if __name__ == "__main__":
    sys.exit(main())
