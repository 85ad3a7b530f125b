"""Benchmark: split-K block-scale fp8 GEMM, memset + GEMM against GEMM into a pre-zeroed output.

GPU time per call from CUDA-graph replay of back-to-back calls over rotated input
sets (so L2 does not hold the weights), median of several replays. In the same run:
the Triton GEMM with AITER's memset (zero_out=True) and without it (zero_out=False),
torch's block-scaled fp8 `scaled_mm`, bf16 `torch.matmul`, the byte floor (bytes
that must move / measured copy bandwidth) and the launch floor (an empty kernel).

    python bench/bench_blockscale_gemm.py --out bench/blockscale_gemm.md
    python bench/bench_blockscale_gemm.py --out sweep.md --sweep   # every valid split, M <= 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiter_patches.kernels import blockscale_gemm_splitk as bg  # noqa: E402
from aiter_patches.reference.blockscale_gemm import blockscale_gemm_reference, shuffle_weight_16x16  # noqa: E402
from bench.harness import copy_bandwidth, graph_us, launch_floor_us  # noqa: E402

MS = [1, 7, 16, 64, 512, 4096]
SHAPES = [(7168, 2048), (4608, 7168), (24576, 1536), (7168, 16384), (1536, 7168)]
ROTATE_BYTES = 256 << 20


def make_set(M, N, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    A = (torch.randn(M, K, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    B = (torch.randn(N, K, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    sa = (torch.rand(K // 128, M, device="cuda", generator=g) * 0.02 + 0.001).t()  # logical [M, K/128], K-major
    sb = torch.rand(N // 128, K // 128, device="cuda", generator=g) * 0.02 + 0.001
    return dict(A=A, B=B, Bs=shuffle_weight_16x16(B), sa=sa, sb=sb,
                out=torch.zeros(M, N, dtype=torch.bfloat16, device="cuda"))


def scaled_mm_call(s, M):
    """A zero-arg call of torch's block-scaled fp8 matmul for input set `s`, or raise with the reason.

    Tries the scale layouts torch may want (it asks for scale_b as [K/128, N/128]) and keeps
    the first whose result matches the reference.
    """
    F = torch.nn.functional
    st = F.ScalingType
    pad = max(4, -(-M // 4) * 4) - M
    A = F.pad(s["A"].view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn) if pad else s["A"]
    sa = F.pad(s["sa"].t(), (0, pad), value=1.0).t() if pad else s["sa"]  # stays K-major
    b = s["B"].t()
    ref = blockscale_gemm_reference(s["A"], s["B"], s["sa"], s["sb"])
    errors = []
    for sa_v in (sa, sa.contiguous()):
        for sb_v in (s["sb"].t(), s["sb"].t().contiguous(), s["sb"]):
            def call(sa_v=sa_v, sb_v=sb_v):
                return F.scaled_mm(A, b, sa_v, st.BlockWise1x128, sb_v, st.BlockWise128x128,
                                   output_dtype=torch.bfloat16)
            try:
                got = call()[:M].float()
            except Exception as e:  # noqa: BLE001 - try the next layout
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            err = ((got - ref).norm() / ref.norm()).item()
            if err <= 2e-2:
                return call, (f" (M padded to {M + pad})" if pad else "")
            errors.append(f"result off by {err:.3g}")
    raise RuntimeError("; ".join(dict.fromkeys(errors)))


def bench_shape(M, N, K, bw, floor, sweep):
    set_bytes = M * K + N * K + 2 * M * N
    n_sets = max(2, min(8, -(-ROTATE_BYTES // set_bytes)))
    sets = [make_set(M, N, K, seed) for seed in range(n_sets)]
    n_calls = max(20, min(200, int(2e9 // (set_bytes * 4)) + 1))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = bg.choose_splits_triton(M, N, K, sms)

    def gemm(split, zero_out):
        return [lambda s=s: bg.blockscale_gemm_splitk(s["A"], s["Bs"], s["out"], s["sa"], s["sb"], splits=split,
                                                      zero_out=zero_out) for s in sets]

    row = dict(M=M, N=N, K=K, split=default)
    row["memset"] = graph_us(gemm(default, True), n_calls)
    row["zeroed"] = graph_us(gemm(default, False), n_calls) if default > 1 else row["memset"]
    # the memset's own replay time: the goal is saving at least this much
    row["memset_alone"] = graph_us([lambda s=s: s["out"].zero_() for s in sets], n_calls) if default > 1 else None
    try:
        calls, note = zip(*[scaled_mm_call(s, M) for s in sets])
        row["scaled_mm"] = graph_us(list(calls), n_calls)
        row["scaled_mm_note"] = note[0]
    except Exception as e:  # noqa: BLE001 - report whatever stops torch's op
        row["scaled_mm"] = None
        row["scaled_mm_note"] = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    bf = [(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), torch.randn(N, K, device="cuda",
                                                                                dtype=torch.bfloat16))
          for _ in range(max(2, n_sets // 2))]
    row["bf16"] = graph_us([lambda a=a, w=w: torch.matmul(a, w.t()) for a, w in bf], n_calls)
    del bf
    scale_bytes = 4 * (M * (K // 128) + (N // 128) * (K // 128))
    row["floor"] = (set_bytes + scale_bytes) / bw * 1e6
    row["launch"] = floor
    if sweep and M <= 64:
        row["sweep"] = {s: graph_us(gemm(s, False), n_calls) for s in range(1, bg.MAX_SPLITS + 1)
                        if bg.valid_split(K, s)}
    return row


TUNE_CONFIGS = {
    16: [(16, 128, 4, 4), (16, 64, 4, 4), (16, 128, 8, 4)],
    64: [(64, 128, 4, 4), (64, 64, 4, 4), (64, 128, 8, 4), (32, 128, 4, 4)],
}


def tune_shape(M, N, K):
    """Best (config, split) for this shape over TUNE_CONFIGS x valid splits; returns printable lines."""
    sets = [make_set(M, N, K, seed) for seed in range(4)]
    n_calls = 40
    lines, default_cfg = [], bg.block_config
    try:
        for bm, bn, warps, stages in TUNE_CONFIGS[16 if M <= 16 else 64]:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            bg.block_config = lambda m, cfg=cfg: cfg
            times = {}
            for split in (1, 2, 3, 4, 6, 7, 8, 10, 14, 16):
                if bg.valid_split(K, split):
                    calls = [lambda s=s, split=split: bg.blockscale_gemm_splitk(
                        s["A"], s["Bs"], s["out"], s["sa"], s["sb"], splits=split, zero_out=False) for s in sets]
                    times[split] = graph_us(calls, n_calls)
            best = min(times, key=times.get)
            lines.append(f"| {M} | {N} | {K} | {bm}x{bn} w{warps} s{stages} | {best} | {times[best]:.1f} | "
                         + ", ".join(f"{k}: {v:.1f}" for k, v in times.items()) + " |")
            print(lines[-1], flush=True)
    finally:
        bg.block_config = default_cfg
    return lines


def fmt(x):
    return "n/a" if x is None else f"{x:.1f}"


def saved_ok(r) -> str:
    if r["memset_alone"] is None:
        return "(split 1: no memset)"
    return "yes" if r["memset"] - r["zeroed"] >= r["memset_alone"] else "no"


def table(rows, bw, floor, device) -> str:
    out = [f"# Block-scale fp8 GEMM, split-K: {device}", "",
           f"CUDA-graph replay, median per call, inputs rotated. Copy bandwidth {bw / 1e12:.2f} TB/s; "
           f"empty-kernel launch floor {floor:.2f} us. Times in us.", "",
           "| M | N | K | split | memset+GEMM | GEMM, pre-zeroed | saved | memset alone | saved >= memset | scaled_mm "
           "| bf16 matmul | byte floor | pre-zeroed / scaled_mm | pre-zeroed / floor |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sm = r["scaled_mm"]
        vs_sm = "n/a" if sm is None else f"{r['zeroed'] / sm:.2f}"
        out.append(
            f"| {r['M']} | {r['N']} | {r['K']} | {r['split']} | {fmt(r['memset'])} | {fmt(r['zeroed'])} "
            f"| {fmt(r['memset'] - r['zeroed'])} | {fmt(r['memset_alone'])} | {saved_ok(r)} "
            f"| {fmt(sm)}{r['scaled_mm_note'] if sm else ''} | {fmt(r['bf16'])} "
            f"| {fmt(r['floor'])} | {vs_sm} "
            f"| {r['zeroed'] / r['floor']:.2f} |")
    notes = [r for r in rows if r["scaled_mm"] is None]
    if notes:
        out += ["", "scaled_mm not measured:"] + [f"- M={r['M']} N={r['N']} K={r['K']}: {r['scaled_mm_note']}"
                                                  for r in notes]
    sweeps = [r for r in rows if "sweep" in r]
    if sweeps:
        out += ["", "## Split sweep (pre-zeroed output)", "", "| M | N | K | default | best | times by split |",
                "|---|---|---|---|---|---|"]
        for r in sweeps:
            best = min(r["sweep"], key=r["sweep"].get)
            times = ", ".join(f"{s}: {t:.1f}" for s, t in r["sweep"].items())
            out.append(f"| {r['M']} | {r['N']} | {r['K']} | {r['split']} | {best} | {times} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="markdown file to write")
    p.add_argument("--ms", type=int, nargs="*", default=MS)
    p.add_argument("--sweep", action="store_true", help="also time every valid split at M <= 64")
    p.add_argument("--tune", action="store_true", help="only sweep tile configs x splits at M <= 64")
    args = p.parse_args()
    if args.tune:
        lines = ["| M | N | K | config | best split | us | by split |", "|---|---|---|---|---|---|---|"]
        for N, K in SHAPES:
            for M in [m for m in args.ms if m <= 64]:
                lines += tune_shape(M, N, K)
        Path(args.out).write_text("\n".join(lines) + "\n")
        return
    torch.manual_seed(0)
    bw = copy_bandwidth()
    floor = launch_floor_us()
    rows = []
    for N, K in SHAPES:
        for M in args.ms:
            rows.append(bench_shape(M, N, K, bw, floor, args.sweep))
            r = rows[-1]
            print(f"M={M} N={N} K={K} split={r['split']} memset={r['memset']:.1f} zeroed={r['zeroed']:.1f} "
                  f"scaled_mm={fmt(r['scaled_mm'])} bf16={r['bf16']:.1f} floor={r['floor']:.1f}", flush=True)
            torch.cuda.empty_cache()
    text = table(rows, bw, floor, torch.cuda.get_device_name(0))
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
