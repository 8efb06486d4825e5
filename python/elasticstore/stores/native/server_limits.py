"""The server's configurable limits (docs/protocol.md, "Server options"), one dataclass shared by
``StoreServer`` and ``elasticstore server``; the native binary ``elasticstore-server`` takes the
same flags. A field left ``None`` keeps the server's default; the native side checks every range
and raises ``ValueError`` naming the field."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["KEEPALIVE_MAX_COUNT", "KEEPALIVE_MAX_MS", "ServerLimits", "add_limit_flags", "limits_from_args"]

KEEPALIVE_MAX_MS = 32_767_000  # the kernel's TCP_MAX_KEEPIDLE / TCP_MAX_KEEPINTVL, in ms
KEEPALIVE_MAX_COUNT = 127  # its TCP_MAX_KEEPCNT
_ZERO_IS_OFF = frozenset({"keepalive_idle_ms", "keepalive_interval_ms", "keepalive_count"})


@dataclass(frozen=True)
class ServerLimits:
    max_connections_per_peer: int | None = None  # connections from one IP address [8192]
    max_key_bytes: int | None = None  # a key, 1..8192 [8192]
    max_value_bytes: int | None = None  # a value, 1..8 MiB [8 MiB]
    max_keys_per_request: int | None = None  # keys in one request, 1..131072 [131072]
    max_connection_buffer_bytes: int | None = None  # unsent replies of one connection [65 MiB]
    max_buffered_bytes: int | None = None  # buffered across connections [1 GiB]
    max_waiters_per_connection: int | None = None  # blocked requests of one connection [16384]
    max_stored_keys: int | None = None  # keys plus queued items stored [16M]
    max_stored_bytes: int | None = None  # their key and value bytes [4 GiB]
    frame_timeout_ms: int | None = None  # time to finish a request once started [30000]
    handshake_timeout_ms: int | None = None  # connect to the end of the handshake [10000]
    # An idle released barrier name (nobody waiting) is forgotten this long after its last
    # arrival; a later arrival starts again at generation 0 [600000]
    barrier_idle_ms: int | None = None
    # Dead peers (TCP keepalive): a peer gone without FIN/RST (powered off, partitioned) is closed,
    # and its session keys dropped, after idle + interval * count ms [16 s]. Idle and interval are
    # whole seconds (the kernel's unit); 0 in any of the three turns the detection off.
    keepalive_idle_ms: int | None = None  # silence before the first probe, <= 32767000 [10000]
    keepalive_interval_ms: int | None = None  # between probes, <= 32767000 [2000]
    keepalive_count: int | None = None  # unanswered probes that end the connection, <= 127 [3]

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            least = 0 if f.name in _ZERO_IS_OFF else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{f.name} must be an int >= {least}, got {value!r}")
        for name in ("keepalive_idle_ms", "keepalive_interval_ms"):
            value = getattr(self, name)
            if value is not None and (value % 1000 or value > KEEPALIVE_MAX_MS):
                raise ValueError(
                    f"{name} must be 0 (off) or a whole number of seconds in 1000..{KEEPALIVE_MAX_MS}"
                    f" ms (TCP keepalive counts seconds), got {value!r}"
                )
        if self.keepalive_count is not None and self.keepalive_count > KEEPALIVE_MAX_COUNT:
            raise ValueError(
                f"keepalive_count must be 0 (off) or 1..{KEEPALIVE_MAX_COUNT}, got {self.keepalive_count!r}"
            )

    def as_kwargs(self) -> dict[str, Any]:
        """The fields that are set, as keywords for ``_C.Server``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _positive(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _keepalive_ms(text: str) -> int:
    value = _integer(text)
    if value != 0 and not (1000 <= value <= KEEPALIVE_MAX_MS and value % 1000 == 0):
        raise argparse.ArgumentTypeError(
            f"{text!r}: must be 0 (off) or whole seconds in 1000..{KEEPALIVE_MAX_MS} ms "
            "(TCP keepalive counts seconds)"
        )
    return value


def _keepalive_count(text: str) -> int:
    value = _integer(text)
    if not 0 <= value <= KEEPALIVE_MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 (off) or 1..{KEEPALIVE_MAX_COUNT}")
    return value


_FLAG_TYPES = {
    "keepalive_idle_ms": _keepalive_ms,
    "keepalive_interval_ms": _keepalive_ms,
    "keepalive_count": _keepalive_count,
}


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """``--max-key-bytes N`` ... ``--keepalive-count N``: one flag per field."""
    group = parser.add_argument_group("limits (docs/protocol.md; default: the server's)")
    for f in fields(ServerLimits):
        kind = _FLAG_TYPES.get(f.name, _positive)
        group.add_argument("--" + f.name.replace("_", "-"), type=kind, metavar="N")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})
