"""Benchmark: the shared-expert addend folded into the sort's fill vs. zero-fill + a separate add.

Two comparisons per (tokens, hidden), GPU time per call from CUDA-graph replay:

1. The one-launch sort writing the addend into ``moe_buf`` (``moe_buf_init``) against the
   same sort zero-filling ``moe_buf`` plus the separate ``out + shared`` add it replaces
   (the add reads two ``[M, hidden]`` tensors and writes a third).
2. After AITER's own sort (the fold's fallback): ``moe_buf.copy_(addend)`` before stage 2
   against ``out.add_(addend)`` after it.

Launches and bytes saved are computed; times are measured on the GPU this runs on.

    python bench/bench_addend_fold.py --out docs/bench/addend_fold_h200.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiter_patches.kernels.moe_sort_mx_quant import moe_sort_mx_quant  # noqa: E402
from bench.harness import copy_bandwidth, gpu_name, graph_us, launch_floor_us, n_sets  # noqa: E402

TOKENS = [1, 8, 64, 512, 4096, 32768]
HIDDEN = [2048, 6144, 7168]
EXPERTS, TOPK, BLOCK = 256, 8, 32


def _sets(M, hidden, k):
    out = []
    for _ in range(k):
        logits = torch.rand(M, EXPERTS, device="cuda")
        ids = logits.topk(TOPK, dim=1).indices.to(torch.int32).contiguous()
        w = torch.rand(M, TOPK, device="cuda").softmax(1)
        add = torch.randn(M, hidden, device="cuda").to(torch.bfloat16)
        routed = torch.randn(M, hidden, device="cuda").to(torch.bfloat16)
        out.append((ids, w, add, routed))
    return out


def row(M: int, hidden: int, bw: float) -> dict:
    per_set = M * hidden * 2 * 3 + M * TOPK * 8
    sets = _sets(M, hidden, n_sets(per_set))

    def sort(s, init):
        return lambda: moe_sort_mx_quant(s[0], s[1], EXPERTS, hidden, torch.bfloat16, BLOCK, moe_buf_init=init)

    n = 200 if M <= 512 else 40
    folded = graph_us([sort(s, s[2]) for s in sets], n)
    zero_sort = graph_us([sort(s, None) for s in sets], n)
    add_only = graph_us([(lambda s=s: s[3] + s[2]) for s in sets], n)
    copy_in = graph_us([(lambda s=s: s[3].copy_(s[2])) for s in sets], n)
    add_inplace = graph_us([(lambda s=s: s[3].add_(s[2])) for s in sets], n)
    row_bytes = M * hidden * 2
    return {
        "tokens": M, "hidden": hidden,
        "sort+zero, +add (us)": zero_sort + add_only,
        "sort writes addend (us)": folded,
        "ratio": (zero_sort + add_only) / folded,
        "launches saved": 1,
        # zero-fill (1 write) + add (2 reads, 1 write) -> addend fill (1 read, 1 write): two passes saved
        "bytes saved (MB)": 2 * row_bytes / 1e6,
        "copy before stage 2 (us)": copy_in,
        "add after (us)": add_inplace,
        "copy/add": copy_in / add_inplace,
        "add byte floor (us)": 3 * row_bytes / bw * 1e6,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    bw = copy_bandwidth()
    floor = launch_floor_us()
    rows = [row(M, h, bw) for M in TOKENS for h in HIDDEN]
    cols = list(rows[0])
    lines = [
        f"# Addend fold benchmark ({gpu_name()})",
        "",
        "Command: `python bench/bench_addend_fold.py --out docs/bench/addend_fold_h200.md`",
        f"CUDA-graph replay, median of 7; launch floor (empty Triton kernel) {floor:.2f} us; "
        f"copy bandwidth {bw / 1e12:.2f} TB/s. experts {EXPERTS}, topk {TOPK}, block {BLOCK}.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
