"""The per-process summary and status lines, in this process, and reading them back from a log."""

import importlib
import json
import logging
import subprocess
import sys

import pytest

import aiter_patches
from aiter_patches import process_report
from helpers.standin import use_stub_aiter
from helpers import registry_view
from helpers.logs import read_log

from .procs import ROOT

SUMMARY = "aiter_patches: process "


@pytest.fixture
def fresh_report(monkeypatch):
    monkeypatch.setattr(process_report, "_last_logged", None)
    monkeypatch.setattr(process_report, "_via", [])


def lines(caplog, prefix):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


def _by_state(names, state_of, state):
    return [n for n in names if state_of[n] == state]


def _listed(state, names):
    return f"{state} {len(names)} ({', '.join(names)})"


def test_one_summary_when_pending_patches_apply_at_import(fresh_report, caplog, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    names = registry_view.names()
    with caplog.at_level(logging.INFO, logger="aiter_patches"), use_stub_aiter():
        aiter_patches.apply()  # aiter is imported, its submodules the package does not import are not
        before = registry_view.expected_before_import()
        loaded = {n for n in names if all(m in sys.modules for m in registry_view.modules(n))}
        first_states = {n: ("applied" if before[n] == "pending" and n in loaded  # an opt-in one stays disabled
                            else before[n])
                        for n in names}
        first = lines(caplog, SUMMARY)
        waiting = sorted({m for n in _by_state(names, first_states, "pending") for m in registry_view.modules(n)
                          if registry_view.on_stand_in(m)})
        assert waiting, "the set-up must leave a patch pending on a stand-in module"
        for m in waiting:  # the pending patches apply here, one hook each, one summary for the import
            importlib.import_module(m)

        after = lines(caplog, SUMMARY)
        aiter_patches.apply()  # changes nothing: no new line
        assert lines(caplog, SUMMARY) == after
        final = process_report.status_record()
    assert len(first) == 1 and _listed("applied", _by_state(names, first_states, "applied")) in first[0]
    pending_first = _by_state(names, first_states, "pending")
    assert _listed("pending", pending_first) in first[0] and "waiting for import of " in first[0]
    assert len(after) == 1 + len(waiting), after
    assert "[RANK=3]" in after[-1] and "via apply" in after[-1]
    expected = registry_view.expected_on_stand_in()
    assert _listed("applied", _by_state(names, expected, "applied")) in after[-1]
    statuses = lines(caplog, process_report.MARKER)
    assert len(statuses) == len(after)
    assert read_log(statuses) == [final]


def test_a_process_without_aiter_logs_at_debug_only(fresh_report, caplog):
    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        aiter_patches.apply()
    (record,) = [r for r in caplog.records if r.getMessage().startswith(SUMMARY)]
    pending = [n for n, st in registry_view.expected_before_import().items() if st == "pending"]
    assert record.levelno == logging.DEBUG and f"pending {len(pending)}" in record.getMessage()


def test_skipped_and_disabled_are_named(fresh_report, caplog, monkeypatch):
    names = registry_view.names()
    shared = registry_view.shared_location()
    victims = [n for n in registry_view.stand_in_names() if shared in registry_view.locations(n)]
    bystander = next(n for n in registry_view.stand_in_names() if n not in victims)
    monkeypatch.setenv("AITER_PATCHES_DISABLE", bystander)
    module, attr = shared.rsplit(".", 1)
    with caplog.at_level(logging.INFO, logger="aiter_patches"), use_stub_aiter():
        for n in victims:
            for m in registry_view.modules(n):
                importlib.import_module(m)
        monkeypatch.setattr(sys.modules[module], attr, lambda topk_ids, other: None)  # a drifted signature
        aiter_patches.apply()
        monkeypatch.undo()
    (line,) = lines(caplog, SUMMARY)
    assert _listed("skipped", victims) in line
    assert _listed("disabled", [n for n in names if n == bystander or registry_view.opt_in_off(n)]) in line


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
    got = read_log(log)
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


def _status(pid, state="applied", **extra):
    return process_report.MARKER + json.dumps({"pid": pid, "patches": [{"name": "p", "state": state}], **extra})


@pytest.mark.parametrize("cut", [5, 19, 30, -2])
def test_a_cut_status_line_followed_on_the_same_line_by_another_loses_neither(cut):
    first = _status(21, reason_text="x" * 40, title="a title")
    log = [
        "INFO " + first,
        "INFO " + first[:cut] + "INFO " + _status(22, "pending"),  # 21's second line cut short, then 22's whole line
        "INFO " + _status(23) + " INFO " + _status(24),  # two whole lines run together
    ]
    got = {r["pid"]: r["patches"][0]["state"] for r in read_log(log)}
    assert got == {21: "applied", 22: "pending", 23: "applied", 24: "applied"}


def test_a_record_that_swallows_the_next_marker_is_not_taken():
    swallowing = process_report.MARKER + '{"pid": 31, "patches": [], "title": "cut ' + _status(32) + '"}'
    got = [r["pid"] for r in read_log([swallowing])]
    assert got == [32]


def test_status_and_summary_lines_stay_under_the_atomic_pipe_write(fresh_report, caplog, monkeypatch):
    record = process_report.status_record()
    many = [f"sglang.srt.layers.moe.module_{i:03d}.fused_moe" for i in range(120)]
    for p in record["patches"]:
        p["state"], p["reason"] = "applied", "signature drifted (" + "missing parameter 'x'; " * 40 + ")"
        p["targets"] = [{"location": "aiter.fused_moe.fused_moe", "pin": "v0.1.20", "aliases": many}]
    record["aiter"]["imported"] = True
    monkeypatch.setattr(process_report, "status_record", lambda: record)
    with caplog.at_level(logging.INFO, logger="aiter_patches"):
        process_report.log_if_changed()
    written = [r.getMessage() for r in caplog.records]
    assert len(written) == 2
    for line in written:
        assert len(("INFO " + line + "\n").encode()) <= 4096 - 512, len(line)
    (back,) = read_log(written)
    assert back["condensed"] is True and back["pid"] == record["pid"]
    assert [(p["name"], p["state"]) for p in back["patches"]] == [(p["name"], p["state"]) for p in record["patches"]]
    assert "more)" in written[0], "the summary says how many aliases it left out"


ODD_SHAPES = {
    "patches null": {"patches": None},
    "patches {}": {"patches": {}},
    "patches [{}]": {"patches": [{}]},
    "env not an object": {"env": "RANK=1"},
    "via a number": {"via": 3},
    "targets not a list": {"patches": [{"name": "p", "state": "applied", "targets": 5}]},
}


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=list(ODD_SHAPES))
def test_status_from_log_skips_odd_shaped_records_and_counts_them(tmp_path, shape):
    good = {"pid": 41, "patches": [{"name": "p", "state": "applied"}], "via": ["run"]}
    odd = {**good, "pid": 42, **ODD_SHAPES[shape]}
    path = tmp_path / "server.log"
    path.write_text("".join(f"INFO {process_report.MARKER}{json.dumps(r)}\n" for r in (good, odd, odd)))
    for args in ((str(path),), (str(path), "--json")):
        proc = _status_from_log(*args)
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr
        assert "skipped 2 status record(s) of an unexpected shape" in proc.stderr
        assert "process 41 " in proc.stdout or '"pid": 41' in proc.stdout
        assert "42" not in proc.stdout


STATS_MARKER = "aiter_patches stats: "
GARBAGE = {
    "stats foreign_layers a number": f'{STATS_MARKER}{{"pid":41,"patch":"p","fast":1,"foreign_layers":7}}',
    "stats fallback a list": f'{STATS_MARKER}{{"pid":41,"patch":"p","fast":1,"fallback":[1]}}',
    "stats fast a string": f'{STATS_MARKER}{{"pid":41,"patch":"p","fast":"9"}}',
    "status nested too deep": process_report.MARKER + "[" * 200000,
    "stats nested too deep": STATS_MARKER + "[" * 200000,
}


@pytest.mark.parametrize("garbage", GARBAGE, ids=list(GARBAGE))
def test_status_from_log_skips_garbage_records_and_counts_them_in_one_warning(tmp_path, garbage):
    good = {"pid": 41, "patches": [{"name": "p", "state": "applied"}], "via": ["run"]}
    good_stats = f'{STATS_MARKER}{{"pid":43,"patch":"p","fast":5}}'
    path = tmp_path / "server.log"
    path.write_text(f"INFO {process_report.MARKER}{json.dumps(good)}\nINFO {good_stats}\nINFO {GARBAGE[garbage]}\n")
    for args in ((str(path),), (str(path), "--json")):
        proc = _status_from_log(*args)
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr
        warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
        kind = garbage.split()[0]
        assert warnings == [f"warning: skipped 1 {kind} record(s) of an unexpected shape in {path}"]
        assert "process 41 " in proc.stdout or '"pid": 41' in proc.stdout
        assert "5 fast-path hits" in proc.stdout or '"fast": 5' in proc.stdout


def test_many_foreign_layers_keep_the_status_and_summary_lines_under_the_limit(tmp_path, monkeypatch):
    """48 server modules alias a patched function and a tracing library wraps each alias (functools.wraps)."""
    import functools

    from aiter_patches import registry
    from aiter_patches.registry import Patch, Target
    from aiter_patches.signatures import Pin

    pkg = tmp_path / "_aiter_patches_test_srv" / "model_executor" / "layers" / "fused_moe"
    pkg.mkdir(parents=True)
    for d in (pkg, *pkg.parents):
        if d == tmp_path:
            break
        (d / "__init__.py").write_text("")
    (tmp_path / "_aiter_patches_test_fm.py").write_text("def f(x):\n    return x\n")
    for i in range(48):
        (pkg / f"backend_{i:02d}.py").write_text("from _aiter_patches_test_fm import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    importlib.import_module("_aiter_patches_test_fm")
    mods = [importlib.import_module(f"_aiter_patches_test_srv.model_executor.layers.fused_moe.backend_{i:02d}")
            for i in range(48)]

    def factory(inner, site):
        def wrapper(*a, **k):
            return inner(*a, **k)
        return wrapper

    registry.register(Patch("t_long", "t_long", (Target("_aiter_patches_test_fm", "f",
                                                         (Pin("v1", "(x)", "test"),), factory),)))
    try:
        assert registry.apply(["t_long"])["t_long"]["state"] == "applied"
        for m in mods:
            m.f = functools.wraps(m.f)(lambda *a, _o=m.f, **k: _o(*a, **k))
        record = process_report.status_record()
        assert len(next(p for p in record["patches"] if p["name"] == "t_long")["foreign_layers"]) == 48
        line = process_report.status_line(record)
        assert len(line.encode()) <= process_report.LINE_LIMIT and '"condensed":true' in line
        back = json.loads(line.removeprefix(process_report.MARKER))
        p = next(p for p in back["patches"] if p["name"] == "t_long")
        assert len(p["foreign_layers"]) + p["foreign_layers_more"] == 48
        assert read_log([f"INFO {line}"])  # still a well-shaped record
        summary = process_report.summary_line(record)
        assert len(summary.encode()) <= process_report.LINE_LIMIT
        assert "more)" in summary.split("; rebound aliases:")[0]
    finally:
        registry.unregister("t_long")
        for name in [n for n in sys.modules if n.startswith("_aiter_patches_test_")]:
            del sys.modules[name]
