"""Writes the seed corpus under tests/fuzz/corpus/<target>/ (committed; re-run after a protocol
change). Each seed starts with the target's split byte (how the input is cut into reads)."""

from __future__ import annotations

import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def b(x: bytes) -> bytes:
    return struct.pack("<I", len(x)) + x


def frame(op: int, rid: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IBI", 5 + len(payload), op, rid) + payload


HELLO = frame(1, 1, struct.pack("<I", 1) + b(b"fuzz"))
NO_TIMEOUT = struct.pack("<I", 0xFFFFFFFF)
NATIVE = {
    "hello": HELLO,
    "set_get": HELLO + frame(2, 2, b(b"k") + b(b"v") + b"\x00") + frame(3, 3, b(b"k") + struct.pack("<I", 0)),
    "ephemeral": HELLO + frame(2, 2, b(b"e") + b(b"v") + b"\x01") + frame(4, 3, b(b"e")),
    "add_cas": HELLO + frame(5, 2, b(b"c") + struct.pack("<q", 5)) + frame(6, 3, b(b"c") + b(b"5") + b(b"6") + b"\x00"),
    "wait_multi": HELLO + frame(7, 2, struct.pack("<I", 2) + b(b"a") + b(b"b") + struct.pack("<I", 10))
    + frame(14, 3, struct.pack("<I", 2) + b(b"a") + b(b"1") + b(b"b") + b(b"2"))
    + frame(13, 4, struct.pack("<I", 2) + b(b"a") + b(b"b") + NO_TIMEOUT)
    + frame(8, 5, struct.pack("<I", 1) + b(b"a")),
    "queue": HELLO + frame(16, 2, b(b"q") + struct.pack("<I", 5)) + frame(15, 3, b(b"q") + b(b"x"))
    + frame(17, 4, b(b"q")) + frame(15, 5, b(b"q") + b(b"y")) + frame(16, 6, b(b"q") + NO_TIMEOUT),
    "misc": HELLO + frame(9, 2, b(b"k")) + frame(10, 3) + frame(11, 4, b(b"")) + frame(12, 5, b(b"k") + b(b"tail"))
    + frame(18, 6, struct.pack("<Q", 7)) + frame(21, 7),
    "barrier_watch": HELLO + frame(19, 2, b(b"bar") + struct.pack("<II", 1, 100))
    + frame(20, 3, b(b"p/") + b"\x01" + struct.pack("<QI", 0, 100)) + frame(2, 4, b(b"p/x") + b(b"1") + b"\x00")
    + frame(20, 5, b(b"p/x") + b"\x00" + struct.pack("<QI", 0xFFFFFFFFFFFFFFFF, 0)),
    "too_large": HELLO + frame(2, 2, b(b"k" * 100) + b(b"v") + b"\x00") + frame(2, 3, b(b"k") + b(b"v" * 5000) + b"\x00"),
    "no_hello": frame(2, 2, b(b"k") + b(b"v") + b"\x00"),
}


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def ts(x: bytes) -> bytes:
    return u64(len(x)) + x


VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)
TORCH = {
    "validate_ping": VALIDATE + b"\x0d" + struct.pack("<I", 1234),
    "set_get": VALIDATE + b"\x01" + ts(b"/a") + ts(b"1") + b"\x03" + ts(b"/a"),
    "add_check_wait": VALIDATE + b"\x04" + ts(b"/c") + struct.pack("<q", 3) + b"\x05" + u64(1) + ts(b"/c")
    + b"\x06" + u64(1) + ts(b"/c"),
    "cas_append": VALIDATE + b"\x02" + ts(b"/k") + ts(b"") + ts(b"v") + b"\x09" + ts(b"/k") + ts(b"w"),
    "multi": VALIDATE + b"\x0b" + u64(2) + ts(b"/a") + ts(b"1") + ts(b"/b") + ts(b"2") + b"\x0a" + u64(2) + ts(b"/a") + ts(b"/b"),
    "queue_keys": VALIDATE + b"\x0e" + ts(b"/q") + ts(b"x") + b"\x10" + ts(b"/q") + b"\x0f" + ts(b"/q")
    + b"\x11" + ts(b"/") + b"\x07" + b"\x08" + ts(b"/a"),
    "wait_cancel": VALIDATE + b"\x06" + u64(1) + ts(b"/never") + b"\x0c",
    "no_validate": b"\x01" + ts(b"/a") + ts(b"1"),
}


def write(target: str, seeds: dict[str, bytes], prefix: bytes) -> None:
    out = os.path.join(HERE, "corpus", target)
    os.makedirs(out, exist_ok=True)
    for name, data in seeds.items():
        for split in (0, 3):  # one read, and reads of a few bytes
            with open(os.path.join(out, f"{name}-{split}"), "wb") as f:
                f.write(bytes([split]) + prefix * (split % 8) + data)


write("fuzz_native_codec", NATIVE, b"\x04")
write("fuzz_tcpstore_codec", TORCH, b"\x05")
handshake = {f"native_{k}": b"ESTO" + v for k, v in NATIVE.items()}
handshake.update({f"torch_{k}": v for k, v in TORCH.items()})
handshake["bad_preamble"] = b"ESTX" + HELLO
handshake["garbage"] = b"GET / HTTP/1.1\r\n\r\n"
out = os.path.join(HERE, "corpus", "fuzz_handshake")
os.makedirs(out, exist_ok=True)
for name, data in handshake.items():
    for chunk in (31, 2):  # the first byte: reads of 32 and of 3 bytes
        with open(os.path.join(out, f"{name}-{chunk}"), "wb") as f:
            f.write(bytes([chunk]) + data)
