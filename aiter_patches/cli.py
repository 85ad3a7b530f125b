"""The `aiter-patches` command: status, verify, signatures, drift, run, compile."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Sequence


def _table(rows: list[dict], cols: Sequence[str]) -> str:
    from . import text_table

    return text_table.of_dicts(rows, cols, "(none)", text_table.WIDTH)


FROM_LOG_NOTHING = """\
why: a process logs its status line when it calls aiter_patches.apply() (`aiter-patches run`, AITER_PATCHES_AUTO=1
  and the vLLM plugin call it in every process): at INFO once it has imported AITER, at DEBUG before. A process
  that never imports AITER (a server's tokenizer, say) logs none at INFO; one that never calls apply() logs none.
what to do: start the server as `aiter-patches run -- <command>` (or with AITER_PATCHES_AUTO=1) and read the log
  it writes, stderr included; set AITER_PATCHES_LOG_LEVEL=DEBUG to see the processes that never import AITER."""

NEVER_APPLIED = "apply() not called in this process (status --apply calls it)"


def _targets_cell(locations: Sequence[str], targets) -> str:
    """One line per module: ``module: attr, attr`` (the declared targets), else the locations as given."""
    if not targets:
        return ", ".join(locations)
    by_module: dict[str, list[str]] = {}
    for t in targets:
        by_module.setdefault(t.module, []).append(t.attr)
    return "\n".join(f"{m}: {', '.join(attrs)}" for m, attrs in by_module.items())


def _cmd_status(args: argparse.Namespace) -> int:
    from . import registry

    if args.from_log:
        from .process_report import print_log_status

        found = print_log_status(args.from_log, as_json=args.json)
        if found == 1:  # readable, but no status line: say why that happens and what to do
            print(FROM_LOG_NOTHING, file=sys.stderr)
        return found
    if args.apply:
        registry.apply()
    st = registry.status()
    if args.json:
        print(json.dumps(st, indent=2, default=str))
        return 0
    a = st["aiter"]
    where = a["location"] or "not imported"
    print(f"AITER: {a['version'] or 'unknown version'} ({where})")
    declared = {p.name: p.targets for p in registry.patches()}
    rows = [
        {"patch": r["name"], "state": r["state"],
         "targets": _targets_cell([t["location"] for t in r["targets"]], declared.get(r["name"])),
         "reason": r["reason"] or (NEVER_APPLIED if r["state"] == "inactive" else "")}
        for r in st["patches"]
    ]
    print(_table(rows, ["patch", "state", "targets", "reason"]))
    if not rows:
        print("no patches are registered")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from . import verify

    problem = _device_problem(args.device)
    if problem:
        return _bad_input("verify", problem)
    if not args.verbose:  # apply/revert around each check would drown the table
        logging.getLogger("aiter_patches").setLevel(logging.WARNING)
    if args.model is not None or args.max_tokens is not None:
        problem = _model_problem(args.model, args.max_tokens)
        if problem:
            return _bad_input("verify", problem)
    rows, used = verify.run(args.device)
    model_rows: list[dict] = []
    if args.model is not None:
        from . import verify_model

        model_rows, _ = verify_model.run(args.model, args.device, int(args.max_tokens) if args.max_tokens else None)
    if args.json:
        print(json.dumps({"aiter": used, "rows": rows, **({"model_rows": model_rows} if args.model else {})},
                         indent=2, default=str))
    else:
        print(f"verifying against {used}")
        print(_table(rows, ["patch", "state", "check", "result", "detail"]))
        if not rows:
            print("no patches are registered: nothing to verify")
        if args.model is not None:
            from . import verify_model

            print(f"\nthe self-check at every token bucket of {args.model} (ok: equal to AITER's; "
                  "AITER: handed to AITER, why):")
            print(_table(model_rows, verify_model.COLUMNS))
    return 1 if any(r["result"] == "FAIL" for r in rows + model_rows) else 0


def _model_problem(model: str | None, max_tokens: str | None) -> str | None:
    """Why ``--model`` / ``--max-tokens`` cannot run (an unknown preset, not a whole number >= 1), or None."""
    from .amd import presets

    if max_tokens is not None and model is None:
        return "--max-tokens needs --model"
    if max_tokens is not None and not (max_tokens.isascii() and max_tokens.isdigit() and int(max_tokens) >= 1):
        return f"--max-tokens {max_tokens}: the rule is a whole number, 1 or more"
    try:
        presets.preset(model)
    except ValueError as exc:
        return f"--model: {exc}"
    return None


def _device_problem(device: str | None) -> str | None:
    """Why ``--device`` cannot run the checks here (not a device; not cpu or cuda; no such GPU), or None."""
    if device is None:
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"--device {device}: not a device; give cpu, cuda or cuda:N"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":  # ROCm's GPUs are cuda devices to torch too
        return f"--device {device}: the checks run on cpu or cuda (cuda:N), not on {dev.type}"
    if not torch.cuda.is_available():
        return f"--device {device}: this machine has no GPU that torch {torch.__version__} can use; use --device cpu"
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        return f"--device {device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}"
    return None


def _bad_input(command: str, message: str) -> int:
    """A bad input: one line on stderr, exit status 2, no traceback."""
    print(f"aiter-patches {command}: {message}", file=sys.stderr)
    return 2


def _environment_problem() -> str | None:
    """What ``apply()`` refuses in this environment (an unknown name in ``AITER_PATCHES_DISABLE`` or
    ``AITER_PATCHES_INTEGRATIONS``), asked through ``apply([])``, which applies no patch; None when nothing.
    Its process summary is not logged: under ``run`` this process becomes the command, same pid."""
    from . import registry

    log = logging.getLogger("aiter_patches")
    was = log.disabled
    log.disabled = True
    try:
        registry.apply([])
    except ValueError as exc:
        return str(exc)
    finally:
        log.disabled = was
    return None


# commands that apply the patches (here or in the processes they start): their environment is checked first
_APPLYING = {"verify": lambda args: True, "run": lambda args: True, "status": lambda args: bool(args.apply)}


def _cmd_signatures(args: argparse.Namespace) -> int:
    from . import signatures_doc

    path = Path(args.path)
    if args.write:
        signatures_doc.write(path)
        print(f"wrote {path}")
        return 0
    if args.check:
        ok, msg = signatures_doc.check(path)
        print(msg)
        return 0 if ok else 1
    print(signatures_doc.render(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aiter-patches", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG (fallback reasons)")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("status", help="state of every patch in this process")
    s.add_argument("--json", action="store_true")
    s.add_argument("--apply", action="store_true", help="call apply() first")
    s.add_argument("--from-log", metavar="FILE",
                   help="instead: each process's last status line in a server log ('-' reads stdin)")
    s.set_defaults(func=_cmd_status)

    v = sub.add_parser("verify", help="apply the patches and check each against AITER on sample inputs")
    v.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    v.add_argument("--json", action="store_true")
    v.add_argument("--model", default=None, help="also run the self-check at every token bucket of a model preset "
                                                 "(deepseek-v3, qwen3-235b, minimax-m3, kimi-k3)")
    v.add_argument("--max-tokens", default=None, help="with --model: the largest token bucket (default: the preset's)")
    v.set_defaults(func=_cmd_verify)

    g = sub.add_parser("signatures", help="print, --write or --check SIGNATURES.md")
    g.add_argument("--path", default="SIGNATURES.md")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    g.set_defaults(func=_cmd_signatures)

    from .amd import command as amd_command  # imports no triton until `compile` runs

    amd_command.add_parser(sub)
    _add_optional_commands(sub)
    return p


def _add_optional_commands(sub) -> None:
    """Commands whose modules add their own sub-parsers (drift, run)."""
    from .drift import command as drift_command  # reads source files only: imports no AITER, no server

    drift_command.add_parser(sub)
    try:
        from . import launcher
    except ImportError:
        launcher = None
    if launcher is not None and hasattr(launcher, "add_parser"):
        launcher.add_parser(sub)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    if _APPLYING.get(args.cmd, lambda args: False)(args):
        problem = _environment_problem()
        if problem:
            return _bad_input(args.cmd, problem)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        if exc.name not in NEEDED:
            raise
        return _bad_input(args.cmd, f"needs {exc.name} (the patch modules import it), which {sys.executable} does "
                                    "not have: run it with the Python that aiter_patches' torch is installed in")


NEEDED = ("torch", "triton")  # what the commands import through the patch modules


if __name__ == "__main__":
    sys.exit(main())
