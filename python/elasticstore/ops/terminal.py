"""Text from a store, made safe to print on a terminal.

Keys, node names, failure messages and hosts come from whoever can write the store. Printed raw,
an ESC sequence in them could clear the screen, move the cursor to forge lines, set the window
title or plant a hyperlink, and a newline could fake a whole line of output. ``printable`` writes
every control character (C0 including newline and tab, DEL, C1) and the Unicode controls that
reorder or hide text (bidirectional overrides and isolates, zero-width marks) as a visible
escape (``\\x1b``, ``\\n``, ``\\u202e``), and a backslash as ``\\\\`` so an escape cannot be faked either.
Machine output (``--json``) needs none of this: JSON escapes control characters itself.
"""

from __future__ import annotations

import re

__all__ = ["printable"]

_UNSAFE = re.compile(
    "[\\\\\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028\u2029\u202a-\u202e\u2060-\u2064"
    "\u2066-\u2069\ufeff]")


_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: object) -> str:
    """``value`` as one line of text that shows every control character as an escape."""
    text = value if isinstance(value, str) else str(value)
    return _UNSAFE.sub(_escape, text)
