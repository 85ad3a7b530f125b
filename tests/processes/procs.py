"""Starting Pythons for the multi-process tests: with the stand-in AITER importable, with or without ``run``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from aiter_patches.process_report import MARKER
from aiter_patches_standin import ROOT as STUB_ROOT
from helpers.logs import read_log

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def env(**extra: str) -> dict[str, str]:
    """This environment with the stand-in on PYTHONPATH (so ``import aiter`` finds it) and no patch switches.

    This checkout follows it on PYTHONPATH: a process started under ``run``
    imports ``aiter_patches`` from ``sitecustomize``, before the current
    directory is on ``sys.path``, and must not find another installed copy.
    """
    e = {k: v for k, v in os.environ.items() if not k.startswith("AITER_PATCHES")}
    e["PYTHONPATH"] = os.pathsep.join([STUB_ROOT, str(ROOT)])
    e["TRITON_INTERPRET"] = "1"  # the workers' tensors are on CPU
    e.update(extra)
    return e


def run_cmd(*command: str) -> list[str]:
    return [sys.executable, "-m", "aiter_patches", "run", "--", *command]


def python(*args: str, under_run: bool, environ: dict[str, str] | None = None, timeout: float = 120,
           ) -> subprocess.CompletedProcess:
    argv = [sys.executable, *args]
    return subprocess.run(run_cmd(*argv) if under_run else argv, capture_output=True, text=True, cwd=ROOT,
                          env=environ or env(), timeout=timeout)


def summaries(stderr: str, pid: int | None = None) -> list[str]:
    """The per-process summary lines in a log, optionally of one pid."""
    lines = [ln for ln in stderr.splitlines() if "aiter_patches: process " in ln]
    if pid is not None:
        lines = [ln for ln in lines if f"aiter_patches: process {pid} " in ln]
    return lines


def records(stderr: str) -> dict[int, dict]:
    """The last status record of each pid in a log."""
    return {r["pid"]: r for r in read_log(stderr.splitlines())}


def states(record: dict) -> dict[str, str]:
    return {p["name"]: p["state"] for p in record["patches"]}


__all__ = ["HERE", "MARKER", "ROOT", "env", "python", "records", "run_cmd", "states", "summaries"]
