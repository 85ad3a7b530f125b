"""`aiter-patches run`: exit status and signals pass through, an existing sitecustomize still runs, nothing crashes."""

import os
import signal
import subprocess
import sys

from aiter_patches.bootstrap import BOOTSTRAP_DIR
from aiter_patches.launcher import child_env
from helpers import registry_view

from .procs import ROOT, env, python, records, run_cmd, states, summaries

PENDING_ALL = registry_view.expected_before_import()  # nothing of AITER imported yet
SHOW_STATES = ("import aiter_patches, sys; "
               "print({p['name']: p['state'] for p in aiter_patches.status()['patches']}); "
               "print(sys.modules['sitecustomize'].__file__)")


def test_exit_code_passes_through():
    proc = python("-c", "import sys; sys.exit(7)", under_run=True)
    assert proc.returncode == 7, proc.stderr


def test_death_by_signal_passes_through_and_a_shell_sees_128_plus_n():
    script = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    proc = python("-c", script, under_run=True)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    shell = subprocess.run(["sh", "-c", '"$@"; echo "status=$?"', "sh", *run_cmd(sys.executable, "-c", script)],
                           capture_output=True, text=True, cwd=ROOT, env=env(), timeout=60)
    assert shell.stdout.strip() == f"status={128 + signal.SIGTERM}", shell.stderr


def test_a_signal_sent_to_run_reaches_the_command():
    script = ("import os, signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
              "print('ready', os.getpid(), flush=True)\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen(run_cmd(sys.executable, "-c", script), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env())
    try:
        word, pid = proc.stdout.readline().split()
        assert word == "ready" and int(pid) == proc.pid, "run execs the command: same process"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 42
    finally:
        proc.kill()
        proc.communicate()


def test_missing_command_and_empty_command():
    proc = python("-m", "aiter_patches", "run", "--", "no-such-command-aiter-patches", under_run=False)
    assert proc.returncode == 127 and "command not found" in proc.stderr
    proc = python("-m", "aiter_patches", "run", under_run=False)
    assert proc.returncode == 2 and "give the command" in proc.stderr


def test_the_command_is_patched_and_so_are_nested_pythons():
    nested = f"import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', {SHOW_STATES!r}]).returncode)"
    proc = python("-c", nested, under_run=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == str(PENDING_ALL)
    assert proc.stdout.splitlines()[1].startswith(BOOTSTRAP_DIR)


def test_an_existing_sitecustomize_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("RUNS = globals().get('RUNS', 0) + 1\n")
    script = SHOW_STATES + "; print(sys.modules['sitecustomize'].RUNS)"
    e = env(PYTHONPATH=os.pathsep.join([str(tmp_path), env()["PYTHONPATH"]]))
    proc = python("-c", script, under_run=True, environ=e)
    assert proc.returncode == 0, proc.stderr
    state_line, module_file, runs = proc.stdout.splitlines()
    assert module_file == str(tmp_path / "sitecustomize.py") and runs == "1", "the user's sitecustomize ran, once"
    assert state_line == str(PENDING_ALL)


def test_a_failing_sitecustomize_or_bad_settings_never_crash_the_command(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("raise RuntimeError('broken user sitecustomize')\n")
    e = env(PYTHONPATH=os.pathsep.join([str(tmp_path), env()["PYTHONPATH"]]))
    proc = python("-c", SHOW_STATES, under_run=True, environ=e)
    assert proc.returncode == 0, proc.stderr
    assert "broken user sitecustomize" in proc.stderr
    assert proc.stdout.splitlines()[0] == str(PENDING_ALL), "the patches still apply"

    proc = python("-c", "print('still runs')", under_run=True, environ=env(AITER_PATCHES_DISABLE="no_such_patch"))
    assert proc.returncode == 2 and proc.stdout == ""  # issue 32: run refuses a typo, in one line
    assert proc.stderr.startswith("aiter-patches run: AITER_PATCHES_DISABLE names unknown patch(es) no_such_patch;")
    assert len(proc.stderr.splitlines()) == 1
    e = env(AITER_PATCHES_DISABLE="no_such_patch", PYTHONPATH=os.pathsep.join([BOOTSTRAP_DIR, env()["PYTHONPATH"]]))
    proc = python("-c", "print('still runs')", under_run=False, environ=e)  # the bootstrap itself still never crashes
    assert proc.returncode == 0 and proc.stdout.strip() == "still runs"
    assert "could not apply the patches" in proc.stderr and "no_such_patch" in proc.stderr


def test_a_forked_child_reports_the_patches_it_inherited():
    script = ("import os\n"
              "from aiter.fused_moe import fused_moe\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    os._exit(0 if getattr(fused_moe, '__aiter_patches__', None) else 3)\n"
              "print(pid, os.waitpid(pid, 0)[1])\n")
    proc = python("-c", script, under_run=True)
    assert proc.returncode == 0, proc.stderr
    child, status = (int(v) for v in proc.stdout.split())
    assert status == 0
    assert len(summaries(proc.stderr, child)) == 1
    assert states(records(proc.stderr)[child]) == registry_view.expected_on_stand_in()


def test_child_env_prefixes_pythonpath_once():
    e = child_env({"PYTHONPATH": os.pathsep.join(["/a", BOOTSTRAP_DIR, "/b"])})
    assert e["PYTHONPATH"] == os.pathsep.join([BOOTSTRAP_DIR, "/a", "/b"])
    assert child_env({})["PYTHONPATH"] == BOOTSTRAP_DIR
    assert child_env({}, verbose=True)["AITER_PATCHES_LOG_LEVEL"] == "DEBUG"


def test_child_env_keeps_empty_pythonpath_entries_exactly():
    sep = os.pathsep
    assert child_env({"PYTHONPATH": f"{sep}/a{sep}{sep}"})["PYTHONPATH"] == sep.join([BOOTSTRAP_DIR, "", "/a", "", ""])
    assert child_env({"PYTHONPATH": sep.join(["/a", BOOTSTRAP_DIR, ""])})["PYTHONPATH"] == sep.join(
        [BOOTSTRAP_DIR, "/a", ""])
    assert child_env({"PYTHONPATH": ""})["PYTHONPATH"] == BOOTSTRAP_DIR, "an empty PYTHONPATH has no entry"


def test_an_empty_pythonpath_entry_imports_the_same_module_with_and_without_run(tmp_path):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "aiter_patches_cwd_probe.py").write_text("")
    script = elsewhere / "show.py"  # sys.path[0] is this folder: only the empty entry reaches the cwd
    script.write_text("import aiter_patches_cwd_probe\nprint(aiter_patches_cwd_probe.__file__)\n")
    e = env(PYTHONPATH=os.pathsep.join([env()["PYTHONPATH"], str(ROOT), ""]))
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=work, env=e, timeout=60)
    under = subprocess.run(run_cmd(sys.executable, str(script)), capture_output=True, text=True, cwd=work, env=e,
                           timeout=60)
    assert plain.returncode == 0, plain.stderr
    assert under.returncode == 0, under.stderr
    assert under.stdout == plain.stdout == f"{work / 'aiter_patches_cwd_probe.py'}\n"
