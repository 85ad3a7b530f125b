"""Reading a server log back, for tests: the last status record per pid, the latest stats record per (pid, patch)."""

from __future__ import annotations

from typing import Any, Iterable

from aiter_patches import process_report, stats_log


def read_log(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The last status record of each pid in a log (see ``process_report.scan_log``)."""
    return process_report.scan_log(lines)[0]


def read_stats(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The latest stats record of each (pid, patch) in a log (see ``stats_log.scan_stats``)."""
    return stats_log.scan_stats(lines)[0]
