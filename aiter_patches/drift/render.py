"""The drift report as people read it: a table, each target's signatures, and the pins to paste.

Why apart from the check: the check's results are data (``--json`` prints them as
they are); this module only words them. The table is the command line's one
table (``text_table``); ``--propose`` prints the signatures and hashes found in
the syntax of ``pins.py`` and ``relied_on.py``, to review before pasting.
"""

from __future__ import annotations

from .. import text_table
from .check import MATCH, Report, TargetResult


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    return text_table.lines(header, rows)


def _short(t: TargetResult, width: int = 100) -> str:
    text = t.reason
    if t.differences:
        prefix = t.differences[0].split(": ", 1)[0] + ": "
        if all(d.startswith(prefix) for d in t.differences):
            text = prefix + "; ".join(d[len(prefix):] for d in t.differences)
    if len(text) <= width:
        return text
    return text[: width - 30].rstrip() + f"... ({len(t.differences)} differences, below)"


def render_table(report: Report) -> str:
    out = [f"{report.library}: {report.source}" + (f" (version {report.version})" if report.version else ""), ""]
    rows = []
    for t in report.targets:
        rows.append([t.patch, t.target, t.status, f"pin {t.pin}" if t.status == MATCH else _short(t)])
    out += _table(rows, ["patch", "target", "status", "detail"])
    out += ["", "Signatures:"]
    seen: set[str] = set()
    for t in report.targets:
        if t.target in seen:
            continue
        seen.add(t.target)
        where = f" at {t.defined_at}" if t.defined_at else ""
        out.append(f"  {t.target}: {t.status}{where}")
        for v in t.via:
            out.append(f"    via    {v}")
        for p in t.pins:
            mark = "=" if p["label"] == t.pin else " "
            out.append(f"    pin {mark} {p['label']}: {p['text']}")
        out.append(f"    found    {t.found if t.found is not None else '-'}")
        out += [f"    diff     {d}" for d in t.differences]
    if report.relied_on:
        out += ["", "Relied-on source (sha256 of the function's source):"]
        rows = [
            [r.patch, f"{r.module}.{r.qualname}", r.status, r.reason or (r.defined_at or "")]
            for r in report.relied_on
        ]
        out += ["  " + line for line in _table(rows, ["patch", "function", "status", "detail"])]
    for w in report.warnings:
        out.append(f"WARNING: {w}")
    verdict = "every target matches a pin" if report.exit_code == 0 else "DRIFT: some targets do not match"
    out += ["", verdict]
    return "\n".join(out)


def render_propose(report: Report, label: str) -> str:
    """The found signatures and source hashes in pin syntax, to review and paste into pins.py / relied_on.py."""
    out = [f"# Found in {report.source}; review each against the patch before pasting."]
    seen: set[str] = set()
    for t in report.targets:
        if t.target in seen:
            continue
        seen.add(t.target)
        if t.found is None:
            out.append(f"# {t.target}: {t.status}: {t.reason}")
            continue
        note = f"matches pin {t.pin}" if t.pin else "drift"
        out.append(f"# {t.target} ({note})")
        out.append(f"Pin({label!r}, {t.found!r}, {f'ROCm/aiter {label} {t.defined_at}'!r}),")
    for r in report.relied_on:
        if r.found_sha256 is None:
            out.append(f"# {r.module}.{r.qualname}: missing: {r.reason}")
            continue
        out.append(f"# {r.module}.{r.qualname} ({r.status}, relied on by {r.patch})")
        out.append(
            f"SourcePin({r.module!r}, {r.qualname!r}, {r.found_sha256!r}, {r.why!r}, "
            f"{f'ROCm/aiter {label} {r.defined_at}'!r}),"
        )
    return "\n".join(out)
