"""Where the sort + quant kernel's time goes, and which launch knobs suit an H200.

Two tables, CUDA-graph replay, block_size 32, MXFP4:

* knobs: the module's launch constants (``ROW_SPLIT_PROGRAMS``, ``QUANT_GROUPS``,
  ``CHUNK_PAIRS``) over a grid, per shape; the defaults are marked.
* parts: the same call with parts left out (no quant, no ``moe_buf`` fill, neither), so the
  difference to the full call is what that part costs.

    python bench/sweep_moe_sort_quant.py --out sweep.md    # its 2026-11-29 runs: git history of docs/bench
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiter_patches.kernels import moe_sort_mx_quant as kernel  # noqa: E402
from bench.bench_moe_sort_quant import BLOCK, FP4, SETS, make_inputs  # noqa: E402
from bench.harness import graph_us, launch_floor_us  # noqa: E402

MODELS = [(256, 8, 7168), (128, 4, 6144), (896, 16, 3584), (128, 8, 2048)]
DECODE = [1, 8, 32, 64, 128, 256]
PREFILL = [2048, 32768]
DECODE_KNOBS = [dict(ROW_SPLIT_PROGRAMS=r, QUANT_GROUPS=q) for r in (128, 256) for q in (16, 32, 64, 256)]
PREFILL_KNOBS = [dict(CHUNK_PAIRS=c, QUANT_GROUPS=q) for c in (512, 1024) for q in (32, 64)]
PARTS = {"all": dict(quant=True, buf=True), "no quant": dict(quant=False, buf=True),
         "no moe_buf": dict(quant=True, buf=False), "sort only": dict(quant=False, buf=False)}


def time_call(M, E, K, N, quant=True, buf=True) -> float:
    sets = [make_inputs(M, K, E, N, s) for s in range(SETS)]
    calls, replays = (40, 5) if M <= 1024 else (6, 3)

    def call(i):
        ids, w, x = sets[i % SETS]
        kernel.moe_sort_mx_quant(ids, w, E, N, torch.bfloat16, BLOCK, quant_input=x if quant else None,
                                 quant_dtype=FP4 if quant else None, zero_moe_buf=buf)

    return graph_us([functools.partial(call, i) for i in range(calls)], calls, replays)


def with_knobs(knobs: dict, fn):
    saved = {k: getattr(kernel, k) for k in knobs}
    for k, v in knobs.items():
        setattr(kernel, k, v)
    try:
        return fn()
    finally:
        for k, v in saved.items():
            setattr(kernel, k, v)


def knob_table(tokens, grid, lines):
    defaults = {k: getattr(kernel, k) for k in grid[0]}
    names = list(grid[0])
    lines += [f"Columns: {', '.join(names)}; us per call; the best of a row in bold.", "",
              "| experts | topk | hidden | tokens | " + " | ".join(
                  ", ".join(f"{v}" for v in g.values()) + (" (default)" if g == defaults else "") for g in grid)
              + " |",
              "|---:|---:|---:|---:|" + "---:|" * len(grid)]
    for (E, K, N), M in itertools.product(MODELS, tokens):
        ts = [with_knobs(g, lambda: time_call(M, E, K, N)) for g in grid]
        best = min(ts)
        cells = [f"**{t:.2f}**" if t == best else f"{t:.2f}" for t in ts]
        lines.append(f"| {E} | {K} | {N} | {M} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines.append("")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", choices=["decode", "prefill", "parts"], nargs="*",
                    default=["decode", "prefill", "parts"])
    args = ap.parse_args()
    lines = [f"# Sort + quant launch knobs and cost breakdown on {torch.cuda.get_device_name()}", "",
             f"Command: `python bench/sweep_moe_sort_quant.py --out ...`; launch floor {launch_floor_us():.2f} us.", ""]
    if "decode" in args.only:
        lines += ["## Decode knobs", ""]
        knob_table(DECODE, DECODE_KNOBS, lines)
        Path(args.out).write_text("\n".join(lines) + "\n")
    if "prefill" in args.only:
        lines += ["## Prefill knobs", ""]
        knob_table(PREFILL, PREFILL_KNOBS, lines)
        Path(args.out).write_text("\n".join(lines) + "\n")
    if "parts" in args.only:
        lines += ["## Parts (defaults; us per call)", "",
                  "| experts | topk | hidden | tokens | " + " | ".join(PARTS) + " |",
                  "|---:|---:|---:|---:|" + "---:|" * len(PARTS)]
        for (E, K, N), M in itertools.product(MODELS, [8, 64, 2048, 32768]):
            ts = [time_call(M, E, K, N, **p) for p in PARTS.values()]
            lines.append(f"| {E} | {K} | {N} | {M} | " + " | ".join(f"{t:.2f}" for t in ts) + " |")
            print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
