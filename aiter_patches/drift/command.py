"""``aiter-patches drift``: the sub-command's arguments, and what it prints and returns.

Why its exit status matters more than its text: CI gates on it. 0 every target
matches a pin, 1 some target drifted or is missing, 2 the source cannot be read.
Whatever is wrong with the file given (damaged, truncated, hostile), the answer is
2 and one line on stderr naming the file and the problem: a traceback would exit 1,
which reads as "AITER drifted".
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .check import check
from .files import SourceUnreadable
from .render import render_propose, render_table
from .sources import open_server, open_source


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "drift",
        help="check the pins against an AITER source statically (no import, no ROCm)",
        description="Exit 0: every target matches a pin; 1: drift or missing; 2: the source cannot be read.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--aiter-src", metavar="DIR", help="an AITER checkout (holding aiter/) or the aiter package")
    src.add_argument("--wheel", metavar="FILE", help="an AITER wheel or sdist file")
    src.add_argument("--server", metavar="PATH",
                     help="instead: the server integrations' targets in an SGLang/vLLM wheel, sdist or source directory")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument("--propose", action="store_true", help="print the found signatures in pin syntax")
    p.add_argument("--label", default=None, help="pin label for --propose (default: the source's version)")
    p.set_defaults(func=run_command)
    return p


def run_command(args: argparse.Namespace) -> int:
    server = getattr(args, "server", None)
    try:
        tree = open_server(server) if server else open_source(args.aiter_src, args.wheel)
        report = check(tree)
    except SourceUnreadable as exc:
        message = " ".join(str(exc).splitlines())  # one line, whatever the file put in it
        if args.json:
            print(json.dumps({"error": message, "exit_code": 2}, indent=2))
        else:
            print(f"aiter-patches drift: cannot read {'server' if server else 'AITER'} source: {message}",
                  file=sys.stderr)
        return 2
    if args.propose:
        print(render_propose(report, args.label or report.version or "LABEL"))
    elif args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(render_table(report))
    return report.exit_code
