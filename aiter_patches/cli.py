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

    return text_table.of_dicts(rows, cols, "(none)")


def _cmd_status(args: argparse.Namespace) -> int:
    from . import registry

    if args.from_log:
        from .process_report import print_log_status

        return print_log_status(args.from_log, as_json=args.json)
    if args.apply:
        registry.apply()
    st = registry.status()
    if args.json:
        print(json.dumps(st, indent=2, default=str))
        return 0
    a = st["aiter"]
    where = a["location"] or "not imported"
    print(f"AITER: {a['version'] or 'unknown version'} ({where})")
    rows = [
        {"patch": r["name"], "state": r["state"], "targets": ", ".join(t["location"] for t in r["targets"]),
         "reason": r["reason"]}
        for r in st["patches"]
    ]
    print(_table(rows, ["patch", "state", "targets", "reason"]))
    if not rows:
        print("no patches are registered")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from . import verify

    if not args.verbose:  # apply/revert around each check would drown the table
        logging.getLogger("aiter_patches").setLevel(logging.WARNING)
    rows, used = verify.run(args.device)
    if args.json:
        print(json.dumps({"aiter": used, "rows": rows}, indent=2, default=str))
    else:
        print(f"verifying against {used}")
        print(_table(rows, ["patch", "state", "check", "result", "detail"]))
        if not rows:
            print("no patches are registered: nothing to verify")
    return 1 if any(r["result"] == "FAIL" for r in rows) else 0


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
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
