"""Count Triton JIT compiles during a serving loop of the patched kernels: the precompile check.

A ROCm server image should carry a Triton cache filled at build time (`aiter-patches compile
--cache-dir DIR`, on a CPU builder); with `TRITON_CACHE_DIR=DIR` the server must then compile
nothing while it serves. Each JIT compile costs about 2 s on AMD, inside start-up or inside the
first request at a new batch size. This script plays the server, in a fresh process: it calls
the kernel entry the sort patch calls (`moe_sort_mx_quant`), with the arguments the patch passes
for one model, over the batch sizes a server captures CUDA graphs for and a few prefill sizes,
for every quant dtype, block size and EP mode asked for, and counts the compiles.

What it does not run: AITER's `fused_moe` (that needs the model's weights). The GEMM patch
launches AITER's own `.co` on AMD, which Triton does not compile.

Counting: Triton's compilation listener (`triton.knobs.compilation.listener`) sees every
kernel the process compiles or loads from the cache (`cache_hit`); the files added to the
cache folder are counted as a cross-check.

    TRITON_CACHE_DIR=/cache python scripts/serving_loop_compiles.py --model deepseek-v3
    TRITON_CACHE_DIR=/tmp/c python scripts/serving_loop_compiles.py --model deepseek-v3 --warm   # fill, then rerun

Exit status: 0 no compile (every variant came from the cache); 1 some compiled (listed);
2 cannot run here (no GPU, no listener, bad arguments); 3 no kernel was compiled or loaded at all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (experts, topk, hidden) from the models' published configs (issue 13's presets).
MODELS = {
    "deepseek-v3": (256, 8, 7168),
    "qwen3-235b": (128, 8, 4096),
    "minimax-m3": (128, 4, 6144),
    "kimi-k3": (896, 16, 3584),
}
ALIASES = {"deepseekr1": "deepseek-v3", "deepseekv3r1": "deepseek-v3"}
# Batch sizes of a typical CUDA-graph capture list, then prefill chunks.
DECODE_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512)
PREFILL_TOKENS = (1024, 2048, 4096, 8192)
QUANTS = ("none", "mxfp4", "mxfp8")
EP_MODES = ("off", "mask")
BLOCK_SIZES = (16, 32, 64, 128)


def model_shape(name: str) -> tuple[str, tuple[int, int, int]]:
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    by_key = {re.sub(r"[^a-z0-9]", "", k): k for k in MODELS}
    canonical = by_key.get(key) or ALIASES.get(key)
    if canonical is None:
        raise SystemExit(f"unknown model {name!r}: one of {', '.join(MODELS)}")
    return canonical, MODELS[canonical]


@dataclass
class CompileCount:
    """What the compilation listener saw: kernels compiled and kernels loaded from the cache."""

    compiled: list[str] = field(default_factory=list)
    cache_hits: list[str] = field(default_factory=list)

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?")
        consts = getattr(src, "constants", None) or getattr(src, "constexprs", None) or {}
        label = f"{name} {sorted((str(k), str(v)) for k, v in dict(consts).items())}"
        (self.cache_hits if cache_hit else self.compiled).append(label)

    def verdict(self) -> tuple[int, str]:
        seen = len(self.compiled) + len(self.cache_hits)
        if seen == 0:
            return 3, "no Triton kernel was compiled or loaded: the loop reached no kernel"
        if self.compiled:
            return 1, f"{len(self.compiled)} JIT compile(s) of {seen} kernel variants"
        return 0, f"0 JIT compiles: all {seen} kernel variants came from the cache"


def cache_files(folder: str | None) -> set[str]:
    if not folder or not os.path.isdir(folder):
        return set()
    return {os.path.join(d, f) for d, _, files in os.walk(folder) for f in files}


def compiled_kernel_file(path: str) -> bool:
    """A compile writes one `<kernel>.json` metadata file (beside its `__grp__` group file)."""
    base = os.path.basename(path)
    return base.endswith(".json") and not base.startswith("__grp__")


def variants(args, fp8):
    import torch

    quant_dtypes = {"none": None, "mxfp4": torch.float4_e2m1fn_x2, "mxfp8": fp8}
    for quant in args.quant:
        for ep in args.ep:
            for block in args.block_sizes:
                for tokens in args.tokens:
                    yield quant, quant_dtypes[quant], ep, block, tokens


def fp8_dtype():
    """AITER's fp8 for this GPU: e4m3fnuz on gfx942, e4m3fn elsewhere."""
    import torch

    try:
        from aiter import dtypes

        return dtypes.fp8
    except Exception:  # noqa: BLE001 - no AITER: decide from the arch
        arch = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "") or ""
        return torch.float8_e4m3fnuz if arch.startswith("gfx942") else torch.float8_e4m3fn


def run_loop(args, E, topk, hidden, fp8) -> list[str]:
    """One call per variant, as the patch makes it; returns the variants the kernel's gate declined."""
    import torch

    from aiter_patches.kernels import moe_sort_mx_quant as k

    declined = []
    g = torch.Generator(device="cuda").manual_seed(0)
    mask = torch.zeros(E, dtype=torch.int32, device="cuda")
    mask[: E // 2] = 1
    for quant, qdtype, ep, block, M in variants(args, fp8):
        ids = torch.argsort(torch.rand(M, E, device="cuda", generator=g), dim=1)[:, :topk].int().contiguous()
        w = torch.rand(M, topk, device="cuda", generator=g)
        x = torch.randn(M, hidden, device="cuda", generator=g).bfloat16() if qdtype is not None else None
        expert_mask = mask if ep == "mask" else None
        reason = k.unsupported_reason(ids, w, E, hidden, block, expert_mask, None, x, qdtype, None, None)
        if reason is not None:
            declined.append(f"{quant} ep={ep} block={block} tokens={M}: {reason}")
            continue
        k.moe_sort_mx_quant(ids, w, E, hidden, torch.bfloat16, block, expert_mask=expert_mask,
                            quant_input=x, quant_dtype=qdtype)
    torch.cuda.synchronize()
    return declined


def plan_text(args, name, shape) -> str:
    E, topk, hidden = shape
    n = len(args.quant) * len(args.ep) * len(args.block_sizes) * len(args.tokens)
    return (f"model {name}: experts {E}, topk {topk}, hidden {hidden}\n"
            f"quant {','.join(args.quant)}; EP {','.join(args.ep)}; block sizes "
            f"{','.join(map(str, args.block_sizes))}; tokens {','.join(map(str, args.tokens))}\n"
            f"{n} calls of aiter_patches.kernels.moe_sort_mx_quant.moe_sort_mx_quant")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v3", help=f"one of {', '.join(MODELS)}")
    p.add_argument("--tokens", type=int, nargs="+", default=list(DECODE_TOKENS + PREFILL_TOKENS))
    p.add_argument("--quant", nargs="+", choices=QUANTS, default=list(QUANTS))
    p.add_argument("--ep", nargs="+", choices=EP_MODES, default=list(EP_MODES))
    p.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    p.add_argument("--warm", action="store_true", help="fill the cache: compiles allowed, exit 0 if the loop ran")
    p.add_argument("--dry-run", action="store_true", help="print the loop and exit")
    p.add_argument("--json", help="also write the counts to this file")
    args = p.parse_args(argv)
    name, shape = model_shape(args.model)
    print(plan_text(args, name, shape))
    if args.dry_run:
        return 0
    cache = os.environ.get("TRITON_CACHE_DIR")
    print(f"TRITON_CACHE_DIR={cache or '(unset: Triton default ~/.triton/cache)'}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1: the interpreter compiles nothing; this check needs a GPU")
        return 2
    import torch
    import triton

    if not torch.cuda.is_available():
        print("no GPU: the precompile check runs on the ROCm (or CUDA) machine that serves")
        return 2
    knobs = getattr(triton, "knobs", None)
    listening = knobs is not None and hasattr(knobs.compilation, "listener")
    fp8 = fp8_dtype()  # may import AITER: before the counting starts
    from aiter_patches.kernels import moe_sort_mx_quant  # noqa: F401
    counter = CompileCount()
    before = cache_files(cache)
    if listening:
        knobs.compilation.listener = counter
    else:
        print(f"triton {triton.__version__} has no compilation listener: compiles are counted as kernels "
              "added to the cache folder")
    start = time.perf_counter()
    try:
        declined = run_loop(args, *shape, fp8)
    finally:
        if listening:
            knobs.compilation.listener = None
    seconds = time.perf_counter() - start
    added = sorted(cache_files(cache) - before)
    if not listening:
        counter.compiled = [os.path.basename(f) for f in added if compiled_kernel_file(f)]
        counter.cache_hits = ["(not observable without a listener)"] if not counter.compiled else []
    rc, verdict = counter.verdict()
    print(f"device {torch.cuda.get_device_name(0)}; triton {triton.__version__}; loop {seconds:.1f} s")
    print(f"loaded from the cache: {len(counter.cache_hits)}; compiled: {len(counter.compiled)}; "
          f"files added to the cache folder: {len(added)}")
    for label in counter.compiled:
        print(f"  compiled: {label}")
    if declined:
        print(f"{len(declined)} variant(s) the kernel's gate declines (AITER runs them; not counted):")
        for d in declined[:20]:
            print(f"  {d}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": name, "compiled": counter.compiled, "cache_hits": len(counter.cache_hits),
            "files_added": len(added), "declined": declined, "seconds": seconds}, indent=1))
    if args.warm:
        print(f"warm-up: {verdict}")
        return 0 if rc in (0, 1) else rc
    print(("PASS: " if rc == 0 else "FAIL: ") + verdict)
    return rc


if __name__ == "__main__":
    sys.exit(main())
