"""The operators' stats lines: at exit, every AITER_PATCHES_STATS_INTERVAL seconds, after a fork, and summed back."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

import aiter_patches
from aiter_patches import registry, stats_log
from aiter_patches_standin import ROOT as STUB_ROOT
from helpers.logs import read_stats
from helpers.standin import use_stub_aiter

MX = "moe_sort_mx_quant"


@pytest.fixture
def applied(monkeypatch):
    monkeypatch.setattr(stats_log, "_last", {})
    monkeypatch.setattr(stats_log, "_baseline", {})
    with use_stub_aiter():
        import aiter.fused_moe  # noqa: F401

        aiter_patches.apply()
        yield


def stats_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(stats_log.MARKER)]


def test_one_info_line_per_applied_patch_with_its_counts(applied, caplog):
    c = registry.counters(MX)
    for _ in range(3):
        c.hit()
    c.fallback("topk_ids not contiguous")
    c.failed(RuntimeError("boom"), "moe_sort_mx_quant kernel")
    with caplog.at_level(logging.INFO, logger="aiter_patches"):
        stats_log.log_stats("exit")
    records = [r for r in caplog.records if r.getMessage().startswith(stats_log.MARKER)]
    assert records and all(r.levelno == logging.INFO for r in records)
    got = {r["patch"]: r for r in read_stats(r.getMessage() for r in records)}
    applied_names = {p["name"] for p in aiter_patches.status()["patches"] if p["state"] == "applied"}
    assert set(got) == applied_names and "sglang_takeover" not in got
    assert got[MX]["fast"] == 3 and got[MX]["at"] == "exit"
    assert got[MX]["fallback"] == {"topk_ids not contiguous": 1}
    assert got[MX]["errors"] == {"moe_sort_mx_quant kernel: RuntimeError": 1}
    assert got["gemm_out_zeroed"]["fast"] == 0


def test_interval_lines_only_when_counts_changed(applied, caplog):
    with caplog.at_level(logging.INFO, logger="aiter_patches"):
        stats_log.log_stats("interval")
        first = len(stats_lines(caplog))
        stats_log.log_stats("interval")
        assert len(stats_lines(caplog)) == first  # nothing changed: nothing logged
        registry.counters(MX).hit()
        stats_log.log_stats("interval")
        new = stats_lines(caplog)[first:]
    assert len(new) == 1 and json.loads(new[0][len(stats_log.MARKER):])["fast"] == 1


def test_a_line_stays_under_4_kib_and_keeps_the_total(applied, caplog, monkeypatch):
    from aiter_patches import runtime

    monkeypatch.setattr(runtime, "MAX_REASONS", 1000)  # the line's own folding (the counters' cap is 64)
    c = registry.counters(MX)
    for i in range(400):
        for _ in range(i % 5 + 1):
            c.fallback(f"reason number {i} " + "x" * 300)
    with caplog.at_level(logging.INFO, logger="aiter_patches"):
        stats_log.log_stats("exit")
    (line,) = [m for m in stats_lines(caplog) if f'"patch":"{MX}"' in m]
    assert len(line.encode()) <= stats_log.MAX_LINE < 4096
    rec = json.loads(line[len(stats_log.MARKER):])
    total = sum(i % 5 + 1 for i in range(400))
    assert rec["fallback_more"]["reasons"] + len(rec["fallback"]) == 400
    assert rec["fallback_more"]["calls"] + sum(rec["fallback"].values()) == total
    kept = {int(k.split()[2]) for k in rec["fallback"]}
    dropped_max = max(i % 5 + 1 for i in range(400) if i not in kept)
    assert min(rec["fallback"].values()) >= dropped_max  # the rarest reasons are the ones folded
    assert all(len(k) <= 240 for k in rec["fallback"])


def test_the_interval_must_be_a_positive_number(monkeypatch):
    for raw, want in (("", None), ("0", None), ("-3", None), ("soon", None), ("2.5", 2.5)):
        monkeypatch.setenv(stats_log.INTERVAL_ENV, raw)
        assert stats_log.interval() == want


SCRIPT = textwrap.dedent("""
    import logging, os, sys, time
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    import aiter_patches
    from aiter_patches import registry
    from aiter_patches.core import state as core_state
    aiter_patches.apply()
    import aiter.fused_moe
    c = registry.counters("moe_sort_mx_quant")
    for _ in range(5):
        c.hit()
    mode = sys.argv[1]
    if mode == "fork":
        pid = os.fork()
        if pid == 0:
            c.hit(); c.hit(); c.fallback("in the child")
            time.sleep(float(sys.argv[2]))
            os._exit(0)  # as multiprocessing's fork workers leave: no atexit
        os.waitpid(pid, 0)
        print("CHILD", pid)
    elif mode == "held":  # a thread (as the interval thread may) holds the registry's and a counter's lock at the fork
        import threading
        held, done = threading.Event(), threading.Event()
        def hold():
            with core_state.lock, c._lock:
                held.set(); done.wait()
        threading.Thread(target=hold, daemon=True).start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            import signal; signal.alarm(15)  # a hung child must not outlive the test
            aiter_patches.status(); c.hit(); aiter_patches.apply()
            os._exit(0)
        _, code = os.waitpid(pid, 0)
        done.set()
        print("CHILD", pid, code)
    else:
        c.fallback("in the parent")
        time.sleep(float(sys.argv[2]))
""")


def run(mode, sleep, interval=None, timeout=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITER_PATCHES")}
    env["PYTHONPATH"] = os.pathsep.join([STUB_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["TRITON_INTERPRET"] = "1"
    if interval is not None:
        env[stats_log.INTERVAL_ENV] = str(interval)
    return subprocess.run([sys.executable, "-c", SCRIPT, mode, str(sleep)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def mx_lines(stderr):
    out = []
    for ln in stderr.splitlines():
        if stats_log.MARKER in ln and '"patch":"moe_sort_mx_quant"' in ln:
            out.append(json.loads(ln[ln.index(stats_log.MARKER) + len(stats_log.MARKER):]))
    return out


def test_exit_line_without_interval_and_the_thread_never_holds_the_process():
    proc = run("plain", 0.0, interval=3600)
    assert proc.returncode == 0, proc.stderr
    lines = mx_lines(proc.stderr)
    assert [(r["at"], r["fast"], r["fallback"]) for r in lines] == [("exit", 5, {"in the parent": 1})]


def test_interval_lines_then_the_exit_line():
    proc = run("plain", 1.2, interval=0.3)
    assert proc.returncode == 0, proc.stderr
    lines = mx_lines(proc.stderr)
    assert [r["at"] for r in lines][-1] == "exit" and lines[0]["at"] == "interval"
    # an interval may land before the script's calls on a loaded machine (a line at 0); after them the counts do
    # not change: one interval line with them, and an interval line only when the counts changed
    counts = [(r["fast"], r["fallback"]) for r in lines]
    assert counts[-2] == counts[-1] == (5, {"in the parent": 1}), lines
    assert all(a != b for a, b in zip(counts[:-2], counts[1:-1])), lines


def test_a_forked_child_logs_its_own_counts_on_its_interval():
    proc = run("fork", 1.0, interval=0.3)
    assert proc.returncode == 0, proc.stderr
    child = int(proc.stdout.split()[-1])
    by_pid = {}
    for r in mx_lines(proc.stderr):
        by_pid.setdefault(r["pid"], []).append(r)
    assert [r["at"] for r in by_pid[child]] == ["interval"]  # os._exit: no exit line
    assert by_pid[child][0]["fast"] == 2 and by_pid[child][0]["fallback"] == {"in the child": 1}
    parent = [pid for pid in by_pid if pid != child]
    assert len(parent) == 1 and by_pid[parent[0]][-1]["at"] == "exit" and by_pid[parent[0]][-1]["fast"] == 5


def _line(pid, at, fast, fallback, foreign=()):
    rec = {"pid": pid, "patch": MX, "at": at, "fast": fast, "fallback": fallback, "errors": {},
           "foreign_layers": list(foreign)}
    return f"2026-12-01 07:00:00 INFO {stats_log.MARKER}{json.dumps(rec)}\n"


def test_status_from_log_sums_the_latest_line_of_each_process(tmp_path):
    from aiter_patches import process_report

    status = process_report.status_record()
    log = "".join([
        f"INFO {process_report.MARKER}{json.dumps(status)}\n",
        _line(11, "interval", 4, {"a": 1}),
        _line(22, "interval", 7, {"a": 2, "b": 1}, ["outer layer x on aiter.fused_moe.fused_moe"]),
        _line(11, "exit", 10, {"a": 3}),  # supersedes pid 11's interval line
        "cut mid-li" + _line(33, "exit", 1, {})[:40] + "\n",  # a broken line counts for nothing
    ])
    path = tmp_path / "server.log"
    path.write_text(log)
    sums = stats_log.summed(read_stats(log.splitlines()))
    assert sums[MX]["fast"] == 17 and sums[MX]["processes"] == 2
    assert sums[MX]["fallback"] == {"a": 5, "b": 1}
    assert sums[MX]["foreign_layers"] == ["outer layer x on aiter.fused_moe.fused_moe"]
    cli = [sys.executable, "-m", "aiter_patches", "status", "--from-log", str(path)]
    text = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert f"{MX}: 17 fast-path hits, 6 fallbacks, 0 errors over 2 processes" in text.stdout
    assert "fallback 5: a" in text.stdout and "foreign layers seen:\n      outer layer x on aiter.fused_moe.fused_moe [moe_sort_mx_quant]" in text.stdout
    as_json = subprocess.run(cli + ["--json"], capture_output=True, text=True, timeout=60)
    assert json.loads(as_json.stdout)["stats"] == sums


def test_a_child_forked_while_a_thread_held_our_locks_does_not_hang():
    proc = run("held", 0.0, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "0"


@pytest.mark.parametrize("raw", ["-5", "abc", "inf", "1e10", "nan", "0"])
def test_a_bad_interval_is_warned_about_once_and_means_no_periodic_line(raw, monkeypatch, caplog):
    """Issue 32/35: ``AITER_PATCHES_STATS_INTERVAL`` that is not a positive number of at most a year was
    accepted (``inf``, ``1e10``: the stats thread then died of an OverflowError) or ignored silently."""
    from aiter_patches import env_flags, stats_log

    monkeypatch.setattr(env_flags, "_warned", set())
    monkeypatch.setenv("AITER_PATCHES_STATS_INTERVAL", raw)
    with caplog.at_level("WARNING", logger="aiter_patches"):
        assert stats_log.interval() is None
        assert stats_log.interval() is None
    lines = [r.getMessage() for r in caplog.records if "AITER_PATCHES_STATS_INTERVAL" in r.getMessage()]
    assert len(lines) == 1 and repr(raw) in lines[0] and "no periodic line" in lines[0], lines


def test_a_good_interval_is_read():
    import os

    from aiter_patches import stats_log

    os.environ["AITER_PATCHES_STATS_INTERVAL"] = "2.5"
    try:
        assert stats_log.interval() == 2.5
    finally:
        del os.environ["AITER_PATCHES_STATS_INTERVAL"]
