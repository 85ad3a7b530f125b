"""The command line: SIGNATURES.md is current, status and verify run and report."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import registry_view

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "aiter_patches", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env=env)


def test_signatures_md_is_current():
    proc = run_cli("signatures", "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_signatures_check_fails_on_a_stale_file(tmp_path):
    stale = tmp_path / "SIGNATURES.md"
    stale.write_text((ROOT / "SIGNATURES.md").read_text().replace("v0.1.20", "v0.0.0", 1))
    proc = run_cli("signatures", "--check", "--path", str(stale))
    assert proc.returncode == 1
    assert "stale" in proc.stdout and "-" in proc.stdout


def test_status_json_lists_every_patch():
    proc = run_cli("status", "--json")
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout)
    assert [p["name"] for p in st["patches"]] == registry_view.names()
    assert all(p["state"] == "inactive" for p in st["patches"])


def test_verify_runs_every_check_on_the_stand_in():
    proc = run_cli("verify", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert "stand-in" in out["aiter"]
    results = {r["patch"]: r["result"] for r in out["rows"]}
    assert {n: results.get(n) for n in registry_view.stand_in_names()} == {
        n: "ok" for n in registry_view.stand_in_names()}
    assert "FAIL" not in results.values()
