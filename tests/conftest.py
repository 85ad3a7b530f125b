"""Test session set-up: run Triton kernels in the interpreter when no GPU is present.

``TRITON_INTERPRET`` must be set before ``triton`` is imported anywhere, so it
is decided here, at collection start. Tests marked ``gpu`` are skipped without a
GPU; on the device machine run them with ``pytest -m gpu``.

Spread over processes (``pytest -n auto``, pytest-xdist; ``--dist loadgroup`` in
pyproject's addopts): the tests of a folder or file that share a costly session
or module fixture (real AITER's call-chain runs, an unpacked wheel, a spawned
server) are kept in one worker (``SHARED_SETUP``), so that set-up runs once. The
scheduler (``pytest_xdist_make_scheduler`` below) reads the group off each test's
path: xdist's own grouping renames node ids, which pytest 9.2 no longer lets it do
(pytest-xdist issue 1386: every test was scheduled on its own, the set-ups ran in
both workers).

The summary names each skip reason once, with its count (``-rfE`` keeps failures
and errors in full; ``-rs`` still lists every skipped test).
"""

import collections
import os

import pytest

try:
    import torch

    _HAS_GPU = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a dependency
    _HAS_GPU = False

if not _HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# tests/<path> (a folder or a file) whose tests share a session or module fixture worth running once per
# session: one xdist group each
SHARED_SETUP = ("real_aiter", "drift", "with_sglang", "processes/test_spawn.py", "scripts/test_rocm_run.py",
                "kernels/test_code_object.py", "patches/test_gemm_code_object_check.py")


def shared_setup_group(nodeid: str) -> str | None:
    """The ``SHARED_SETUP`` entry a test belongs to, from its node id (``tests/<path>::<name>``), else None."""
    rel = nodeid.split("::", 1)[0].removeprefix("tests/")
    return next((g for g in SHARED_SETUP if rel == g or rel.startswith(g + "/")), None)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a run without pytest-xdist
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadgroup``: one work unit per ``SHARED_SETUP`` group (units of more tests first), one per
    other test."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class SharedSetupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return shared_setup_group(nodeid) or super()._split_scope(nodeid)

    return SharedSetupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if _HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU (run `pytest -m gpu` on a CUDA/ROCm machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


MAX_REASONS = 12  # the skip summary's lines: this many reasons, then one line for the rest


def skip_reason_counts(reports) -> list[tuple[str, int]]:
    """(reason, skipped tests) per distinct reason, most first (then by reason)."""
    counts: collections.Counter = collections.Counter()
    for rep in reports:
        if not getattr(rep, "skipped", False) or not isinstance(rep.longrepr, tuple):
            continue
        reason = str(rep.longrepr[2]).removeprefix("Skipped: ").strip()
        counts[" ".join(reason.split())] += 1  # one line, whatever the reason's own line breaks
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def skip_summary_lines(reports, max_reasons: int = MAX_REASONS, width: int = 160) -> list[str]:
    counts = skip_reason_counts(reports)
    if not counts:
        return []
    total = sum(n for _, n in counts)
    lines = [f"{total} skipped, {len(counts)} reason{'s' if len(counts) != 1 else ''} (pytest -rs lists each test):"]
    for reason, n in counts[:max_reasons]:
        line = f"{n:5d}  {reason}"
        lines.append(line if len(line) <= width else line[: width - 3] + "...")
    rest = counts[max_reasons:]
    if rest:
        lines.append(f"{sum(n for _, n in rest):5d}  in {len(rest)} more reasons")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if "s" in (config.option.reportchars or "") or "a" in (config.option.reportchars or "").replace("A", ""):
        return  # -rs / -ra asked for every skipped test: pytest's own lines
    lines = skip_summary_lines(terminalreporter.stats.get("skipped", []))
    if lines:
        terminalreporter.write_sep("=", "skipped, by reason")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _registry_clean():
    """Every test starts and ends with no patch applied and no pending hook."""
    from aiter_patches import registry, runtime

    registry.revert()
    runtime.set_strict(None)
    registry.reset_stats()
    yield
    registry.revert()
    runtime.set_strict(None)
