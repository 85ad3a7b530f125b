"""What ran, for operators: each process logs its counters at exit and, if asked, every N seconds.

``stats()`` lives in one process's memory; a server is many processes, and an
operator reads logs. So each process that applied a patch logs, on the
``aiter_patches`` logger at INFO, one line per applied patch at exit (atexit)
and every ``AITER_PATCHES_STATS_INTERVAL`` seconds when that is set (only lines
whose counts changed):

    aiter_patches stats: {"pid":4242,"patch":"moe_sort_mx_quant","at":"exit","fast":812,"fallback":{...},...}

fast-path hits, fallbacks by reason, fast-path errors and the foreign layers
seen on the patch's targets. A line stays under 4 KiB: the rarest reasons are
folded into a ``*_more`` count. ``aiter-patches status --from-log`` sums the
latest line of each (pid, patch) over the processes of a log.

The interval thread is a daemon (it never keeps a process alive) and is
restarted in a forked child, whose lines count only its own calls (the counts
it inherited at the fork are subtracted): this module subscribes to the core's
fork events (``core/events.py``), the core never calls it. Processes that leave through
``os._exit`` (multiprocessing's fork workers) or a signal log no exit line: set
the interval for those.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from typing import Any, Callable, Iterable

from . import env_flags, log_records, periodic, registry
from .core import events

log = logging.getLogger("aiter_patches")

MARKER = "aiter_patches stats: "
INTERVAL_ENV = "AITER_PATCHES_STATS_INTERVAL"
MAX_LINE = log_records.LINE_LIMIT  # bytes of the message: the status lines' limit
_MAX_KEY = 240  # characters of one reason
_MAX_FOREIGN = 400

_lock = threading.Lock()
_started_pid: int | None = None
_atexit_registered = False  # once per process lifetime: a forked child inherits the entry, _at_exit checks the pid
_periodic = periodic.Periodic("aiter_patches-stats", lambda: log_stats("interval"))
_baseline: dict[str, dict[str, Any]] = {}  # counts inherited through fork, per patch
_last: dict[str, str] = {}  # per patch, the counts part of the last line logged
_before_lines: list[Callable[[], None]] = []  # run before each batch of lines (process_report: a fresh status line)


def before_lines(fn: Callable[[], None]) -> None:
    """Run ``fn`` before each batch of stats lines (at an interval and at exit); it must never raise."""
    if fn not in _before_lines:
        _before_lines.append(fn)


MAX_INTERVAL_S = 365 * 86400.0  # a wait longer than this overflows on some platforms (threading.TIMEOUT_MAX)


def interval() -> float | None:
    """Seconds between periodic lines, or None: unset or empty, or not a positive number of at most a
    year (``-5``, ``abc``, ``inf``, ``1e10``), which is warned about once and means no periodic line."""
    return env_flags.positive_number(INTERVAL_ENV, None, maximum=MAX_INTERVAL_S, unit="seconds",
                                     default_text="no periodic line")


def ensure_started() -> None:
    """Once per process, after a patch applied: register the exit line and start the interval thread."""
    global _started_pid, _atexit_registered
    with _lock:
        if _started_pid == os.getpid():
            return
        _started_pid = os.getpid()
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
        _start_thread()


def _start_thread() -> None:
    seconds = interval()
    if seconds is not None:
        _periodic.start(seconds)


def stop_thread() -> None:
    """Stop the interval thread of this process (tests; a server never needs to)."""
    _periodic.stop()


def _renew_after_fork() -> None:
    """``FORK_RENEW``: a fresh lock; the parent's thread is gone. Never blocks."""
    global _lock
    _lock = threading.Lock()
    _periodic.forget()
    _last.clear()


def _restart_after_fork(inherited: dict[str, dict[str, Any]]) -> None:
    """``FORK_RESTART``: the counts the child inherited (per patch) are not its own; its thread starts again.

    Subscribed before process_report's (which imports this module), so the
    child's summary, whose ``ensure_started`` then finds this process started,
    comes after: one thread, one exit line.
    """
    global _started_pid
    _baseline.clear()
    _baseline.update(inherited)
    try:
        if _started_pid is not None:
            _started_pid = os.getpid()  # the exit handler is inherited; the thread is started again
            _start_thread()
    except Exception:  # never in the way of a fork
        pass


events.subscribe(events.FORK_RENEW, _renew_after_fork)
events.subscribe(events.FORK_RESTART, _restart_after_fork)


def _at_exit() -> None:
    if _started_pid == os.getpid():
        stop_thread()
        log_stats("exit")


CHECK_FIELDS = ("checks_passed", "checks_failed")  # the self-check's calls (self_check.py), in the lines when > 0


def _minus(now: dict[str, int], base: dict[str, int]) -> dict[str, int]:
    return {k: v - base.get(k, 0) for k, v in now.items() if v - base.get(k, 0) > 0}


def records() -> list[dict[str, Any]]:
    """This process's counts per applied patch (since its start, or its fork), with the foreign layers seen."""
    out = []
    for name, snap in registry.stats().items():  # one foreign-layer scan, with the counts
        if registry.state(name) not in (registry.APPLIED, registry.CHECK_FAILED):
            continue
        base = _baseline.get(name, {})
        out.append({
            "pid": os.getpid(),
            "patch": name,
            "fast": snap.get("fast", 0) - base.get("fast", 0),
            **{k: snap.get(k, 0) - base.get(k, 0) for k in CHECK_FIELDS},
            "fallback": _minus(snap.get("fallback", {}), base.get("fallback", {})),
            "errors": _minus(snap.get("errors", {}), base.get("errors", {})),
            "foreign_layers": list(snap.get("foreign_layers", [])),
        })
    return out


_cut = log_records.cut


def line(record: dict[str, Any]) -> str:
    """One stats line, under ``MAX_LINE`` bytes: the rarest reasons folded into ``fallback_more``/``errors_more``.

    Built in time linear in the record (issue 35): the record is written once, then the rarest entries come
    off by their own bytes (from the list with more entries, then the foreign layers), and the line is written
    again; only if the separators' count is off by a few bytes does a last entry come off that way again."""
    rec = dict(record)
    for key in ("fallback", "errors"):
        rec[key] = {_cut(k, _MAX_KEY): v for k, v in sorted(rec.get(key, {}).items(), key=lambda kv: -kv[1])}
    rec["foreign_layers"] = [_cut(f, _MAX_FOREIGN) for f in rec.get("foreign_layers", [])]

    def text() -> str:
        return MARKER + log_records.dumps(rec)

    out = text()
    over = len(out.encode("utf-8")) - MAX_LINE
    if over <= 0:
        return out
    entries = {key: list(rec[key].items()) for key in ("fallback", "errors")}  # most calls first
    keep = {key: len(entries[key]) for key in entries}
    foreign = len(rec["foreign_layers"])
    more: dict[str, Any] = {}
    while over > 0:
        key = max(("fallback", "errors"), key=lambda k: keep[k])
        if keep[key]:
            keep[key] -= 1
            reason, calls = entries[key][keep[key]]
            over -= _bytes({reason: calls}) - 2 + (1 if keep[key] else 0)  # its comma, unless the last one
            name = f"{key}_more"
            was = more.get(name)
            now = {"reasons": (was or {}).get("reasons", 0) + 1, "calls": (was or {}).get("calls", 0) + calls}
            over += _bytes({name: now}) - (_bytes({name: was}) if was else 1)  # a new key: its comma too
            more[name] = now
        elif foreign:
            foreign -= 1
            over -= _bytes(rec["foreign_layers"][foreign]) + (1 if foreign else 0)
            was = more.get("foreign_layers_more")
            now = (was or 0) + 1
            over += _bytes({"foreign_layers_more": now}) - (_bytes({"foreign_layers_more": was}) if was else 1)
            more["foreign_layers_more"] = now
        else:  # pragma: no cover - a record without lists is far below the limit
            break
    for key in ("fallback", "errors"):
        rec[key] = dict(entries[key][:keep[key]])
    del rec["foreign_layers"][foreign:]
    rec.update(more)
    out = text()
    while len(out.encode("utf-8")) > MAX_LINE:  # the estimate's few bytes off, if any: the old way, briefly
        key = max(("fallback", "errors"), key=lambda k: len(rec[k]))
        if rec[key]:
            reason = min(rec[key], key=lambda k: rec[key][k])
            calls = rec[key].pop(reason)
            fold = rec.setdefault(f"{key}_more", {"reasons": 0, "calls": 0})
            fold["reasons"] += 1
            fold["calls"] += calls
        elif rec["foreign_layers"]:
            rec["foreign_layers"].pop()
            rec["foreign_layers_more"] = rec.get("foreign_layers_more", 0) + 1
        else:  # pragma: no cover
            break
        out = text()
    return out


def _bytes(value: Any) -> int:
    return len(log_records.dumps(value).encode("utf-8"))


def log_stats(at: str) -> None:
    """Log one line per applied patch (``at``: "exit" or "interval"; at an interval only changed ones). Never raises."""
    try:
        for fn in list(_before_lines):  # process_report: a foreign layer seen since the last status line gets one
            fn()
        for rec in records():
            checks = {k: rec[k] for k in CHECK_FIELDS if rec.get(k)}
            counts = json.dumps([rec["fast"], rec["fallback"], rec["errors"], rec["foreign_layers"], checks],
                                sort_keys=True)
            if at == "interval" and _last.get(rec["patch"]) == counts:
                continue
            _last[rec["patch"]] = counts
            log.info("%s", line({"pid": rec["pid"], "patch": rec["patch"], "at": at, "fast": rec["fast"], **checks,
                                 **{k: rec[k] for k in ("fallback", "errors", "foreign_layers")}}))
    except Exception:  # reporting must never break a server, least of all at exit
        log.debug("aiter_patches: could not write the stats lines", exc_info=True)


# ---------------------------------------------------------------- reading a log back

def _counts(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and log_records.is_count(n) for k, n in v.items())


def _well_shaped(rec: dict[str, Any]) -> bool:
    """The fields ``summed`` reads have the types a stats line writes (each optional), counts within
    ``log_records.MAX_COUNT``."""
    if not all(log_records.is_count(rec.get(key, 0)) for key in ("fast", *CHECK_FIELDS)):
        return False
    if not all(_counts(rec.get(k, {})) for k in ("fallback", "errors", "fallback_more", "errors_more")):
        return False
    foreign = rec.get("foreign_layers", [])
    return isinstance(foreign, list) and all(isinstance(f, str) for f in foreign)


def scan_stats(lines: Iterable[str]) -> tuple[list[dict[str, Any]], int]:
    """The latest stats record of each (pid, patch) in a log, and how many were skipped for an unexpected shape.

    Read as the status lines are (``log_records.marked``): every marker on a line
    on its own. JSON nested too deep to decode, or a record whose fields have the
    wrong types, is skipped and counted.
    """
    latest: dict[tuple[int, str], dict[str, Any]] = {}
    odd = 0
    for rec, too_deep in log_records.marked(lines, MARKER):
        pid = log_records.int_field(rec, "pid")
        if too_deep:
            odd += 1
        elif pid is not None and isinstance(rec.get("patch"), str):
            if _well_shaped(rec):
                latest[(pid, rec["patch"])] = rec
            else:
                odd += 1
    return list(latest.values()), odd


def _add(into: dict[str, int], more: Any) -> None:
    if isinstance(more, dict):
        for k, v in more.items():
            if isinstance(v, int):
                into[k] = into.get(k, 0) + v


def summed(records_: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per patch, over processes: hits, fallbacks by reason, errors, the foreign layers any process saw."""
    out: dict[str, dict[str, Any]] = {}
    seen_by: dict[str, set] = {}  # per patch, the foreign layers listed (a list's ``in`` made this quadratic)
    for rec in records_:
        s = out.setdefault(rec["patch"], {"processes": 0, "fast": 0, "fallback": {}, "errors": {},
                                          "foreign_layers": [], **dict.fromkeys(CHECK_FIELDS, 0)})
        s["processes"] += 1
        for key in ("fast", *CHECK_FIELDS):
            s[key] += rec.get(key, 0) if isinstance(rec.get(key), int) else 0
        _add(s["fallback"], rec.get("fallback"))
        _add(s["errors"], rec.get("errors"))
        for key in ("fallback_more", "errors_more"):
            if isinstance(rec.get(key), dict):
                s.setdefault(key, {"reasons": 0, "calls": 0})
                _add(s[key], rec[key])
        foreign = rec.get("foreign_layers")
        seen = seen_by.setdefault(rec["patch"], set())
        for f in foreign if isinstance(foreign, list) else []:
            if isinstance(f, str) and f not in seen:
                seen.add(f)
                s["foreign_layers"].append(f)
    return out


def render(sums: dict[str, dict[str, Any]]) -> list[str]:
    """The human lines of ``status --from-log`` for the sums."""
    out = []
    foreign: dict[str, list[str]] = {}
    for name, s in sums.items():
        n_fb = sum(s["fallback"].values()) + s.get("fallback_more", {}).get("calls", 0)
        n_err = sum(s["errors"].values()) + s.get("errors_more", {}).get("calls", 0)
        text = f"{name}: {s['fast']} fast-path hits, {n_fb} fallbacks, {n_err} errors over {s['processes']} processes"
        if s.get("checks_passed") or s.get("checks_failed"):
            text += (f"; self-check: {s.get('checks_passed', 0)} calls equal to AITER's, "
                     f"{s.get('checks_failed', 0)} different")
        out.append(text)
        for reason, n in sorted(s["fallback"].items(), key=lambda kv: -kv[1]):
            out.append(f"    fallback {n}: {reason}")
        if s.get("fallback_more"):
            out.append(f"    fallback {s['fallback_more']['calls']}: {s['fallback_more']['reasons']} rarer reasons "
                       "(cut from the lines)")
        for key, n in sorted(s["errors"].items(), key=lambda kv: -kv[1]):
            out.append(f"    error {n}: {key}")
        if s.get("errors_more"):
            out.append(f"    error {s['errors_more']['calls']}: {s['errors_more']['reasons']} rarer kinds "
                       "(cut from the lines)")
        for f in s["foreign_layers"]:
            foreign.setdefault(f, []).append(name)
    if foreign:
        out.append("foreign layers seen:")
        out.extend(f"    {f} [{', '.join(names)}]" for f, names in foreign.items())
    return out
