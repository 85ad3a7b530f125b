"""A parent that spawns workers which import AITER themselves: patched everywhere under `aiter-patches run`, nowhere without."""

import json
import subprocess
import sys

import pytest

from aiter_patches.patches.moe_addend_fold import NAME as ADDEND_PATCH
from helpers import registry_view

from .procs import HERE, ROOT, python, records, states, summaries

SERVER = str(HERE / "spawn_server.py")
EXPECTED = registry_view.expected_on_stand_in()


@pytest.fixture(scope="module")
def served():
    proc = python(SERVER, under_run=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def unpatched():
    proc = python(SERVER, under_run=False, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_every_spawned_worker_is_patched_and_calls_the_patch(served):
    out, _ = served
    assert len(out["workers"]) == 2
    for w in out["workers"]:
        assert w["marker"] == registry_view.outermost_at("aiter.fused_moe.fused_moe"), \
            "the worker's own `from aiter.fused_moe import fused_moe` is patched"
        assert w["call"] == "ok", w["call"]
        assert w["fast"] == 1, "the addend was folded by the patch, not added by a fallback"
        assert w["states"] == EXPECTED
        assert ADDEND_PATCH in EXPECTED, "the worker's call exercises this patch"


def test_every_process_logs_its_own_summary_with_its_rank(served):
    out, log = served
    for w in out["workers"]:
        lines = summaries(log, w["pid"])
        assert lines, f"no summary line for worker {w['pid']}:\n{log}"
        final = lines[-1]
        assert f"RANK={w['rank']}" in final and f"LOCAL_RANK={w['rank']}" in final
        applied = [n for n, s in EXPECTED.items() if s == "applied"]
        assert "via run" in final and f"applied {len(applied)} ({', '.join(applied)})" in final
    assert summaries(log, out["parent"]), "the parent is patched too"


def test_status_from_log_reads_every_process_back(served, tmp_path):
    out, log = served
    path = tmp_path / "server.log"
    path.write_text(log)
    proc = subprocess.run([sys.executable, "-m", "aiter_patches", "status", "--from-log", str(path), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    by_pid = {r["pid"]: r for r in json.loads(proc.stdout)["processes"]}
    assert set(by_pid) == {out["parent"], *(w["pid"] for w in out["workers"])}
    for w in out["workers"]:
        rec = by_pid[w["pid"]]
        assert rec["ppid"] == out["parent"]
        assert rec["env"] == {"RANK": str(w["rank"]), "LOCAL_RANK": str(w["rank"])}
        assert states(rec) == EXPECTED
        assert rec["aiter"]["stand_in"] is True and rec["via"] == ["run"]
    assert records(log) == by_pid


def test_without_run_no_worker_is_patched(unpatched):
    out, log = unpatched
    for w in out["workers"]:
        assert w["marker"] is None
        assert w["call"].startswith("TypeError") and "moe_addend" in w["call"]
        assert w["fast"] == 0
        assert set(w["states"].values()) == {"inactive"}
    assert summaries(log) == [] and records(log) == {}
