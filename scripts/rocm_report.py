"""The report `scripts/rocm_run.sh` writes: one markdown file to attach to an issue.

It holds what a reader needs to trust the numbers without access to the machine: the GPU, the
ROCm / torch / Triton / AITER versions and AITER's commit, this checkout's commit, then each
step's result (PASS, FAIL, TIMEOUT, SKIP, DRY-RUN), its command, its time and the end of its
log (the benchmark's tables whole). Every probe of the environment is allowed to fail: the
report says what could not be read instead of not being written.

    python scripts/rocm_report.py --preflight                 # print the environment; exit 1 if not ROCm + AITER
    python scripts/rocm_report.py --steps OUT/steps.tsv --out OUT/rocm_report.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STATUSES = ("PASS", "FAIL", "TIMEOUT", "SKIP", "DRY-RUN")
FAILED = ("FAIL", "TIMEOUT")
LOG_TAIL = 40
FULL_LOGS = {"code-objects", "env"}  # short logs, shown whole
ATTACHMENTS = {"bench": "bench_vs_aiter.md"}  # steps whose result is a file, shown whole


@dataclass
class Step:
    name: str
    status: str
    seconds: str
    rc: str
    command: str
    log: str  # file name under the output folder, or a one-line reason for a SKIP


def read_steps(path: Path) -> list[Step]:
    steps = []
    if not path.is_file():
        return steps
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) >= 6:
            steps.append(Step(*parts[:6]))
    return steps


def _run(cmd: list[str], timeout: float = 20) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return (out.stdout or out.stderr).strip()


def _probe(fn) -> str:
    try:
        value = fn()
        return str(value) if value not in (None, "") else "unknown"
    except Exception as exc:  # noqa: BLE001 - a probe that fails is reported, never fatal
        return f"unknown ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"


def _gpu() -> str:
    import torch

    if not torch.cuda.is_available():
        return "none visible to torch"
    names = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        arch = getattr(p, "gcnArchName", "") or f"sm_{p.major}{p.minor}"
        names.append(f"{p.name} ({arch}, {p.multi_processor_count} CUs, {p.total_memory / 2**30:.0f} GiB)")
    uniq = sorted(set(names))
    return "; ".join(f"{n} x{names.count(n)}" for n in uniq)


def _rocm() -> str:
    import torch

    hip = getattr(torch.version, "hip", None)
    parts = [f"torch.version.hip {hip}" if hip else "torch is not a ROCm build"]
    for f in ("/opt/rocm/.info/version", "/opt/rocm/.info/version-dev"):
        if os.path.isfile(f):
            parts.append(f"/opt/rocm {Path(f).read_text().strip()}")
            break
    return "; ".join(parts)


def _git(folder: str) -> str:
    head = _run(["git", "-C", folder, "rev-parse", "HEAD"])
    if len(head) != 40:
        return "not a git checkout"
    dirty = _run(["git", "-C", folder, "status", "--porcelain", "--untracked-files=no"])
    describe = _run(["git", "-C", folder, "describe", "--tags", "--always"])
    return f"{head} ({describe}{', modified' if dirty else ''})"


def _aiter() -> str:
    from aiter_patches.verify import real_aiter_problem

    problem = real_aiter_problem()
    if problem is not None:
        return f"not usable: {problem}"
    import aiter

    if getattr(aiter, "IS_AITER_PATCHES_STAND_IN", False):
        return "aiter_patches' stand-in (not AMD's AITER)"
    version = getattr(aiter, "__version__", None)
    if version is None:
        from importlib import metadata

        for dist in ("amd-aiter", "aiter"):
            try:
                version = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    folder = os.path.dirname(os.path.dirname(os.path.abspath(aiter.__file__)))
    return f"{version or 'version unknown'} at {os.path.dirname(aiter.__file__)}; commit {_probe(lambda: _git(folder))}"


def collect_environment() -> dict[str, str]:
    import importlib

    def version(mod):
        return lambda: importlib.import_module(mod).__version__

    return {
        "date (UTC)": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "host": _probe(lambda: f"{platform.node()} ({platform.platform()})"),
        "GPU": _probe(_gpu),
        "ROCm": _probe(_rocm),
        "torch": _probe(version("torch")),
        "triton": _probe(version("triton")),
        "AITER": _probe(_aiter),
        "aiter_patches": _probe(lambda: f"{_package_version()}, commit {_git(str(REPO))}"),
        "python": platform.python_version(),
        "settings": _probe(_settings),
    }


def _package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("aiter-patches")
    except metadata.PackageNotFoundError:
        return "not installed (run from the checkout)"


def _settings() -> str:
    keys = sorted(k for k in os.environ if k.startswith(("AITER_", "TRITON_", "HIP_VISIBLE", "ROCR_VISIBLE")))
    return ", ".join(f"{k}={os.environ[k]}" for k in keys) or "none"


def preflight_problems(env: dict[str, str]) -> list[str]:
    problems = []
    if "torch.version.hip" not in env["ROCm"]:
        problems.append(f"not a ROCm torch: {env['ROCm']}")
    if env["GPU"].startswith(("none", "unknown")):
        problems.append(f"no GPU: {env['GPU']}")
    if env["AITER"].startswith(("not usable", "unknown", "aiter_patches' stand-in")):
        problems.append(f"AITER: {env['AITER']}")
    return problems


def _fence(text: str) -> list[str]:
    return ["~~~", text.replace("~~~", "~ ~ ~").rstrip("\n"), "~~~"]


def step_section(step: Step, out_dir: Path) -> list[str]:
    lines = [f"## {step.name}: {step.status}", ""]
    if step.status == "SKIP":
        return lines + [f"Skipped: {step.log}", ""]
    lines += [f"`{step.command}`", ""]
    if step.status == "DRY-RUN":
        return lines + ["Not run (dry run).", ""]
    lines += [f"exit status {step.rc}, {step.seconds} s; log `{step.log}`", ""]
    attachment = ATTACHMENTS.get(step.name)
    if attachment and (out_dir / attachment).is_file():
        lines += [(out_dir / attachment).read_text(errors="replace").rstrip("\n"), ""]
    log = out_dir / step.log
    if log.is_file():
        text = log.read_text(errors="replace").splitlines()
        shown = text if step.name in FULL_LOGS else text[-LOG_TAIL:]
        if len(shown) < len(text):
            lines.append(f"Last {len(shown)} of {len(text)} log lines:")
        lines += _fence("\n".join(shown)) + [""]
    else:
        lines += ["(no log written)", ""]
    return lines


def render(env: dict[str, str], steps: list[Step], out_dir: Path, model: str, arch: str) -> str:
    failed = [s.name for s in steps if s.status in FAILED]
    dry = steps and all(s.status in ("DRY-RUN", "SKIP") for s in steps)
    verdict = ("dry run: nothing was measured" if dry else
               f"{len(failed)} step(s) failed: {', '.join(failed)}" if failed else "every step passed")
    lines = ["# aiter_patches on an AMD GPU: evidence report", "",
             f"Written by `scripts/rocm_run.sh`; model preset `{model}`, arch `{arch}`. Result: **{verdict}**.", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in env.items()]
    lines += ["", "| step | result | seconds | exit status |", "|---|---|---:|---:|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds} | {s.rc} |" for s in steps]
    lines.append("")
    for s in steps:
        lines += step_section(s, out_dir)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preflight", action="store_true", help="print the environment; exit 1 unless ROCm + GPU + AITER")
    p.add_argument("--steps", type=Path, help="steps.tsv written by rocm_run.sh")
    p.add_argument("--out", type=Path, help="the report file")
    p.add_argument("--model", default="?")
    p.add_argument("--arch", default="?")
    args = p.parse_args(argv)
    env = collect_environment()
    if args.preflight:
        for k, v in env.items():
            print(f"{k}: {v}")
        problems = preflight_problems(env)
        for problem in problems:
            print(f"PROBLEM: {problem}")
        return 1 if problems else 0
    if not args.steps or not args.out:
        p.error("--steps and --out are required (or --preflight)")
    steps = read_steps(args.steps)
    args.out.write_text(render(env, steps, args.steps.parent, args.model, args.arch))
    print(f"report: {args.out}")
    return 1 if any(s.status in FAILED for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
