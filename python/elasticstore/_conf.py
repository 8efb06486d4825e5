"""The old path of the ``--rdzv-conf`` splitter, now in :mod:`elasticstore.rendezvous.settings`
(the rendezvous's settings are its one user besides the launcher)."""

from .rendezvous.settings import parse_pairs, unquote_config

__all__ = ["parse_pairs", "unquote_config"]
