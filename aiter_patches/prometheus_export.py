"""The patches' counters on the server's own Prometheus ``/metrics``, when ``prometheus_client`` is importable.

Why: an operator of vLLM or SGLang watches ``/metrics``, not our log lines. Both servers ship
``prometheus_client``; where it is importable, each process that applied a patch exports, per patch, the
counters ``stats()`` keeps (docs/metrics.md):

    aiter_patches_fast_calls_total{patch}                   calls that took the fast path
    aiter_patches_fallback_calls_total{patch,reason}        calls handed to AITER, by reason
    aiter_patches_errors_total{patch,kind}                  fast paths that raised (then AITER ran)
    aiter_patches_self_check_calls_total{patch,result}      self-checked calls, result passed or failed

The hot path is untouched: a patched call counts in its ``PatchCounters`` as before, and nothing here runs
per call. Two ways out, chosen once per process when a patch first applies (the core's ``STATES_CHANGED``):

- **One process** (no ``PROMETHEUS_MULTIPROC_DIR``): a collector on ``prometheus_client``'s default
  ``REGISTRY`` reads the counters at scrape time.
- **Multiprocess mode** (``PROMETHEUS_MULTIPROC_DIR`` set, as SGLang's ``--enable-metrics`` does): a
  collector does not cross processes, so this module keeps ``prometheus_client`` ``Counter`` objects,
  whose values live in the dir's per-process files, and adds our counters' growth to them every
  ``AITER_PATCHES_PROMETHEUS_INTERVAL`` seconds (default 15) from a daemon thread, and at exit. The
  server's ``MultiProcessCollector`` sums the files of all its processes.

A forked child counts only its own calls (the counts it inherited at the fork are subtracted, as the stats
lines do) and restarts its thread (``FORK_RESTART``); ``prometheus_client`` itself moves a forked child to
its own file. ``AITER_PATCHES_PROMETHEUS=0`` turns the export off. Without ``prometheus_client`` nothing is
set up. ``import aiter_patches`` never imports ``prometheus_client`` (tests/test_import_cost.py): it is
imported when a patch applies, and only if ``importlib.util.find_spec`` finds it. Nothing here raises into
its caller: reporting must never break a server.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import threading
from typing import Any, Iterator

from . import env_flags, periodic, registry
from .core import events

log = logging.getLogger("aiter_patches")

SWITCH_ENV = "AITER_PATCHES_PROMETHEUS"
INTERVAL_ENV = "AITER_PATCHES_PROMETHEUS_INTERVAL"
DEFAULT_INTERVAL_S = 15.0
MAX_INTERVAL_S = 365 * 86400.0  # threading.TIMEOUT_MAX's platforms (as stats_log)
MULTIPROC_ENVS = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")  # prometheus_client reads both
FORK_WAIT_S = 1.0  # how long a fork waits for a push in progress (as the core's fork handler)

FAST = "aiter_patches_fast_calls"
FALLBACK = "aiter_patches_fallback_calls"
ERRORS = "aiter_patches_errors"
CHECKS = "aiter_patches_self_check_calls"
HELP = {
    FAST: "Calls of an aiter_patches patch that took its fast path",
    FALLBACK: "Calls of an aiter_patches patch handed to AITER's own path, by reason",
    ERRORS: "Fast paths of an aiter_patches patch that raised (AITER's path ran instead), by kind",
    CHECKS: "Calls of an aiter_patches patch compared with AITER's (the self-check): result passed or failed",
}
LABELS = {FAST: ("patch",), FALLBACK: ("patch", "reason"), ERRORS: ("patch", "kind"), CHECKS: ("patch", "result")}

# What this process does: None until a patch first applies, then one of these.
OFF = "off"  # AITER_PATCHES_PROMETHEUS=0
UNAVAILABLE = "unavailable"  # prometheus_client is not importable
COLLECTOR = "collector"  # one process: read at scrape time
MULTIPROCESS = "multiprocess"  # Counters in PROMETHEUS_MULTIPROC_DIR, pushed
FAILED = "failed"  # setting up raised (logged at DEBUG)

_lock = threading.Lock()  # set-up and pushes
_mode: str | None = None
_collector: Any = None
_counters: dict[str, Any] = {}  # metric name -> prometheus_client Counter (multiprocess mode)
_pushed: dict[str, dict[str, Any]] = {}  # per patch, this process's counts already added to the Counters
_baseline: dict[str, dict[str, Any]] = {}  # per patch, the counts inherited through fork
_started_pid: int | None = None
_atexit_registered = False
_periodic = periodic.Periodic("aiter_patches-prometheus", lambda: push())
_fork = threading.local()


def mode() -> str | None:
    """What this process exports through: None (no patch applied yet), ``off``, ``unavailable``,
    ``collector``, ``multiprocess`` or ``failed``."""
    return _mode


def interval() -> float:
    """Seconds between pushes in multiprocess mode (``AITER_PATCHES_PROMETHEUS_INTERVAL``, default 15)."""
    return env_flags.positive_number(INTERVAL_ENV, DEFAULT_INTERVAL_S, maximum=MAX_INTERVAL_S, unit="seconds")


def multiproc_dir() -> str | None:
    """The dir of ``prometheus_client``'s multiprocess mode, if set (either spelling it reads)."""
    return next((os.environ[k] for k in MULTIPROC_ENVS if os.environ.get(k)), None)


# ---------------------------------------------------------------- this process's counts

def _minus(now: dict[str, int], base: dict[str, int]) -> dict[str, int]:
    return {k: max(v - base.get(k, 0), 0) for k, v in now.items()}


def own_counts() -> dict[str, dict[str, Any]]:
    """Per patch applied (or with calls counted), this process's counts since its start or its fork.

    Read from each patch's counters directly (not ``stats()``, which also scans for foreign layers).
    """
    out = {}
    for p in registry.patches():
        snap = registry.counters(p.name).snapshot()
        base = _baseline.get(p.name, {})
        own = {
            "fast": max(snap["fast"] - base.get("fast", 0), 0),
            "checks_passed": max(snap["checks_passed"] - base.get("checks_passed", 0), 0),
            "checks_failed": max(snap["checks_failed"] - base.get("checks_failed", 0), 0),
            "fallback": _minus(snap["fallback"], base.get("fallback", {})),
            "errors": _minus(snap["errors"], base.get("errors", {})),
        }
        counted = own["fast"] or own["checks_passed"] or own["checks_failed"] or any(own["fallback"].values()) \
            or any(own["errors"].values())
        if counted or registry.state(p.name) in (registry.APPLIED, registry.CHECK_FAILED):
            out[p.name] = own
    return out


def _samples(counts: dict[str, dict[str, Any]]) -> Iterator[tuple[str, tuple[str, ...], int]]:
    """(metric, label values, value) for each series of ``counts``."""
    for name, c in counts.items():
        yield FAST, (name,), c["fast"]
        for reason, n in c["fallback"].items():
            yield FALLBACK, (name, reason), n
        for kind, n in c["errors"].items():
            yield ERRORS, (name, kind), n
        yield CHECKS, (name, "passed"), c["checks_passed"]
        yield CHECKS, (name, "failed"), c["checks_failed"]


# ---------------------------------------------------------------- one process: a collector

class Collector:
    """Reads this process's counters when ``prometheus_client`` collects (at each scrape)."""

    def _families(self) -> dict[str, Any]:
        from prometheus_client.core import CounterMetricFamily

        return {m: CounterMetricFamily(m, HELP[m], labels=list(LABELS[m])) for m in (FAST, FALLBACK, ERRORS, CHECKS)}

    def describe(self):
        """The names only, so registering reads no counter."""
        return list(self._families().values())

    def collect(self):
        families = self._families()
        try:
            for metric, labels, value in _samples(own_counts()):
                families[metric].add_metric(list(labels), value)
        except Exception:  # a scrape must never fail because of us
            log.debug("aiter_patches: could not read the counters for Prometheus", exc_info=True)
            families = self._families()
        return list(families.values())


# ---------------------------------------------------------------- multiprocess mode: pushes

def push() -> None:
    """Multiprocess mode: add this process's counts since the last push to the Counters; never raises."""
    try:
        with _lock:
            if _mode != MULTIPROCESS or _started_pid != os.getpid():
                return
            now = {}
            for metric, labels, value in _samples(own_counts()):
                now[(metric, labels)] = value
                before = _pushed.get((metric, labels))
                child = _counters[metric].labels(*labels)  # created at 0 the first time: the series appears
                if before is None or value >= before:
                    delta = value - (before or 0)
                else:  # reset_stats() ran: what was counted since the reset
                    delta = value
                if delta > 0:
                    child.inc(delta)
            _pushed.clear()
            _pushed.update(now)
    except Exception:
        log.debug("aiter_patches: could not push the counters to Prometheus", exc_info=True)


def _start_thread() -> None:
    _periodic.start(interval())


def stop_thread() -> None:
    """Stop this process's push thread (tests, and at exit)."""
    _periodic.stop()


def _at_exit() -> None:
    if _mode == MULTIPROCESS and _started_pid == os.getpid():
        stop_thread()
        push()


# ---------------------------------------------------------------- set-up

def ensure_started() -> None:
    """Once per process, when a patch applied: choose the mode and set it up. Never raises."""
    global _mode
    if _mode is not None:
        return
    with _lock:
        if _mode is not None:
            return
        try:
            _mode = _set_up()
        except Exception:
            _mode = FAILED
            log.debug("aiter_patches: could not set up the Prometheus export", exc_info=True)


def _set_up() -> str:
    global _collector, _started_pid, _atexit_registered
    if env_flags.env_false(SWITCH_ENV):
        return OFF
    try:
        found = importlib.util.find_spec("prometheus_client") is not None
    except (ImportError, ValueError):  # a parent package that fails, or a module whose __spec__ is None
        found = False
    if not found:
        return UNAVAILABLE
    import prometheus_client
    from prometheus_client import values

    value_class = values.ValueClass
    in_files = getattr(value_class, "_multiprocess", value_class is not values.MutexValue)
    if multiproc_dir() is None or not in_files:
        if multiproc_dir() is not None:
            log.debug("aiter_patches: PROMETHEUS_MULTIPROC_DIR is set but prometheus_client was imported before "
                      "it was: this process's counters are on its own registry only")
        _collector = Collector()
        prometheus_client.REGISTRY.register(_collector)
        return COLLECTOR
    for metric in (FAST, FALLBACK, ERRORS, CHECKS):
        try:
            _counters[metric] = prometheus_client.Counter(metric, HELP[metric], LABELS[metric])
        except ValueError:  # the name is taken on the default registry (our module imported twice): files only
            _counters[metric] = prometheus_client.Counter(metric, HELP[metric], LABELS[metric], registry=None)
    _started_pid = os.getpid()
    if not _atexit_registered:
        atexit.register(_at_exit)
        _atexit_registered = True
    _start_thread()
    return MULTIPROCESS


def _on_states_changed(cause: str) -> None:
    if cause == "revert":
        return
    try:
        if _mode is None and any(registry.state(p.name) == registry.APPLIED for p in registry.patches()):
            ensure_started()
        if _mode == MULTIPROCESS:
            push()  # a newly applied patch's series appear at 0 now, not at the next interval
    except Exception:
        log.debug("aiter_patches: could not start the Prometheus export", exc_info=True)


# ---------------------------------------------------------------- fork

def _before_fork() -> None:
    """No push in progress at the fork: ``prometheus_client``'s multiprocess values share one plain lock, which
    a push holding it at the fork would leave held in the child for every metric of the server."""
    lock = _lock
    _fork.lock = lock if lock.acquire(timeout=FORK_WAIT_S) else None


def _after_fork_in_parent() -> None:
    lock, _fork.lock = getattr(_fork, "lock", None), None
    if lock is not None:
        lock.release()


def _renew_after_fork() -> None:
    """``FORK_RENEW``: a fresh lock; the parent's thread is gone."""
    global _lock
    _fork.lock = None
    _lock = threading.Lock()
    _periodic.forget()


def _restart_after_fork(inherited: dict[str, dict[str, Any]]) -> None:
    """``FORK_RESTART``: the child counts from the counts it inherited; in multiprocess mode its Counters start
    at 0 in its own file (``prometheus_client`` moves it there at its first use), and its thread starts."""
    global _started_pid
    _baseline.clear()
    _baseline.update(inherited)
    _pushed.clear()
    try:
        if _mode == MULTIPROCESS:
            _started_pid = os.getpid()  # the exit handler is inherited
            _start_thread()
    except Exception:  # never in the way of a fork
        log.debug("aiter_patches: could not restart the Prometheus push after fork", exc_info=True)


events.subscribe(events.STATES_CHANGED, _on_states_changed)
events.subscribe(events.FORK_RENEW, _renew_after_fork)
events.subscribe(events.FORK_RESTART, _restart_after_fork)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent)


def _reset_for_tests() -> None:
    """Take the export down in this process (tests): the collector off the default registry, no thread."""
    global _mode, _collector, _started_pid
    stop_thread()
    if _collector is not None:
        try:
            import prometheus_client

            prometheus_client.REGISTRY.unregister(_collector)
        except Exception:
            pass
    _mode, _collector, _started_pid = None, None, None
    _counters.clear()
    _pushed.clear()
    _baseline.clear()
