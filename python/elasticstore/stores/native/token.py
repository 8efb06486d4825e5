"""The shared token (docs/authentication.md): from an argument, a file or the environment.

Precedence, for ``Store``, ``StoreServer``, ``elasticstore server`` and ``elasticstore-server``:
an explicit token (``token=``, ``--token-file``), else the file named by ``ELASTICSTORE_TOKEN_FILE``,
else ``ELASTICSTORE_TOKEN``, else none. ``token=""`` means "no token", whatever the environment.
"""

from __future__ import annotations

import os

from ... import _C

__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "read_token_file", "resolve_token"]

TOKEN_ENV = "ELASTICSTORE_TOKEN"
TOKEN_FILE_ENV = "ELASTICSTORE_TOKEN_FILE"


def _checked(token: str, source: str) -> str:
    if not token:
        raise ValueError(f"{source}: the token is empty")
    if len(token.encode()) > _C.MAX_TOKEN_BYTES:
        raise ValueError(f"{source}: the token is over the limit of {_C.MAX_TOKEN_BYTES} bytes")
    return token


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in ``path``, without trailing whitespace (a final newline). Raises ``OSError``
    when the file cannot be read and ``ValueError`` when the token is empty or too long."""
    try:
        with open(path, "rb") as f:
            data = f.read(_C.MAX_TOKEN_BYTES + 64)
    except OSError as exc:
        message = f"cannot read the token file {os.fspath(path)}: {exc.strerror or exc}"
        raise OSError(exc.errno, message) from exc
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"token file {os.fspath(path)}: not UTF-8 text") from exc
    return _checked(text.rstrip(" \t\r\n"), f"token file {os.fspath(path)}")


def resolve_token(token: str | None) -> str:
    """``token`` when given (``""``: none), else from the environment; ``""`` when none is set."""
    if token is not None:
        return _checked(token, "token") if token else ""
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        return read_token_file(path)
    env = os.environ.get(TOKEN_ENV)
    if env:
        return _checked(env, TOKEN_ENV)
    return ""
