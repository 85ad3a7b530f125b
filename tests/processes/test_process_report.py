"""The per-process summary and status lines, in this process, and reading them back from a log."""

import json
import logging
import subprocess
import sys

import pytest

import aiter_patches
from aiter_patches import process_report
from aiter_patches.testing import use_stub_aiter

from .procs import ROOT

SUMMARY = "aiter_patches: process "


@pytest.fixture
def fresh_report(monkeypatch):
    monkeypatch.setattr(process_report, "_last_logged", None)
    monkeypatch.setattr(process_report, "_via", [])


def lines(caplog, prefix):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


def test_one_summary_when_pending_patches_apply_at_import(fresh_report, caplog, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with caplog.at_level(logging.INFO, logger="aiter_patches"), use_stub_aiter():
        aiter_patches.apply()  # aiter is imported, aiter.fused_moe not yet
        first = lines(caplog, SUMMARY)
        import aiter.fused_moe  # noqa: F401  (three pending patches apply here, one hook each)

        after = lines(caplog, SUMMARY)
        aiter_patches.apply()  # changes nothing: no new line
        assert lines(caplog, SUMMARY) == after
        final = process_report.status_record()
    assert len(first) == 1 and "applied 1 (gemm_out_zeroed)" in first[0]
    assert "pending 3 (moe_addend_fold, sort_extension, moe_sort_mx_quant) waiting for import of aiter.fused_moe" \
        in first[0]
    assert len(after) == 2, after
    assert "[RANK=3]" in after[1] and "via apply" in after[1]
    assert "applied 4 (moe_addend_fold, sort_extension, moe_sort_mx_quant, gemm_out_zeroed)" in after[1]
    statuses = lines(caplog, process_report.MARKER)
    assert len(statuses) == 2
    assert process_report.read_log(statuses) == [final]


def test_a_process_without_aiter_logs_at_debug_only(fresh_report, caplog):
    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        aiter_patches.apply()
    (record,) = [r for r in caplog.records if r.getMessage().startswith(SUMMARY)]
    assert record.levelno == logging.DEBUG and "pending 4" in record.getMessage()


def test_skipped_and_disabled_are_named(fresh_report, caplog, monkeypatch):
    monkeypatch.setenv("AITER_PATCHES_DISABLE", "gemm_out_zeroed")
    with caplog.at_level(logging.INFO, logger="aiter_patches"), use_stub_aiter():
        import aiter.fused_moe as fm

        monkeypatch.setattr(fm, "_moe_sorting_impl", lambda topk_ids, other: None)  # a drifted signature
        aiter_patches.apply()
        monkeypatch.undo()
    (line,) = lines(caplog, SUMMARY)
    assert "skipped 3 (moe_addend_fold, sort_extension, moe_sort_mx_quant)" in line
    assert "disabled 1 (gemm_out_zeroed)" in line


def test_read_log_takes_the_last_line_per_pid_after_any_prefix():
    def status(pid, state):
        return process_report.MARKER + json.dumps({"pid": pid, "patches": [{"name": "p", "state": state}]})

    log = [
        "INFO 01-02 10:00:00 [loader.py:1] " + status(10, "pending"),
        "(VllmWorker rank=1 pid=11) INFO " + status(11, "applied"),
        "garbage " + process_report.MARKER + "{not json",
        status(12, "applied")[:40],  # a line cut short
        "[2025-01-02 TP0] " + status(10, "applied") + " trailing text",
        process_report.MARKER + json.dumps(["no", "pid"]),
    ]
    got = process_report.read_log(log)
    assert [(r["pid"], r["patches"][0]["state"]) for r in got] == [(10, "applied"), (11, "applied")]


def _status_from_log(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "aiter_patches", "status", "--from-log", *args],
                          capture_output=True, text=True, cwd=ROOT, input=stdin, timeout=60)


def test_status_from_log_cli(tmp_path, fresh_report, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")
    record = process_report.status_record()
    log = f"noise\nINFO {process_report.MARKER}{json.dumps(record)}\n"
    path = tmp_path / "server.log"
    path.write_text(log)
    as_json = _status_from_log(str(path), "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == {"processes": [record], "stats": {}}
    text = _status_from_log("-", stdin=log)
    assert text.returncode == 0
    assert text.stdout.strip() == process_report.summary_line(record).removeprefix("aiter_patches: ")
    assert "LOCAL_RANK=5" in text.stdout
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    none = _status_from_log(str(empty))
    assert none.returncode == 1 and "no 'aiter_patches status:' lines" in none.stderr
    missing = _status_from_log(str(tmp_path / "missing.log"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
