"""Registers, spills and scratch of the one-launch sort + quant kernel on gfx942/gfx950, on CPU.

Why: no AMD GPU is reachable here, but Triton's AMD backend compiles without one. The launcher
is driven with CPU tensors at each model's decode sizes; its ``_sort_quant_kernel`` launch is
recorded instead of run (arguments and constexprs), then compiled for each arch and the AMDGPU
metadata read from the assembly (LDS: the kernel's dynamic shared memory). Shapes that take the
prescanned launches (past ONE_LAUNCH_MAX_PAIRS pairs, or ONE_LAUNCH_MAX_PAIR_BINS pairs x expert bins)
are skipped. ``--variants old`` shows the per-program expert count that the decode path replaced
(DECODE_MAX_PAIRS = 0).

    python bench/amd_spills_sort.py [--arch gfx950,gfx942] [--tokens 1,16,64] [--variants new,old]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from aiter_patches.kernels import moe_sort_mx_quant as k  # noqa: E402

MODELS = [(256, 8, 7168), (896, 16, 3584), (128, 4, 6144), (128, 8, 4096)]
_PTR = {torch.int32: "*i32", torch.float32: "*fp32", torch.uint8: "*u8", torch.bfloat16: "*bf16",
        torch.float16: "*fp16"}


class _Recorder:
    """Stands in for the kernel: ``rec[grid](*args, **kw)`` keeps the call, launches nothing."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


def captured_launch(E, K, N, M, block=32, mask=False):
    rec = _Recorder(k._sort_quant_kernel)
    real, k._sort_quant_kernel = k._sort_quant_kernel, rec
    try:
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(M)]).int()
        w = torch.rand(M, K)
        x = torch.randn(M, N).bfloat16()
        em = torch.ones(E, dtype=torch.int32) if mask else None
        k.moe_sort_mx_quant(ids, w, E, N, torch.bfloat16, block, quant_input=x,
                            quant_dtype=torch.float4_e2m1fn_x2, expert_mask=em)
    finally:
        k._sort_quant_kernel = real
    (grid, args, kw), = rec.calls
    return real, args, kw


def compile_stats(fn, args, kw, arch):
    kw = dict(kw)
    num_warps = kw.pop("num_warps", 4)
    names = fn.arg_names
    sig, consts = {}, {}
    for name, a in zip(names, args):
        sig[name] = _PTR[a.dtype] if isinstance(a, torch.Tensor) else "i32"
    for name, v in kw.items():
        sig[name] = "constexpr"
        consts[name] = v
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    target = GPUTarget("hip", arch, 64)
    t0 = time.time()
    ck = triton.compile(src, target=target, options={"num_warps": num_warps})
    asm = ck.asm["amdgcn"]

    def field(pat):
        m = re.search(pat, asm)
        return int(m.group(1)) if m else -1

    return dict(vgpr=field(r"\.vgpr_count:\s+(\d+)"), sgpr=field(r"\.sgpr_count:\s+(\d+)"),
                sgpr_spill=field(r"\.sgpr_spill_count:\s+(\d+)"), vgpr_spill=field(r"\.vgpr_spill_count:\s+(\d+)"),
                scratch=field(r"; ScratchSize:\s+(\d+)"), lds=ck.metadata.shared,  # dynamic LDS
                secs=time.time() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="gfx950,gfx942")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--variants", default="new", help="new (module defaults) and/or old (DECODE_MAX_PAIRS=0, one launch to 2048 pairs)")
    ap.add_argument("--mask", action="store_true", help="with an expert mask (EP)")
    args = ap.parse_args()
    print("| variant | arch | experts | topk | hidden | tokens | path | VGPRs | SGPRs | SGPR spills "
          "| VGPR spills | scratch B | LDS B |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    old = dict(DECODE_MAX_PAIRS=0, DECODE_PAIRS_PER_BIN=0, ONE_LAUNCH_MAX_PAIR_BINS=1 << 30)  # one launch to 2048 pairs
    variants = args.variants.split(",")
    if set(variants) - {"new", "old"}:
        raise SystemExit(f"amd_spills_sort: --variants takes new and/or old, not {args.variants!r}")
    for variant in variants:
        with mock.patch.multiple(k, **old) if variant == "old" else contextlib.nullcontext():
            for E, K, N in MODELS:
                for M in map(int, args.tokens.split(",")):
                    path = k.decode_path(M, K, E)
                    if path == "prescanned":  # four launches, not the one-launch methods compared here
                        continue
                    fn, a, kw = captured_launch(E, K, N, M, mask=args.mask)
                    for arch in args.arch.split(","):
                        s = compile_stats(fn, a, kw, arch)
                        print(f"| {variant} | {arch} | {E} | {K} | {N} | {M} | {path} | {s['vgpr']} | {s['sgpr']} "
                              f"| {s['sgpr_spill']} | {s['vgpr_spill']} | {s['scratch']} | {s['lds']} |", flush=True)


if __name__ == "__main__":
    main()
