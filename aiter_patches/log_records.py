"""JSON records written on log lines after a marker, and read back from a whole server log.

Status lines and stats lines are both written by many processes into one log, where a
line cut short can run on into another process's whole line and garbage can follow a
marker. One writer rule (compact JSON under one size limit) and one reader rule (every
marker on a line read on its own) keep the two kinds of line from drifting apart.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Iterator

# Bytes of one record line. A write of at most PIPE_BUF (4 KiB) to a pipe is atomic, so records
# from concurrent processes never interleave mid-line; the margin is for a log format's prefix.
LINE_LIMIT = 3584  # 512 bytes left of PIPE_BUF for a log prefix (3072 condensed a plain 10-patch record)


def dumps(record: Any) -> str:
    return json.dumps(record, separators=(",", ":"), default=str)


def cut(text: Any, n: int) -> Any:
    """``text`` shortened to ``n`` characters, the last one an ellipsis; anything else as it is."""
    return text[: n - 1] + "…" if isinstance(text, str) and len(text) > n else text


def marked(lines: Iterable[str], marker: str) -> Iterator[tuple[Any, bool]]:
    """``(value, too_deep)`` for every ``marker`` on every line: the JSON value that follows it.

    Text that does not parse, and a value that runs on into the next marker's text (a record
    cut short), yield nothing, in time linear in the line; JSON nested deeper than the decoder can go yields
    ``(None, True)`` so the caller can count it.
    """
    decode = json.JSONDecoder().raw_decode
    for line in lines:
        at = line.find(marker)
        while at >= 0:
            nxt = line.find(marker, at + 1)
            # decoded from its own stretch, up to the next marker (a value running on into it is dropped
            # anyway): a failed decode's line/column is worked out over that stretch, not the whole line
            # before it, so reading a line is linear in its length however many markers it holds (issue 35)
            text = line[at + len(marker):nxt] if nxt >= 0 else line[at + len(marker):]
            try:
                value, _ = decode(text)
            except ValueError:
                pass
            except RecursionError:
                yield None, True
            else:
                if "\\ud" in text or "\\uD" in text:  # only then can the value hold a lone surrogate
                    value = without_surrogates(value)
                yield value, False
            at = nxt


_SURROGATE = re.compile("[\ud800-\udfff]")


def without_surrogates(value: Any) -> Any:
    """``value`` with each lone surrogate in its strings and keys replaced by U+FFFD, as a stray byte is.

    JSON's ``"\\ud800"`` decodes to a lone surrogate, which no UTF-8 encoder takes: the summary line measures
    itself in UTF-8 bytes, and stdout writes UTF-8 (a traceback, found by issue 35's fuzz pass). Walked without
    recursion: a value may be nested as deep as the decoder goes.
    """
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    stack = [value] if isinstance(value, (dict, list)) else []
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, str):
                    node[i] = _SURROGATE.sub("\ufffd", v)
                elif isinstance(v, (dict, list)):
                    stack.append(v)
            continue
        items = list(node.items())
        node.clear()
        for k, v in items:
            if isinstance(v, str):
                v = _SURROGATE.sub("\ufffd", v)
            elif isinstance(v, (dict, list)):
                stack.append(v)
            node[_SURROGATE.sub("\ufffd", k)] = v
    return value


# The most a count in a record may be: no process makes more calls. A larger one is a hostile or broken
# record, skipped: a few near Python's 4,300-digit limit summed over processes could no longer be printed.
MAX_COUNT = 2**63 - 1


def is_count(v: Any) -> bool:
    """``v`` is a count a record can hold: a plain int (not a bool) from 0 to ``MAX_COUNT``."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT


def int_field(record: Any, key: str) -> int | None:
    """``record[key]`` when ``record`` is a dict and that is a plain int (not a bool), else None."""
    v = record.get(key) if isinstance(record, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None
