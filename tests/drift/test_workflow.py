"""The public CI job `.github/workflows/signature-drift.yml` cannot run here: check that what it runs exists.

Read with a line parser (no YAML dependency): the file is ours and kept simple.
"""

import re
import shlex
import tomllib
from pathlib import Path

from aiter_patches import cli

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "signature-drift.yml"


def run_commands(text):
    return [m.group(1).strip() for m in re.finditer(r"^\s*run:\s*(.+)$", text, re.M)]


def test_workflow_triggers_on_pull_requests_and_nightly():
    text = WORKFLOW.read_text()
    on = text.split("\non:", 1)[1].split("\njobs:", 1)[0]
    assert re.search(r"^\s+pull_request:", on, re.M)
    assert re.search(r"^\s+- cron:\s*\"[^\"]+\"", on, re.M)


def test_workflow_checks_out_aiter_main_and_runs_drift_on_it():
    text = WORKFLOW.read_text()
    m = re.search(r"repository:\s*ROCm/aiter\s*\n\s*ref:\s*main\s*\n\s*path:\s*(\S+)", text)
    assert m, "a step must check out ROCm/aiter at main"
    checkout = m.group(1)
    drift_runs = [shlex.split(c) for c in run_commands(text) if c.startswith("aiter-patches drift")]
    assert drift_runs, "no `aiter-patches drift` step"
    parser = cli.build_parser()
    for argv in drift_runs:
        argv = ["LABEL" if "$(" in a else a for a in argv]  # a shell-computed value
        args = parser.parse_args(argv[1:])  # exits (fails the test) on an unknown option
        assert args.cmd == "drift" and args.aiter_src == checkout
    assert "--propose" not in drift_runs[0]  # the gating step is the plain report (exit 1 on drift)


def test_the_command_it_runs_is_a_declared_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["aiter-patches"] == "aiter_patches.cli:main"


def test_workflow_runs_the_real_aiter_chain_tests_on_aiter_main_nightly():
    text = WORKFLOW.read_text()
    job = text.split("\n  real-aiter-chain:", 1)[1]
    assert re.search(r"if:\s*github\.event_name != 'pull_request'", job)  # nightly / on demand
    m = re.search(r"repository:\s*ROCm/aiter\s*\n\s*ref:\s*main\s*\n\s*path:\s*(\S+)", job)
    assert m, "the job must check out ROCm/aiter at main"
    assert re.search(r"AITER_PATCHES_TEST_AITER_SRC:\s*\$\{\{ github\.workspace \}\}/" + re.escape(m.group(1)), job)
    assert any(c.endswith("pytest -q tests/real_aiter") for c in run_commands(job))
    assert (ROOT / "tests" / "real_aiter" / "conftest.py").read_text().count("AITER_PATCHES_TEST_AITER_SRC") >= 1
