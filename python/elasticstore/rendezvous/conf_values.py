"""The errors and the plain values of ``--rdzv-conf`` (``settings.py`` parses the keys, and
``torch_conf.py`` torch's own keys, with these): a bad value raises :class:`SettingsError` naming
the key."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["SettingsError", "bool_value", "seconds_value"]

_TRUE = {"1", "true", "t", "yes", "y"}
_FALSE = {"0", "false", "f", "no", "n"}


class SettingsError(ValueError):
    """A bad rendezvous setting; ``flag`` names the launcher's flag it came from
    (``--rdzv-conf``, ``--rdzv-endpoint``, ``--rdzv-id``, ``--nnodes``)."""

    def __init__(self, message: str, flag: str = "--rdzv-conf") -> None:
        super().__init__(message)
        self.flag = flag


def seconds_value(key: str, value: Any) -> float:
    try:
        secs = float(value)
    except (TypeError, ValueError):
        raise SettingsError(f"rdzv-conf {key}={value!r}: not a number of seconds") from None
    if not math.isfinite(secs) or secs <= 0:
        raise SettingsError(f"rdzv-conf {key}={value!r}: must be a positive number of seconds")
    return secs


def bool_value(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingsError(f"rdzv-conf {key}={value!r}: not a boolean (true/false, 1/0, yes/no)")
