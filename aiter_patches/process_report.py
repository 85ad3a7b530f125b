"""One summary per process, in the log, for servers that run many processes.

An inference server's tensor-parallel workers are separate processes that each
import AITER; a user needs to see, per process, whether the patches reached it.
After ``apply()`` and after a post-import hook applies a pending patch, the
core emits ``STATES_CHANGED`` (``core/events.py``); this module, subscribed to it,
runs ``log_if_changed()``, which logs two lines on the ``aiter_patches`` logger
when this process's patch states changed, at INFO once AITER is imported (at
DEBUG before: a server's helper processes that never import AITER stay quiet):

    aiter_patches: process 4242 [RANK=1 LOCAL_RANK=1] SpawnProcess-2 via run: applied 4 (...); ...
    aiter_patches status: {"pid": 4242, ...}

The first is for people; the second is one line of JSON that
``aiter-patches status --from-log FILE`` reads back (the last one per pid).
Command lines are never logged: they can hold secrets (API keys).
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
import sys
from typing import Any, Iterable, TextIO

from . import foreign_layers, log_records, registry, stats_log
from .core import events

log = logging.getLogger("aiter_patches")

MARKER = "aiter_patches status: "

# Rank variables set by torchrun, vLLM and SGLang launchers; reported when present.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TP_RANK", "DP_RANK",
                  "VLLM_DP_RANK", "SGLANG_DP_RANK")

_STATE_ORDER = ("applied", "check_failed", "skipped", "pending", "disabled", "inactive")

_via: list[str] = []
_last_logged: tuple | None = None


def note_start(via: str) -> None:
    """Record how the patches were switched on in this process (``run``, ``auto``, ``vllm_plugin``)."""
    if via not in _via:
        _via.append(via)


def log_if_changed() -> None:
    """Log the summary and status lines if this process's patch states changed since the last ones; never raises.

    Run after ``apply()`` and after a post-import hook applied a patch (the
    core's ``STATES_CHANGED``), and before each batch of stats lines. While
    another pending patch's modules are all imported its own hook is about to
    run: the summary waits for it, so one import of ``aiter.fused_moe`` gives
    one summary, not one per patch.
    """
    global _last_logged
    try:
        if registry.about_to_apply():
            return
        record = status_record()
        key = (record["pid"], json.dumps(record["patches"], sort_keys=True))
        if key == _last_logged:
            return
        _last_logged = key
        level = logging.INFO if record["aiter"]["imported"] else logging.DEBUG
        log.log(level, "%s", summary_line(record))
        log.log(level, "%s", status_line(record))
        if any(p["state"] == "applied" for p in record["patches"]):
            stats_log.ensure_started()  # the exit line, and the periodic ones if asked for
    except Exception:  # reporting must never break apply() or an import
        log.debug("aiter_patches: could not write the process summary", exc_info=True)


summary_after_fork = False  # set by bootstrap.start(): a forked child writes its own summary


def log_after_fork() -> None:
    """In a forked child that inherited applied or pending patches: its own summary (its pid differs).

    Run by the core's fork handler (``FORK_RESTART``), last: every lock of the
    package is fresh by then, so this never waits on a thread of the parent.
    """
    try:
        if any(p["state"] in ("applied", "pending") for p in registry.status()["patches"]):
            log_if_changed()
    except Exception:  # never in the way of a fork
        log.debug("aiter_patches: could not write the summary after fork", exc_info=True)


def _on_states_changed(cause: str) -> None:
    if cause != "revert":  # a revert writes no summary (the next apply or import does)
        log_if_changed()


def _on_fork_restart(inherited: dict) -> None:
    if summary_after_fork:
        log_after_fork()


events.subscribe(events.STATES_CHANGED, _on_states_changed)
events.subscribe(events.FORK_RESTART, _on_fork_restart)
stats_log.before_lines(log_if_changed)


def rank_env() -> dict[str, str]:
    return {k: os.environ[k] for k in RANK_VARIABLES if os.environ.get(k, "") != ""}


def _process_name() -> str | None:
    name = multiprocessing.current_process().name
    return None if name == "MainProcess" else name


def _title() -> str | None:
    """The process title a server set (SGLang: ``sglang::scheduler_TP0``), if setproctitle is loaded."""
    spt = sys.modules.get("setproctitle")
    try:
        return spt.getproctitle() if spt is not None else None
    except Exception:
        return None


def status_record() -> dict[str, Any]:
    """This process and the compact state of every patch: what the status line carries."""
    st = registry.status()
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "process": _process_name(),
        "title": _title(),
        "env": rank_env(),
        "via": list(_via) or ["apply"],
        "aiter": st["aiter"],
        "patches": [
            {
                "name": p["name"],
                "state": p["state"],
                "reason": p["reason"],
                # a disabled patch binds nothing: its declared targets are in SIGNATURES.md, not in each line
                "targets": [{"location": t["location"], "pin": t["pin"], "aliases": t["aliases"]}
                            for t in p["targets"]] if p["state"] != "disabled" else [],
                **({"foreign_layers": foreign_layers.short(p["foreign_layers"])} if p.get("foreign_layers") else {}),
            }
            for p in st["patches"]
        ],
    }


LINE_LIMIT = log_records.LINE_LIMIT
_dumps, _cut = log_records.dumps, log_records.cut


def _condense(record: dict[str, Any], step: int) -> dict[str, Any]:
    """Ever shorter versions of a record: fewer aliases and foreign layers, shorter reasons, no targets, shorter names."""
    keep_aliases = (2, 0, 0, 0)[step - 1]
    keep_foreign = (4, 1, 0, 0)[step - 1]
    reason_len = (240, 240, 120, 60)[step - 1]
    out = dict(record, condensed=True)
    out["patches"] = []
    for p in record["patches"]:
        q = dict(p, reason=_cut(p.get("reason", ""), reason_len))
        foreign = p.get("foreign_layers") or []
        if len(foreign) > keep_foreign:
            q["foreign_layers"] = [_cut(f, 200) for f in foreign[:keep_foreign]]
            q["foreign_layers_more"] = len(foreign) - keep_foreign + p.get("foreign_layers_more", 0)
        if step >= 3:
            q.pop("targets", None)
        else:
            q["targets"] = []
            for t in p.get("targets", []):
                aliases = t.get("aliases") or []
                t = dict(t, aliases=aliases[:keep_aliases])
                if len(aliases) > keep_aliases:
                    t["aliases_more"] = len(aliases) - keep_aliases
                q["targets"].append(t)
        out["patches"].append(q)
    if step >= 4:
        out["title"], out["process"] = _cut(record.get("title"), 40), _cut(record.get("process"), 40)
        out["aiter"] = {k: _cut(v, 80) for k, v in (record.get("aiter") or {}).items()}
    return out


def status_line(record: dict[str, Any], limit: int = LINE_LIMIT) -> str:
    """The status line for a record, condensed (``"condensed": true``) until it fits in ``limit`` bytes."""
    line = MARKER + _dumps(record)
    step = 1
    while len(line.encode()) > limit and step <= 4:
        line = MARKER + _dumps(_condense(record, step))
        step += 1
    return line


def _aliases(record: dict[str, Any]) -> list[str]:
    seen = {a for p in record.get("patches", []) if p["state"] == "applied"
            for t in p.get("targets", []) for a in t.get("aliases", [])}
    return sorted(seen)


def _waiting_for(record: dict[str, Any]) -> list[str]:
    mods: list[str] = []
    for p in record.get("patches", []):
        if p["state"] == "pending" and p.get("reason", "").startswith("waiting for import of "):
            for m in p["reason"][len("waiting for import of "):].split(", "):
                if m not in mods:
                    mods.append(m)
    return mods


def summary_line(record: dict[str, Any]) -> str:
    """The human line: who this process is, and the patches by state."""
    who = f"process {record['pid']}"
    if record.get("env"):
        who += " [" + " ".join(f"{k}={v}" for k, v in record["env"].items()) + "]"
    for extra in (record.get("process"), record.get("title")):
        if extra:
            who += f" {extra}"
    who += " via " + "+".join(record.get("via") or ["?"])
    parts = []
    for state in _STATE_ORDER:
        names = [p["name"] for p in record.get("patches", []) if p["state"] == state]
        if not names or state == "inactive":
            continue
        text = f"{state} {len(names)} ({', '.join(names)})"
        if state == "pending":
            text += f" waiting for import of {', '.join(_waiting_for(record))}"
        parts.append(text)
    body = "; ".join(parts) or "no patch requested"
    foreign = _foreign(record)
    foreign_more = sum(p.get("foreign_layers_more", 0) for p in record.get("patches", [])
                       if p["state"] == "applied" and isinstance(p.get("foreign_layers_more", 0), int))
    if foreign or foreign_more:
        shown = list(foreign)
        half = LINE_LIMIT // 2  # the rest is left for the aliases

        def text(shown: list[str]) -> str:
            more = len(foreign) - len(shown) + foreign_more
            return "; foreign layers: " + " ".join(filter(None, ["; ".join(shown), f"(+{more} more)" if more else ""]))

        base = len(f"aiter_patches: {who}: {body}; foreign layers: ".encode())

        def size(k: int, joined: int) -> int:
            more = len(foreign) - k + foreign_more
            tail = len(f"(+{more} more)") if more else 0
            return base + joined + tail + (1 if k and tail else 0)

        del shown[_fit(shown, "; ", size, half):]
        body += text(shown)
    aliases = _aliases(record)
    head = f"aiter_patches: {who}: {body}"
    if aliases:
        base = len(f"{head}; rebound aliases: ".encode()) + len(f" (+{len(aliases)} more)")
        shown = aliases[:_fit(aliases, ", ", lambda k, joined: base + joined, LINE_LIMIT)]
        more = f" (+{len(aliases) - len(shown)} more)" if len(shown) < len(aliases) else ""
        head += f"; rebound aliases: {', '.join(shown)}{more}"
    return head


def _fit(items: list[str], sep: str, size, limit: int) -> int:
    """The largest ``k`` whose ``size(k, bytes of sep.join(items[:k]))`` is within ``limit`` (0 when none): what
    dropping the last item until the line fits gives, in time linear in the items (issue 35: a record of
    40,000 foreign layers or 60,000 aliases made that loop quadratic)."""
    ends, total, gap = [0], 0, len(sep.encode())
    for x in items:
        total += len(x.encode())
        ends.append(total)
    for k in range(len(items), 0, -1):
        if size(k, ends[k] + gap * (k - 1)) <= limit:
            return k
    return 0


def _foreign(record: dict[str, Any]) -> list[str]:
    """Each foreign layer once: "outer sglang.x on aiter.fused_moe.fused_moe (moe_sort_mx_quant, ...)"."""
    by_layer: dict[str, list[str]] = {}
    for p in record.get("patches", []):
        for text in p.get("foreign_layers", []) if p["state"] == "applied" else []:
            by_layer.setdefault(text, []).append(p["name"])
    return [f"{head} ({', '.join(names)})" for head, names in by_layer.items()]


# ---------------------------------------------------------------- reading a log back

def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _well_shaped(record: dict[str, Any]) -> bool:
    """The fields ``summary_line`` and ``--json`` readers rely on have the types a status line writes."""
    patches = record.get("patches")
    if not isinstance(patches, list):
        return False
    for p in patches:
        if not (isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("state"), str)
                and isinstance(p.get("reason", ""), str) and isinstance(p.get("targets", []), list)
                and _is_str_list(p.get("foreign_layers", []))
                and log_records.is_count(p.get("foreign_layers_more", 0))):
            return False
        for t in p.get("targets", []):
            if not (isinstance(t, dict) and _is_str_list(t.get("aliases", []))):
                return False
    env = record.get("env", {})
    if not (isinstance(env, dict) and all(isinstance(k, str) for k in env)):
        return False
    if not _is_str_list(record.get("via", [])):
        return False
    return all(isinstance(record.get(k), (str, type(None))) for k in ("process", "title"))


def scan_log(lines: Iterable[str]) -> tuple[list[dict[str, Any]], int]:
    """The last status record of each pid in a log, in the order the pids first appear, and how many records
    were skipped for an unexpected shape.

    The marker may follow any prefix a server's log format adds, and may occur
    several times on one line (a process's line cut short, then another's
    whole line): every occurrence is read on its own (``log_records.marked``).
    JSON nested too deep to decode is skipped and counted like a record of an
    unexpected shape.
    """
    latest: dict[int, dict[str, Any]] = {}
    odd = 0
    for record, too_deep in log_records.marked(lines, MARKER):
        pid = log_records.int_field(record, "pid")
        if too_deep or (pid is not None and not _well_shaped(record)):
            odd += 1
        elif pid is not None:
            latest[pid] = record  # dict keeps first-insertion order
    return list(latest.values()), odd


def _open_log(path: str) -> TextIO:
    """The log as text, bytes that are not UTF-8 replaced, from a file or from stdin (``kubectl logs ... | ``):
    stdin's own text layer is strict, and one stray byte made its read raise (found by issue 35's fuzz pass)."""
    if path != "-":
        return open(path, encoding="utf-8", errors="replace")
    raw = getattr(sys.stdin, "buffer", None)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace") if raw is not None else sys.stdin


def print_log_status(path: str, *, as_json: bool) -> int:
    """``aiter-patches status --from-log PATH``: 0 when the log has status lines, 1 when it has none, 2 if unreadable."""
    try:
        stream = _open_log(path)
    except OSError as exc:
        print(f"cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        lines = list(stream)
    finally:
        if path != "-":
            stream.close()
        elif stream is not sys.stdin:
            stream.detach()  # stdin's own buffer stays open
    records, odd = scan_log(lines)
    stats_records, odd_stats = stats_log.scan_stats(lines)
    if odd or odd_stats:
        what = [f"{n} {kind} record(s)" for n, kind in ((odd, "status"), (odd_stats, "stats")) if n]
        print(f"warning: skipped {' and '.join(what)} of an unexpected shape in {path}", file=sys.stderr)
    sums = stats_log.summed(stats_records)
    if not records:
        print(f"no '{MARKER.strip()}' lines in {path}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps({"processes": records, "stats": sums}, indent=2, default=str))
        return 0
    for record in records:
        _print(summary_line(record).removeprefix("aiter_patches: "))
    if sums:
        _print("counts (the latest stats line of each process, summed):")
        for text in stats_log.render(sums):
            _print("  " + text)
    return 0


def _print(text: str) -> None:
    """``text`` on stdout, what its encoding cannot write as escapes: JSON's ``"\\ud800"`` decodes to a lone
    surrogate, which a UTF-8 stdout refuses (a traceback, found by issue 35's fuzz pass)."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    print(text.encode(encoding, "backslashreplace").decode(encoding))
