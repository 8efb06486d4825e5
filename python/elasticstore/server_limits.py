"""The server's configurable limits (docs/protocol.md, "Server options"), one dataclass shared by
``StoreServer`` and ``elasticstore server``; the native binary ``elasticstore-server`` takes the
same flags. A field left ``None`` keeps the server's default; the native side checks every range
and raises ``ValueError`` naming the field."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["ServerLimits", "add_limit_flags", "limits_from_args"]


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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an int >= 1, got {value!r}")

    def as_kwargs(self) -> dict[str, Any]:
        """The fields that are set, as keywords for ``_C.Server``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """``--max-key-bytes N`` ... ``--handshake-timeout-ms N``: one flag per field."""
    group = parser.add_argument_group("limits (docs/protocol.md; default: the server's)")
    for f in fields(ServerLimits):
        group.add_argument("--" + f.name.replace("_", "-"), type=_positive, metavar="N")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})
