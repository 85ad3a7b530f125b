"""``aiter-patches compile``: capture, compile and report every variant for gfx942/gfx950.

Why a module of its own: the CLI stays a thin dispatcher, and nothing of Triton's AMD
backend is imported until the command runs.

Exit status: 0 every variant compiled clean (or, with ``--count-only``, captured); 1 a kernel
failed (a compile error, scratch, LDS over the limit, a float->int or narrowing conversion, a
launcher error, a configuration over ``--max-variants``); 2 the command could not do what was
asked: an argument breaks its rule (one line on stderr names the argument and the rule, before
anything is captured), Triton is unusable, the ``--json`` file cannot be written, or there is
nothing to compile (a shape whose every call the kernel refuses; with ``--count-only`` that
is a count of zero, reported, exit 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ARCHS = ("gfx942", "gfx950")


def add_parser(sub) -> None:
    c = sub.add_parser("compile", help="compile every Triton kernel variant for AMD gfx942/gfx950 (no GPU needed)",
                       description="Capture the Triton variants the patches launch for the given model shapes "
                                   "(a fake ROCm driver; nothing runs), compile each for the arch and report "
                                   "registers, spills, scratch, LDS and occupancy. Exits 1 on a compile error, "
                                   "scratch, LDS over the limit or a float->int conversion; 2 on an invalid "
                                   "argument or when there is nothing to compile.")
    c.add_argument("--arch", default=",".join(ARCHS), help="comma-separated AMD archs (default gfx942,gfx950)")
    what = c.add_mutually_exclusive_group()
    what.add_argument("--model", action="append", metavar="NAME",
                      help="a preset (repeatable; default: every preset): "
                           "DeepSeek-V3, Qwen3-235B-A22B, MiniMax-M3, Kimi-K3")
    what.add_argument("--shapes", action="append", metavar="SPEC",
                      help="experts=E,topk=K,hidden=H[,tokens=N][,blocks=32/64][,quant=none/fp4/fp8]"
                           "[,ep=off/on/on+nlt][,buf=zero/keep/addend][,shared=1] (repeatable)")
    c.add_argument("--tokens", type=int, default=None, help="largest token count (default: the preset's, 32768)")
    c.add_argument("--cache-dir", default=None,
                   help="fill this Triton cache (TRITON_CACHE_DIR of the server) instead of a throw-away one")
    c.add_argument("--covering", action="store_true",
                   help="compile only a subset covering every pair of settings seen together (CI)")
    c.add_argument("--count-only", action="store_true", help="capture and print the variant counts; compile nothing")
    c.add_argument("--max-variants", type=int, default=None, metavar="N",
                   help="also fail if a configuration of the patches launches more than N variants")
    c.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPU count)")
    c.add_argument("--json", metavar="FILE", default=None, help="write the rows and counts as JSON")
    c.set_defaults(func=run)


def _shapes(args):
    from dataclasses import replace

    from . import presets

    if args.shapes:
        shapes = [presets.parse_shapes(s) for s in args.shapes]
    else:
        shapes = [presets.preset(n) for n in (args.model or list(presets.PRESETS))]
    if args.tokens is not None:
        shapes = [replace(s, max_tokens=args.tokens) for s in shapes]
    return shapes


def capture_all(shapes, archs, tokens=None, idle=None):
    """Every variant the sweep's calls launch, per arch (insertion order); and launcher errors.

    ``idle``, when a list, receives ``(index of the shape, arch, the kernel's first refusal)`` for
    each shape of which the patches' kernel takes no call."""
    from . import capture, sweep

    variants, errors = [], []
    for arch in archs:
        with capture.capturing(arch) as rec:
            for i, shape in enumerate(shapes):
                refused, taken = [], 0
                for call in sweep.calls(shape, arch, tokens, refused):
                    taken += 1
                    rec.label, rec.tokens = call.config, call.tokens
                    try:
                        call.run()
                    except capture.TritonTooOld:
                        raise
                    except Exception as exc:
                        errors.append(f"{arch} {call.config} tokens={call.tokens}: {type(exc).__name__}: {exc}")
                if not taken and idle is not None:
                    idle.append((i, arch, refused[0] if refused else "no call"))
        variants.extend(rec.variants.values())
    return variants, errors


def _path_problem(path: str, want_dir: bool) -> str | None:
    """Why `path` cannot be the directory (`want_dir`) or the file the command writes, or None.

    Checked before anything is captured, so a bad path costs no compile: the path must not be
    of the other kind, the nearest existing folder above it must be a folder (not a file the
    path lies under) and writable; a file's folder must exist."""
    if not path:
        return "an empty path"
    full = os.path.abspath(path)
    if os.path.exists(full):
        if want_dir and not os.path.isdir(full):
            return "is a file, not a directory"
        if not want_dir and os.path.isdir(full):
            return "is a directory"
        if not os.access(full if want_dir else os.path.dirname(full), os.W_OK):
            return "is not writable"
        return None
    parent = os.path.dirname(full)
    if not want_dir and not os.path.isdir(parent):
        return (f"lies under {parent}, which is a file" if os.path.isfile(parent)
                else f"its directory {parent} does not exist")
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"lies under {parent}, which is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


def argument_problem(args: argparse.Namespace) -> str | None:
    """The first argument that breaks its rule, as ``--name value: the rule``; None when all hold."""
    archs = [a.strip() for a in args.arch.split(",")]
    if not any(archs):
        return f"--arch {args.arch!r}: name one or more of {', '.join(ARCHS)}, comma-separated"
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        return f"--arch {','.join(bad)}: supported {', '.join(ARCHS)}"
    from ..aiter_contract import TOKEN_BITS

    if args.tokens is not None and not 1 <= args.tokens < 1 << TOKEN_BITS:
        return (f"--tokens {args.tokens}: the largest token count must be an integer in "
                f"1..{(1 << TOKEN_BITS) - 1} (the sort's 24-bit token field)")
    if args.max_variants is not None and args.max_variants < 1:
        return f"--max-variants {args.max_variants}: must be an integer >= 1"
    if args.jobs is not None and args.jobs < 1:
        return f"--jobs {args.jobs}: must be an integer >= 1 (default: the CPU count)"
    for flag, path, want_dir in (("--cache-dir", args.cache_dir, True), ("--json", args.json, False)):
        problem = None if path is None else _path_problem(path, want_dir)
        if problem:
            return f"{flag} {path}: {problem}"
    return None


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    problem = argument_problem(args)
    if problem:
        return _error(problem)
    archs = list(dict.fromkeys(a.strip() for a in args.arch.split(",")))
    try:
        shapes = _shapes(args)
    except ValueError as exc:  # a --shapes field against its rule, an unknown --model
        return _error(str(exc))
    from . import covering, report, sweep

    idle: list = []
    try:
        t0 = time.perf_counter()
        variants, errors = capture_all(shapes, archs, idle=idle)
    except (ValueError, RuntimeError) as exc:  # TRITON_INTERPRET, too old a Triton
        return _error(str(exc))
    t_capture = time.perf_counter() - t0
    named = [f"--shapes {s}" for s in args.shapes] if args.shapes else \
        [f"--model {n}" for n in (args.model or [s.name for s in shapes])]
    by_shape: dict[int, tuple[list, str]] = {}
    for i, arch, reason in idle:
        by_shape.setdefault(i, ([], reason))[0].append(arch)
    nothing = [f"{named[i]}: nothing to compile for {','.join(a)}: the kernel takes none of its calls ({reason})"
               for i, (a, reason) in by_shape.items()]
    if nothing and not args.count_only:
        for line in nothing:
            print(f"error: {line}", file=sys.stderr)
        return 2
    for line in nothing:
        print(f"note: {line}", file=sys.stderr)
    counts = report.counts_per_config(variants)
    print(f"captured {len(variants)} variants for {', '.join(archs)} in {t_capture:.1f} s")
    print(report.table([{"arch": a, "configuration": c, "variants": n} for (a, c), n in sorted(counts.items())],
                       ("arch", "configuration", "variants")))
    for e in errors:
        print(f"FAIL launcher: {e}")
    over = {k: n for k, n in counts.items() if args.max_variants is not None and n > args.max_variants}
    for (a, c), n in sorted(over.items()):
        print(f"FAIL {a} {c}: {n} variants > --max-variants {args.max_variants}")
    payload = {"counts": [{"arch": a, "configuration": c, "variants": n} for (a, c), n in sorted(counts.items())],
               "errors": errors, "rows": []}
    failed = bool(errors or over)
    if not args.count_only and not variants and not errors:
        return _error("nothing to compile: the calls launch no kernel variant")
    if not args.count_only and args.cache_dir:
        try:
            os.makedirs(args.cache_dir, exist_ok=True)
        except OSError as exc:
            return _error(f"--cache-dir {args.cache_dir}: cannot be created ({exc.strerror or exc})")
    if not args.count_only:
        from .compile import compile_all

        todo = covering.pairwise_cover(variants) if args.covering else variants
        jobs = args.jobs or os.cpu_count() or 2
        print(f"compiling {len(todo)} variants with {jobs} processes"
              + (f" into {args.cache_dir}" if args.cache_dir else ""), flush=True)
        t1 = time.perf_counter()
        outcomes = compile_all(todo, jobs=jobs, cache_dir=args.cache_dir)
        rows = report.rows(todo, outcomes)
        print(report.text(rows))
        bad_rows = [(v, o) for v, o in zip(todo, outcomes) if report.failures(o)]
        for v, o in bad_rows:
            print(f"FAIL {v.arch} {v.qualname}: {'; '.join(report.failures(o))}")
        print(f"{len(todo) - len(bad_rows)}/{len(todo)} variants ok, compiled in {time.perf_counter() - t1:.1f} s")
        payload["rows"] = rows
        failed = failed or bool(bad_rows)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=1, default=str)
        except OSError as exc:
            return _error(f"--json {args.json}: cannot be written ({exc.strerror or exc})")
    return 1 if failed else 0
