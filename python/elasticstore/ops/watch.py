"""``elasticstore status --watch``: the job's state, refreshed in place until Ctrl-C. Reads only.

On a terminal with ``rich`` installed (``pip install 'elasticstore[status]'``) a live table;
otherwise the plain text of ``status.render``, redrawn (the screen cleared first on a terminal,
appended to a pipe or file). The first read is the caller's: a missing job or a dead endpoint
ends the command with one line. A read that fails later is shown in place of the table and the
watch goes on (the store may be coming back, e.g. its host restarting).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any

from .status import MEMBER_COLUMNS, footer_lines, header_lines, member_rows, render
from .terminal import printable

__all__ = ["MIN_INTERVAL", "watch"]

MIN_INTERVAL = 0.1  # seconds between two reads, at least
_CLEAR = "\x1b[H\x1b[2J"


def _error_line(exc: BaseException) -> str:
    return f"{time.strftime('%H:%M:%S')} the store did not answer: {printable(exc)} (retrying)"


def _rich_view(st: dict[str, Any] | None, error: str | None) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if st is None:
        return Text(error or "")
    table = Table(*MEMBER_COLUMNS, box=None, pad_edge=False)
    for row in member_rows(st):
        style = "red" if row[-1].endswith("(lost)") else None
        table.add_row(*(Text(cell) for cell in row), style=style)  # cells are text, not markup
    parts: list[Any] = [Text("\n".join(header_lines(st)), style="bold"), table,
                        Text("\n".join(footer_lines(st)))]
    if error:
        parts.append(Text(error, style="yellow"))
    return Group(*parts)


def _watch_rich(read: Callable[[], dict[str, Any]], first: dict[str, Any], interval: float,
                refreshes: int, out: IO[str]) -> None:
    from rich.console import Console
    from rich.live import Live

    st: dict[str, Any] | None = first
    with Live(_rich_view(st, None), console=Console(file=out), auto_refresh=False) as live:
        for _ in range(refreshes - 1):
            time.sleep(interval)
            error = None
            try:
                st = read()
            except Exception as exc:
                error = _error_line(exc)
            live.update(_rich_view(st, error), refresh=True)


def _watch_plain(read: Callable[[], dict[str, Any]], first: dict[str, Any], interval: float,
                 refreshes: int, out: IO[str]) -> None:
    clear = _CLEAR if out.isatty() else ""
    text = render(first)
    for i in range(refreshes):
        if i:
            time.sleep(interval)
            try:
                text = render(read())
            except Exception as exc:
                text = _error_line(exc)
        out.write(clear + text + "\n\n")
        out.flush()


def watch(read: Callable[[], dict[str, Any]], interval: float, out: IO[str] | None = None,
          refreshes: int = 1 << 40, plain: bool = False) -> int:
    """Shows ``read()`` every ``interval`` s, ``refreshes`` times or until Ctrl-C; returns the
    exit code. ``read()``'s first failure propagates."""
    out = out or sys.stdout
    interval = max(interval, MIN_INTERVAL)
    try:
        first = read()
    except KeyboardInterrupt:
        return 0
    use_rich = not plain and out.isatty()
    if use_rich:
        try:
            import rich  # noqa: F401
        except ImportError:
            use_rich = False
    try:
        (_watch_rich if use_rich else _watch_plain)(read, first, interval, refreshes, out)
    except KeyboardInterrupt:
        pass
    return 0
