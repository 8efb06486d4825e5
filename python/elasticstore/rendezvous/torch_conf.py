"""torch's own ``--rdzv-conf`` keys, so a torchrun command line runs unchanged
(``settings.py`` takes them through :func:`torch_keys` before its own):

====================== ====================================================================
torch's key            here
====================== ====================================================================
read_timeout           c10d/etcd-v2: ``store_timeout`` (seconds one store operation may take)
keep_alive_interval    c10d: with ``keep_alive_max_attempt`` (torch's defaults 5 and 3), a
keep_alive_max_attempt node silent for interval x attempts is lost: ``lease_ttl`` = their product
heartbeat_timeout      c10d: accepted with a notice (a keep-alive here is one store write)
store_type             c10d: ``tcp`` accepted with a notice (the native store serves the
                       rendezvous); ``file`` refused (no rendezvous on a FileStore)
ssl_cert / ssl_cert_key etcd-v2: ``cert`` / ``key`` (the client certificate and its key)
====================== ====================================================================

A key given twice under both names (``read_timeout`` and ``store_timeout``, ``keep_alive_*`` and
``lease_ttl``, ``ssl_cert`` and ``cert``) with different values is refused. The notices are in
``RendezvousSettings.notices`` (the launcher prints them; the torchrun plugin path logs them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .conf_values import SettingsError, seconds_value

__all__ = ["TORCH_KEYS", "torch_keys"]

# torch's keys taken under another name here: torch's name -> ours
_TORCH_ALIASES = {"read_timeout": "store_timeout", "ssl_cert": "cert", "ssl_cert_key": "key",
                  "ca_cert": "cacert"}
_TORCH_KEEP_ALIVE = {"keep_alive_interval": 5, "keep_alive_max_attempt": 3}  # torch's defaults
TORCH_KEYS = frozenset({*_TORCH_ALIASES, *_TORCH_KEEP_ALIVE, "heartbeat_timeout", "store_type"})


def _same(config: dict[str, Any], ours: str, theirs: str, value: Any) -> None:
    if ours in config and str(config[ours]).strip() != str(value).strip():
        raise SettingsError(f"rdzv-conf {theirs}={value!r} and {ours}={config[ours]!r}: the same "
                            "setting twice with different values; give one")


def torch_keys(config: Mapping[str, Any], notices: list[str]) -> dict[str, Any]:
    """``config`` with torch's keys under our names (see the module doc); ``notices`` gets a
    line for each key that means nothing here."""
    out = dict(config)
    for theirs, ours in _TORCH_ALIASES.items():
        if theirs in out:
            value = out.pop(theirs)
            _same(out, ours, theirs, value)
            out[ours] = value
    given = {k: out.pop(k) for k in _TORCH_KEEP_ALIVE if k in out}
    if given:
        interval = seconds_value("keep_alive_interval", given.get("keep_alive_interval",
                                                             _TORCH_KEEP_ALIVE["keep_alive_interval"]))
        attempts = given.get("keep_alive_max_attempt", _TORCH_KEEP_ALIVE["keep_alive_max_attempt"])
        try:
            count = int(str(attempts).strip())
        except ValueError:
            count = 0
        if count < 1:
            raise SettingsError(f"rdzv-conf keep_alive_max_attempt={attempts!r}: must be a "
                                "positive integer")
        ttl = interval * count
        if "lease_ttl" in out and seconds_value("lease_ttl", out["lease_ttl"]) != ttl:
            raise SettingsError(f"rdzv-conf keep_alive_interval x keep_alive_max_attempt = {ttl:g}s "
                                f"and lease_ttl={out['lease_ttl']!r}: the same setting twice; give one")
        out["lease_ttl"] = ttl
    if "heartbeat_timeout" in out:
        seconds_value("heartbeat_timeout", out.pop("heartbeat_timeout"))
        notices.append("--rdzv-conf heartbeat_timeout: ignored (a keep-alive here is one store "
                       "write, bounded by store_timeout)")
    if "store_type" in out:
        kind = str(out.pop("store_type")).strip().lower()
        if kind == "file":
            raise SettingsError("rdzv-conf store_type=file: a rendezvous on a FileStore is not "
                                "supported; drop the key (the native store) or use etcd")
        if kind != "tcp":
            raise SettingsError(f"rdzv-conf store_type={kind!r}: expected tcp or file (torch's)")
        notices.append("--rdzv-conf store_type=tcp: the rendezvous runs on elasticstore's "
                       "native store")
    return out
