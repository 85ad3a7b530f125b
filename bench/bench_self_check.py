"""Benchmark: what the self-check (aiter_patches/self_check.py) costs, on the GPU, with the stand-in AITER.

A decode loop as a server runs it: each batch size eagerly first (the warm-up: with the check on,
its first call per plan is the check), then captured in a CUDA graph and replayed. Per batch size,
with the check on and off, in alternating rounds:

- replay µs per ``fused_moe`` call (CUDA-graph replay; bench/harness.py), and the fast-path hits
  and capture hand-backs counted while capturing: with the check on, every captured call must be
  the fast path (0 hand-backs);
- host ms of the first eager call (the check, when on: both paths and the comparison), and the
  median host µs of the eager calls after it (the fast path alone; the check adds nothing there).

    python bench/bench_self_check.py --out docs/bench/self_check_h200.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiter_patches  # noqa: E402
from aiter_patches import registry, self_check  # noqa: E402
from aiter_patches.patches import checks  # noqa: E402
from aiter_patches_standin import use as use_stub_aiter  # noqa: E402
from bench import harness  # noqa: E402

NAME = "moe_sort_mx_quant"
MODEL = (256, 8, 7168)  # DeepSeek-V3's MoE layer (experts, topk, hidden)
INTER = 64  # the stand-in dequantizes every expert's weights per call: small, so the loop stays short


def inputs(aiter, M: int, seed: int) -> dict:
    E, topk, dim = MODEL
    return checks.mxfp4_moe_inputs(aiter, torch.device("cuda"), M, E, topk, dim, INTER, seed)


def host_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e6


def one(fm, aiter, M: int, check: bool, eager_calls: int) -> dict:
    os.environ[self_check.ENV] = "1" if check else "0"
    registry.revert()
    aiter_patches.apply([NAME])  # a fresh wrapper: every plan new
    sets = [inputs(aiter, M, seed) for seed in range(4)]
    first = host_ms(lambda: fm.fused_moe(**sets[0]))
    after = [host_ms(lambda: fm.fused_moe(**sets[i % len(sets)])) * 1e3 for i in range(1, eager_calls)]
    before = registry.stats()[NAME]
    us = harness.graph_us([lambda s=s: fm.fused_moe(**s) for s in sets], 20)
    stats = registry.stats()[NAME]
    return {"first_ms": first, "eager_us": statistics.median(after), "replay_us": us,
            "capture_fast": stats["fast"] - before["fast"],
            "capture_handed_back": stats["fallback"].get(self_check.CAPTURE_REASON, 0),
            "checks_passed": stats["checks_passed"], "checks_failed": stats["checks_failed"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,8,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--eager-calls", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = []
    with use_stub_aiter() as aiter:
        import aiter.fused_moe as fm

        for M in (int(t) for t in args.tokens.split(",")):
            got: dict[bool, list[dict]] = {True: [], False: []}
            for _ in range(args.rounds):
                for check in (True, False):
                    got[check].append(one(fm, aiter, M, check, args.eager_calls))
                    print(f"tokens {M} check {check}: {got[check][-1]}", flush=True)
            for check in (True, False):
                r = got[check]
                rows.append((M, "on" if check else "off",
                             statistics.median(x["replay_us"] for x in r),
                             statistics.median(x["eager_us"] for x in r),
                             statistics.median(x["first_ms"] for x in r),
                             f"{r[-1]['capture_fast']} / {r[-1]['capture_handed_back']}",
                             f"{r[-1]['checks_passed']} / {r[-1]['checks_failed']}"))
    commit = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip() or "?"
    lines = [
        "# The self-check's cost (H200, stand-in AITER, a proxy for AMD)", "",
        f"Command: `python bench/bench_self_check.py` (commit {commit}, {time.strftime('%Y-%m-%d')}; "
        f"{harness.gpu_name()}, torch {torch.__version__}). `fused_moe` with MXFP4 weights (per_1x32), "
        f"DeepSeek-V3's MoE layer {MODEL}, intermediate {INTER}; medians over {args.rounds} alternating rounds "
        "of check on / off, each with a fresh `apply()` (every plan new).", "",
        "| tokens | self-check | replay µs per call | eager µs per call after the first | first eager call ms "
        "| fast-path hits / hand-backs while capturing | checks passed / failed |",
        "|---:|---|---:|---:|---:|---|---|",
        *(f"| {m} | {c} | {r:.2f} | {e:.1f} | {f:.1f} | {cap} | {chk} |" for m, c, r, e, f, cap, chk in rows),
        "",
        "With the check on, the first eager call of each plan runs AITER's sort and quant and the one-launch "
        "kernel and compares them (its ms include the comparison's syncs); the calls after it, the capture "
        "and every replay run the fast path alone.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
