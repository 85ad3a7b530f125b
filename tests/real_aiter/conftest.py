"""Where the real AITER comes from, and one throw-away subprocess per (backend, faked chip).

An AITER source tree, in this order: ``AITER_PATCHES_TEST_AITER_SRC`` (any
checkout or export: a folder holding ``aiter/`` and ``csrc/``), else the fixture
``../shared/fixtures/aiter-e4048607a5.tar.xz`` next to this clone, unpacked once
per session into a temporary directory (never into the repo), else the tests
skip and say how to provide one. The cases run in ``runner.py`` subprocesses
(real AITER and the stand-in must never enter the test runner); their results
are cached for the session, so every test module reads the same runs.

The runs take minutes (the Triton interpreter runs every case's kernels, on both chips; the
suite's longest wait, the stand-in's runs too): every test that reads a run is marked
``slow_ci`` here, left out of the default run, and CI runs them in its second step
(``python -m pytest -m slow_ci``). A session that selects no test of real AITER starts no
real-AITER run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ENV = "AITER_PATCHES_TEST_AITER_SRC"
REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().parent / "runner.py"
CHIPS = {"gfx942": 304, "gfx950": 256}  # compute units of MI300X and MI355X
TIMEOUT_S = 600


def _tree_root(path: Path) -> Path | None:
    for cand in (path, path.parent):
        if (cand / "aiter" / "__init__.py").is_file() and (cand / "csrc").is_dir():
            return cand
    return None


@pytest.fixture(scope="session")
def aiter_tree(tmp_path_factory) -> Path:
    given = os.environ.get(ENV)
    if given:
        root = _tree_root(Path(given))
        if root is None:
            pytest.fail(f"{ENV}={given} holds no aiter/__init__.py and csrc/ (an AITER checkout or export)")
        return root
    fixture = _fixture()
    if fixture.is_file():
        dest = tmp_path_factory.mktemp("aiter_src")
        with tarfile.open(fixture) as tf:
            tf.extractall(dest, filter="data")
        root = _tree_root(dest) or next((_tree_root(p) for p in dest.iterdir() if p.is_dir()), None)
        if root is None:
            pytest.fail(f"{fixture} unpacked to {dest} but holds no aiter/ + csrc/")
        return root
    pytest.skip(f"no AITER source tree: set {ENV} to an AITER checkout, or provide the fixture {fixture}")


def _params(item) -> dict:
    return getattr(getattr(item, "callspec", None), "params", {})


def _reads_real_aiter(item) -> bool:
    return "real_chain" in getattr(item, "fixturenames", ()) or _params(item).get("backend") == "real"


def _reads_a_run(item) -> bool:
    return (_reads_real_aiter(item) or "stand_in_chain" in getattr(item, "fixturenames", ())
            or "backend" in _params(item))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark
def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.path)).resolve().parents and _reads_a_run(item):
            item.add_marker(pytest.mark.slow_ci)


def _fixture() -> Path:
    """``../shared/fixtures/<name>`` beside this clone or a folder above it (a git worktree's case)."""
    from helpers.aiter_tree import TARBALL, find_tarball

    return find_tarball() or TARBALL


_PROCS: dict = {}
_RESULTS: dict = {}


def _start(key, argv: list[str], cu_num: int, logs: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITER")}
    env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "1")
    env["AITER_LOG_LEVEL"] = "WARNING"
    env["CU_NUM"] = str(cu_num)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out, err = logs / f"{key[0]}-{key[1]}.out", logs / f"{key[0]}-{key[1]}.err"
    with open(out, "w") as fo, open(err, "w") as fe:  # files, not pipes: four children write at once
        proc = subprocess.Popen([sys.executable, str(RUNNER), *argv], stdout=fo, stderr=fe, text=True, env=env)
    _PROCS[key] = (argv, proc, out, err)


def _result(key) -> dict:
    if key not in _RESULTS:
        argv, proc, out_path, err_path = _PROCS[key]
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"runner {argv[:3]} ran past {TIMEOUT_S} s:\n{err_path.read_text()[-4000:]}")
        out, err = out_path.read_text(), err_path.read_text()
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            pytest.fail(f"runner {argv[:3]} failed (rc={proc.returncode}):\n{out[-2000:]}\n{err[-6000:]}")
        _RESULTS[key] = json.loads(lines[-1][len("RESULT "):])
    return _RESULTS[key]


@pytest.fixture(scope="session")
def _chains(request, tmp_path_factory):
    """Starts the runs (real AITER when a tree is there, and the stand-in, x gfx942 / gfx950) at once."""
    if not _PROCS:
        logs = tmp_path_factory.mktemp("real_aiter_runs")
        tree = None
        if any(_reads_real_aiter(item) for item in request.session.items):
            try:
                tree = request.getfixturevalue("aiter_tree")
            except pytest.skip.Exception:
                pass
        for gfx, cu in CHIPS.items():
            if tree is not None:
                home = tmp_path_factory.mktemp(f"rocm_{gfx}")
                _start(("real", gfx), ["real", str(tree), gfx, str(cu), str(home)], cu, logs)
            _start(("stub", gfx), ["stub", gfx], cu, logs)
    yield
    for _, proc, _, _ in _PROCS.values():
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="session")
def real_chain(aiter_tree, _chains):
    """``real_chain(gfx)``: the runner's report of every case on real AITER, faked ``gfx``."""
    return lambda gfx: _result(("real", gfx))


@pytest.fixture(scope="session")
def stand_in_chain(_chains):
    """``stand_in_chain(gfx)``: the same cases on the stand-in AITER (with the same compute-unit count)."""
    return lambda gfx: _result(("stub", gfx))
