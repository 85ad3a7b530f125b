"""The one plain-text table of the command line (status, verify, drift, compile).

Why one module: three commands each wrote their own, one keeping trailing spaces
the others stripped. Columns are two spaces apart, a rule of dashes under the
header, no line ends in a space. Given a ``width`` (the commands use 120), a
table wider than that wraps its widest columns inside their cells (after a space,
a dot, a comma or a slash; a cell's own newlines are kept); the
narrow columns keep their natural width. ``--json`` is where nothing is shortened.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

WIDTH = 120  # the commands' tables fit a 120-column terminal
_GAP = "  "
_INDENT = "    "
_BREAK_AFTER = re.compile(r"(?<=[\s.,/])")


def lines(header: Sequence[str], rows: Sequence[Sequence[Any]], width: int | None = None,
          details: Sequence[str] | None = None) -> list[str]:
    """The header, a rule of dashes, the rows (cells through ``str``); within ``width`` columns when given.

    ``details``: per row, a text printed under it, indented (for a long cell that has no room in a column).
    """
    cells = [[str(c) for c in header], *([str(c) for c in r] for r in rows)]
    natural = [max(len(part) for r in cells for part in r[i].split("\n")) for i in range(len(header))]
    widths = natural
    if width is not None:
        widths = _fit(natural, [len(h) for h in cells[0]], width - len(_GAP) * (len(header) - 1))

    def line(row: Sequence[str]) -> str:
        return _GAP.join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    out = []
    for k, row in enumerate(cells):
        wrapped = [wrap(c, w) for c, w in zip(row, widths)]
        out.extend(line([part[j] if j < len(part) else "" for part in wrapped])
                   for j in range(max(len(part) for part in wrapped)))
        if k == 0:
            out.append(line(["-" * w for w in widths]))
        elif details and details[k - 1]:
            out.extend(_INDENT + part for part in wrap(details[k - 1], (width or 10**9) - len(_INDENT)) if part)
    return out


def _fit(natural: list[int], least: list[int], budget: int) -> list[int]:
    """Column widths summing to at most ``budget`` where possible: the narrowest columns first get their natural
    width, the rest share what is left evenly (never below their header's width)."""
    if sum(natural) <= budget:
        return natural
    widths = list(natural)
    left = budget
    order = sorted(range(len(natural)), key=lambda i: natural[i])
    for n, i in enumerate(order):
        share = left // (len(order) - n)
        widths[i] = max(min(natural[i], share), least[i], 1)
        left -= widths[i]
    return widths


def wrap(cell: str, width: int) -> list[str]:
    """``cell``'s lines, each cut into pieces of at most ``width`` characters (at a break point where one fits)."""
    out: list[str] = []
    for text in cell.split("\n"):
        current = ""
        for piece in _BREAK_AFTER.split(text):
            while len(piece) > width:  # a piece with no break point that fits: cut it
                if current:
                    out.append(current.rstrip())
                    current = ""
                out.append(piece[:width])
                piece = piece[width:]
            if len((current + piece).rstrip()) > width:
                out.append(current.rstrip())
                current = piece.lstrip()
            else:
                current += piece
        out.append(current.rstrip())
    return out


def of_dicts(rows: Sequence[dict], cols: Sequence[str], empty: str, width: int | None = None) -> str:
    """:func:`lines` of dict rows (a missing key is a blank cell), joined; ``empty`` when there are no rows."""
    if not rows:
        return empty
    return "\n".join(lines(cols, [[r.get(c, "") for c in cols] for r in rows], width))
