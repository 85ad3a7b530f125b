"""``aiter-patches compile``: capture, compile and report every variant for gfx942/gfx950.

Why a module of its own: the CLI stays a thin dispatcher, and nothing of Triton's AMD
backend is imported until the command runs.
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
                                   "scratch, LDS over the limit or a float->int conversion.")
    c.add_argument("--arch", default=",".join(ARCHS), help="comma-separated AMD archs (default gfx942,gfx950)")
    what = c.add_mutually_exclusive_group()
    what.add_argument("--model", action="append", metavar="NAME",
                      help="a preset (repeatable; default: every preset): "
                           "DeepSeek-V3, Qwen3-235B-A22B, MiniMax-M3, Kimi-K3")
    what.add_argument("--shapes", action="append", metavar="SPEC",
                      help="experts=E,topk=K,hidden=H[,tokens=N][,blocks=32/64][,quant=none/fp4/fp8]"
                           "[,ep=off/on/on+nlt][,buf=zero/keep/addend][,shared=1][,gemm=N:K] (repeatable)")
    c.add_argument("--tokens", type=int, default=None, help="largest token count (default: the preset's, 32768)")
    c.add_argument("--cache-dir", default=None,
                   help="fill this Triton cache (TRITON_CACHE_DIR of the server) instead of a throw-away one")
    c.add_argument("--include-stand-in", action="store_true",
                   help="also the stand-in's Triton split-K GEMM (on AMD the GEMM patch launches AITER's .co)")
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


def capture_all(shapes, archs, include_stand_in=False, tokens=None):
    """Every variant the sweep's calls launch, per arch (insertion order); and launcher errors."""
    from . import capture, sweep

    variants, errors = [], []
    for arch in archs:
        with capture.capturing(arch) as rec:
            for shape in shapes:
                for call in sweep.calls(shape, arch, include_stand_in, tokens):
                    rec.label, rec.tokens = call.config, call.tokens
                    try:
                        call.run()
                    except capture.TritonTooOld:
                        raise
                    except Exception as exc:
                        errors.append(f"{arch} {call.config} tokens={call.tokens}: {type(exc).__name__}: {exc}")
        variants.extend(rec.variants.values())
    return variants, errors


def run(args: argparse.Namespace) -> int:
    from . import covering, report, sweep

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        print(f"error: --arch {','.join(bad)}: supported {', '.join(ARCHS)}", file=sys.stderr)
        return 2
    try:
        shapes = _shapes(args)
        t0 = time.perf_counter()
        variants, errors = capture_all(shapes, archs, args.include_stand_in)
    except (ValueError, RuntimeError) as exc:  # bad --shapes/--model, TRITON_INTERPRET, too old a Triton
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t_capture = time.perf_counter() - t0
    counts = report.counts_per_config(variants)
    print(f"captured {len(variants)} variants for {', '.join(archs)} in {t_capture:.1f} s")
    print(report.table([{"arch": a, "configuration": c, "variants": n} for (a, c), n in sorted(counts.items())],
                       ("arch", "configuration", "variants")))
    for e in errors:
        print(f"FAIL launcher: {e}")
    # the stand-in GEMM never runs on AMD: the variant budget is the patches' own configurations'
    over = {k: n for k, n in counts.items()
            if args.max_variants is not None and n > args.max_variants and sweep.STAND_IN not in k[1]}
    for (a, c), n in sorted(over.items()):
        print(f"FAIL {a} {c}: {n} variants > --max-variants {args.max_variants}")
    payload = {"counts": [{"arch": a, "configuration": c, "variants": n} for (a, c), n in sorted(counts.items())],
               "errors": errors, "rows": []}
    failed = bool(errors or over)
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
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1, default=str)
    return 1 if failed else 0
