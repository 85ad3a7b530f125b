"""The one plain-text table of the command line (status, verify, drift, compile).

Why one module: three commands each wrote their own, one keeping trailing spaces
the others stripped. Columns are two spaces apart, a rule of dashes under the
header, no line ends in a space.
"""

from __future__ import annotations

from typing import Any, Sequence


def lines(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """The header, a rule of dashes, one line per row (cells through ``str``)."""
    cells = [[str(c) for c in header], *([str(c) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return [line(cells[0]), line(["-" * w for w in widths]), *(line(r) for r in cells[1:])]


def of_dicts(rows: Sequence[dict], cols: Sequence[str], empty: str) -> str:
    """:func:`lines` of dict rows (a missing key is a blank cell), joined; ``empty`` when there are no rows."""
    if not rows:
        return empty
    return "\n".join(lines(cols, [[r.get(c, "") for c in cols] for r in rows]))
