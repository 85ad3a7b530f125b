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


# ---- bad input (issue 32): one line on stderr, exit status 2, no traceback

import pytest  # noqa: E402
import torch  # noqa: E402

from aiter_patches import cli  # noqa: E402

BAD_ENV = [("AITER_PATCHES_DISABLE", "nonexistent", "AITER_PATCHES_DISABLE names unknown patch(es) nonexistent; "),
           ("AITER_PATCHES_INTEGRATIONS", "bogus", "AITER_PATCHES_INTEGRATIONS names unknown integration(s) bogus; ")]
APPLYING = [["verify"], ["verify", "--json"], ["status", "--apply"], ["status", "--apply", "--json"],
            ["run", "--", "true"]]


def one_error_line(capsys, argv, want: str) -> None:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"aiter-patches {argv[0]}: {want}"), err


@pytest.mark.parametrize("argv", APPLYING, ids=" ".join)
@pytest.mark.parametrize("var, value, want", BAD_ENV, ids=[b[0] for b in BAD_ENV])
def test_an_unknown_name_in_the_environment_is_one_line_and_status_2(capsys, monkeypatch, argv, var, value, want):
    monkeypatch.setenv(var, value)
    monkeypatch.setattr("os.execvpe", lambda *a: pytest.fail(f"run exec'd {a[1]} despite {var}={value}"))
    one_error_line(capsys, argv, want)


def test_apply_in_process_still_raises_value_error(monkeypatch):
    import aiter_patches

    monkeypatch.setenv("AITER_PATCHES_DISABLE", "nonexistent")
    with pytest.raises(ValueError, match="AITER_PATCHES_DISABLE names unknown patch"):
        aiter_patches.apply()


def test_status_without_apply_reads_no_environment(capsys, monkeypatch):
    monkeypatch.setenv("AITER_PATCHES_DISABLE", "nonexistent")
    assert cli.main(["status", "--json"]) == 0


def no_gpu_device() -> tuple[str, str]:
    if torch.cuda.is_available():
        return "cuda:99", f"--device cuda:99: this machine has {torch.cuda.device_count()} GPU(s)"
    return "cuda", "--device cuda: this machine has no GPU"


@pytest.mark.parametrize("device, want", [("bogus", "--device bogus: not a device; give cpu, cuda or cuda:N"),
                                          ("meta", "--device meta: the checks run on cpu or cuda"),
                                          no_gpu_device()])
def test_a_bad_device_is_one_line_and_status_2(capsys, device, want):
    one_error_line(capsys, ["verify", "--device", device], want)


def test_bad_input_through_the_real_command_has_no_traceback():
    env = dict(__import__("os").environ, AITER_PATCHES_DISABLE="nonexistent")
    proc = run_cli("verify", env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [line for line in proc.stderr.splitlines() if line.startswith("aiter-patches")]
    assert len(proc.stderr.splitlines()) == 1


# ---- widths (issue 32): status and compile fit 120 columns; --json keeps everything

def test_status_fits_120_columns_and_names_why_inactive():
    proc = run_cli("status", timeout=120)  # a fresh process: no patch was ever applied there
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert max(len(line) for line in out.splitlines()) <= 120
    assert out.count(cli.NEVER_APPLIED.split(" (")[0]) == len(registry_view.names())
    for name in registry_view.names():
        assert any(line.startswith(name + " ") for line in out.splitlines())


def test_status_after_apply_fits_and_json_keeps_every_target(capsys):
    assert cli.main(["status", "--apply"]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 120
    assert cli.main(["status", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    long = [t["location"] for p in st["patches"] for t in p["targets"] if len(t["location"]) > 60]
    assert long  # the JSON keeps full dotted locations the table wraps


def test_from_log_with_no_status_line_says_why_and_what_to_do(tmp_path, capsys):
    log = tmp_path / "server.log"
    log.write_text("INFO tokenizer started\nINFO ready\n")
    assert cli.main(["status", "--from-log", str(log)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.splitlines()[0] == f"no 'aiter_patches status:' lines in {log}"
    assert "at DEBUG" in err and "aiter-patches run --" in err and "AITER_PATCHES_LOG_LEVEL=DEBUG" in err
    assert max(len(line) for line in err.splitlines()) <= 120
    assert cli.main(["status", "--from-log", str(tmp_path / "missing.log")]) == 2  # unreadable: no advice
    assert "why:" not in capsys.readouterr().err


def test_the_environment_check_logs_no_summary_of_its_own(caplog, monkeypatch):
    from aiter_patches import process_report

    monkeypatch.setattr(process_report, "_last_logged", None)  # whatever logged before, this one would log
    with caplog.at_level("DEBUG", logger="aiter_patches"):
        assert cli._environment_problem() is None
    assert not [r for r in caplog.records if "aiter_patches status:" in r.getMessage()]


def test_a_python_without_torch_gets_one_line_not_a_traceback(monkeypatch, capsys):
    """`signatures --check` run by a Python that lacks torch (a bare system python3): the patch modules import it,
    so the command ends in one line naming what is missing and what to do, exit status 2."""
    from aiter_patches import cli, signatures_doc

    def check(path):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(signatures_doc, "check", check)
    assert cli.main(["signatures", "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aiter-patches signatures: needs torch") and "Traceback" not in err[0]
