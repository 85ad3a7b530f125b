"""``aiter-patches run -- COMMAND ...``: a whole server patched, every process of it, in one step.

An inference server starts its tensor-parallel workers as new Python processes
(``multiprocessing`` spawn) that import AITER themselves, so patching the
launching process reaches none of them. Like ``opentelemetry-instrument`` and
``ddtrace-run``, ``run`` puts a folder holding a ``sitecustomize`` first on
``PYTHONPATH``; every Python process that inherits the environment, however
deep, applies the patches at start-up (``aiter_patches/bootstrap``).

``run`` then replaces itself with the command (``exec``): same pid, so every
signal reaches the command directly and its exit status, including death by
a signal (a shell shows 128+N), is the status the caller sees. Nothing of
``run`` stays behind to forward or translate anything.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Mapping

from . import auto
from .bootstrap import BOOTSTRAP_DIR


def child_env(environ: Mapping[str, str], *, verbose: bool = False) -> dict[str, str]:
    """``environ`` with the bootstrap folder first on ``PYTHONPATH`` (once, however often ``run`` nests).

    Every other entry is kept exactly, empty ones included: Python reads an
    empty entry as the current directory. An empty ``PYTHONPATH`` has no entries.
    """
    env = dict(environ)
    raw = env.get("PYTHONPATH", "")
    rest = [p for p in raw.split(os.pathsep) if p != BOOTSTRAP_DIR] if raw else []
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *rest])
    if verbose:
        env["AITER_PATCHES_LOG_LEVEL"] = "DEBUG"
    return env


def _cmd_run(args: argparse.Namespace) -> int | None:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("aiter-patches run: give the command to run, e.g. aiter-patches run -- python -m sglang.launch_server ...",
              file=sys.stderr)
        return 2
    env = child_env(os.environ, verbose=getattr(args, "verbose", False))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"aiter-patches run: {command[0]}: command not found", file=sys.stderr)
        return 127
    except OSError as exc:  # not executable, a directory, ...
        print(f"aiter-patches run: {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 126


def add_parser(sub) -> None:
    r = sub.add_parser(
        "run",
        help="run a command with the patches applied in it and in every Python process it starts",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="aiter-patches run -- COMMAND [ARG ...]",
    )
    r.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments, after --")
    r.set_defaults(func=_cmd_run)
    auto.add_parser(sub)
