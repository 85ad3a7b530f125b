"""Benchmark on an AMD GPU: the patched paths against AITER's own sort + quant and block-scale GEMM kernels.

Same method and shapes as the H200 tables in docs/bench: GPU time per call from CUDA-graph
replay of back-to-back calls over rotated input sets, medians of several replays, the launch
floor (an empty Triton kernel) measured in the same run.

- Sort + quant (the shapes of bench_moe_sort_quant.py): the one-launch `moe_sort_mx_quant`
  (sort + `moe_buf` zero-fill + stage-1 MXFP4 quant) against AITER's `moe_sorting` followed by
  `fused_dynamic_mxfp4_quant_moe_sort`, called as `fused_moe` calls them.
- Block-scale GEMM (the (N, K) shapes ``GEMM_SHAPES`` at ``GEMM_MS`` tokens): AITER's
  `gemm_a8w8_blockscale_bpreshuffle_asm` (memset + its `.co`) against the patched call with
  `out_zeroed=True` (the same `.co` through aiter_patches' launcher, no memset), at a split
  count above one where K allows; plus the memset alone, and the relative difference of the
  two results (the kernel's splits add atomically, so not bitwise).

    python bench/bench_vs_aiter_rocm.py --aiter --out rocm_bench.md   # ROCm, AMD's AITER importable
    python bench/bench_vs_aiter_rocm.py --out bench.md                  # the patched kernel only, any GPU
    python bench/bench_vs_aiter_rocm.py --dry-run                       # the rows it would measure
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_moe_sort_quant import BLOCK, DECODE, FP4, MODELS, PREFILL, SETS, make_inputs  # noqa: E402
from bench.harness import gpu_name, graph_us, launch_floor_us  # noqa: E402

GEMM_NAME = "gemm_out_zeroed"
GEMM_MS = [1, 7, 16, 64, 512, 4096]
GEMM_SHAPES = [(7168, 2048), (4608, 7168), (24576, 1536), (7168, 16384), (1536, 7168)]  # (N, K)


def sort_rows(quick: bool) -> list[tuple[int, int, int, int]]:
    models = MODELS[:1] if quick else MODELS
    tokens = DECODE if quick else DECODE + PREFILL
    return [(E, K, N, M) for E, K, N in models for M in tokens]


def gemm_rows(quick: bool) -> list[tuple[int, int, int]]:
    shapes = GEMM_SHAPES[:2] if quick else GEMM_SHAPES
    ms = [m for m in GEMM_MS if m <= 64] if quick else GEMM_MS
    return [(M, N, K) for N, K in shapes for M in ms]


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def err_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"


# ---------------------------------------------------------------- sort + quant


def bench_sort(E, K, N, M, aiter_ops):
    import torch

    from aiter_patches.kernels.moe_sort_mx_quant import moe_sort_mx_quant

    sets = [make_inputs(M, K, E, N, s) for s in range(SETS)]
    calls, reps = (40, 7) if M <= 1024 else (6, 3)
    row = dict(E=E, K=K, N=N, M=M)

    def each(fn):
        return [lambda i=i: fn(*sets[i % SETS]) for i in range(calls)]

    row["patched"] = graph_us(each(lambda ids, w, x: moe_sort_mx_quant(
        ids, w, E, N, torch.bfloat16, BLOCK, quant_input=x, quant_dtype=FP4)), calls, reps)
    if aiter_ops is None:
        return row
    fm, quant = aiter_ops

    def sort(ids, w, x):
        return fm.moe_sorting(ids, w, E, N, torch.bfloat16, BLOCK)

    def mx_quant(x, sorted_ids, sorted_w, num_valid):
        return quant.fused_dynamic_mxfp4_quant_moe_sort(
            x, sorted_ids=sorted_ids, num_valid_ids=num_valid, token_num=M, topk=K, block_size=BLOCK,
            num_rows=None, sorted_weights=sorted_w)

    def chain(ids, w, x):
        sorted_ids, sorted_w, _, num_valid, _ = sort(ids, w, x)
        return mx_quant(x, sorted_ids, sorted_w, num_valid)

    try:
        row["aiter_sort"] = graph_us(each(sort), calls, reps)
        sorted_sets = [sort(*s) for s in sets]
        row["aiter_quant"] = graph_us(
            [lambda i=i: mx_quant(sets[i % SETS][2], sorted_sets[i % SETS][0], sorted_sets[i % SETS][1],
                                  sorted_sets[i % SETS][3]) for i in range(calls)], calls, reps)
        row["aiter_chain"] = graph_us(each(chain), calls, reps)
    except Exception as exc:  # noqa: BLE001 - an AITER op that does not run here is reported, not fatal
        row["aiter_error"] = err_text(exc)
    return row


def sort_table(rows, floor, with_aiter) -> list[str]:
    out = [f"## MoE sort + moe_buf zero-fill + MXFP4 stage-1 quant (block_size {BLOCK})", "",
           "`patched`: aiter_patches' one-launch kernel (four launches above its pair limit). "
           "`AITER sort + quant`: `moe_sorting` then `fused_dynamic_mxfp4_quant_moe_sort`, in one graph. "
           f"Launch floor {floor:.2f} us. Times in us.", "",
           "| experts | topk | hidden | tokens | patched | AITER sort | AITER quant | AITER sort + quant "
           "| AITER / patched |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        chain = r.get("aiter_chain")
        ratio = f"{chain / r['patched']:.2f}x" if chain and r["patched"] else ("not measured" if not with_aiter
                                                             else r.get("aiter_error", "n/a"))
        out.append(f"| {r['E']} | {r['K']} | {r['N']} | {r['M']} | {fmt(r['patched'])} | {fmt(r.get('aiter_sort'))} "
                   f"| {fmt(r.get('aiter_quant'))} | {fmt(chain)} | {ratio} |")
    return out


# ---------------------------------------------------------------- block-scale GEMM


def gemm_split(M, N, K, sms, kernels) -> int:
    """The Triton stand-in's split choice, lowered until AITER's launcher accepts it (1 if none does)."""
    from aiter_patches_standin import blockscale_gemm_splitk as bg  # its heuristic only: a split that fills the GPU
    from aiter_patches.kernels import hip_blockscale_asm as hb

    for split in range(bg.choose_splits_triton(M, N, K, sms), 1, -1):
        try:
            if hb.select_kernel(M, N, K, kernels, sms, split)[1] == split:
                return split
        except ValueError:
            continue
    return 1


def bench_gemm(M, N, K, gemm_ops, sms, kernels, fp8):
    import torch

    import aiter_patches
    from aiter_patches.reference.blockscale_gemm import shuffle_weight_16x16

    original, patched = gemm_ops
    split = gemm_split(M, N, K, sms, kernels)
    set_bytes = M * K + N * K + 2 * M * N
    n_sets = max(2, min(8, -(-(256 << 20) // set_bytes)))
    n_calls = max(20, min(200, int(2e9 // (set_bytes * 4)) + 1))
    sets = []
    for seed in range(n_sets):
        g = torch.Generator(device="cuda").manual_seed(seed)
        A = (torch.randn(M, K, device="cuda", generator=g) * 2).to(fp8)
        B = shuffle_weight_16x16((torch.randn(N, K, device="cuda", generator=g) * 2).to(fp8))
        sa = (torch.rand(K // 128, M, device="cuda", generator=g) * 0.02 + 0.001).contiguous().view(M, K // 128)
        sb = torch.rand(N // 128, K // 128, device="cuda", generator=g) * 0.02 + 0.001
        sets.append(dict(A=A, B=B, sa=sa, sb=sb, out=torch.zeros(M, N, dtype=torch.bfloat16, device="cuda")))
    row = dict(M=M, N=N, K=K, split=split)

    def calls(fn):
        return [lambda s=s: fn(s) for s in sets]

    try:
        row["aiter"] = graph_us(calls(lambda s: original(s["A"], s["B"], s["out"], s["sa"], s["sb"], splitK=split)),
                                n_calls)
    except Exception as exc:  # noqa: BLE001
        row["note"] = f"AITER's call failed: {err_text(exc)}"
        return row
    if split <= 1:
        row["note"] = "split 1: AITER launches no memset, the patch passes the call through"
        return row
    row["memset"] = graph_us(calls(lambda s: s["out"].zero_()), n_calls)
    s0 = sets[0]
    before = aiter_patches.stats()[GEMM_NAME]
    reference = torch.zeros(M, N, dtype=torch.bfloat16, device="cuda")
    original(s0["A"], s0["B"], reference, s0["sa"], s0["sb"], splitK=split)
    mine = torch.zeros(M, N, dtype=torch.bfloat16, device="cuda")
    patched(s0["A"], s0["B"], mine, s0["sa"], s0["sb"], splitK=split, out_zeroed=True)
    after = aiter_patches.stats()[GEMM_NAME]
    if after["fast"] == before["fast"]:
        fell = {k: v for k, v in after["fallback"].items() if v != before["fallback"].get(k)}
        errors = {k: v for k, v in after["errors"].items() if v != before["errors"].get(k)}
        row["note"] = f"the patch handed the call back: {fell or errors}"
        return row
    torch.cuda.synchronize()
    row["rel_diff"] = ((mine.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-30)).item()
    row["patched"] = graph_us(calls(lambda s: patched(s["A"], s["B"], s["out"], s["sa"], s["sb"], splitK=split,
                                                      out_zeroed=True)), n_calls)
    return row


def gemm_table(rows) -> list[str]:
    out = ["## Block-scale fp8 GEMM, AITER's asm `.co`: memset + GEMM against the patched `out_zeroed=True`", "",
           "`AITER`: `gemm_a8w8_blockscale_bpreshuffle_asm(..., splitK=split)` (hipMemsetAsync + the kernel). "
           "`patched`: the same `.co` launched by aiter_patches into a zeroed `out`, no memset. "
           "`rel. diff`: 2-norm of (patched - AITER) / AITER on one input (atomic split adds: not bitwise). "
           "Times in us.", "",
           "| M | N | K | split | AITER | patched | saved | memset alone | patched / AITER | rel. diff | note |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        a, p = r.get("aiter"), r.get("patched")
        saved = None if a is None or p is None else a - p
        ratio = "n/a" if saved is None else f"{p / a:.2f}"
        diff = r.get("rel_diff")
        out.append(f"| {r['M']} | {r['N']} | {r['K']} | {r['split']} | {fmt(a)} | {fmt(p)} | {fmt(saved)} "
                   f"| {fmt(r.get('memset'))} | {ratio} | {'n/a' if diff is None else f'{diff:.1e}'} "
                   f"| {r.get('note', '')} |")
    return out


# ---------------------------------------------------------------- driver


def aiter_modules():
    """(fused_moe, quant, gemm_op_a8w8) of AMD's AITER, or raise saying why not."""
    from aiter_patches.verify import real_aiter_problem

    problem = real_aiter_problem()
    if problem is None:
        import aiter

        if getattr(aiter, "IS_AITER_PATCHES_STAND_IN", False):
            problem = "the importable aiter is aiter_patches' stand-in"
    if problem is not None:
        raise RuntimeError(f"--aiter needs AMD's AITER: {problem}")
    import aiter.fused_moe as fm
    import aiter.ops.gemm_op_a8w8 as gemm_op
    import aiter.ops.quant as quant

    import aiter_patches

    aiter_patches.revert()  # AITER's own kernels, even where the auto switch patched this process
    return fm, quant, gemm_op


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="markdown file to write")
    p.add_argument("--aiter", action="store_true", help="also time AITER's own kernels (needs AMD's AITER)")
    p.add_argument("--quick", action="store_true", help="first model's decode sizes; two GEMM shapes, M <= 64")
    p.add_argument("--part", choices=("all", "sort", "gemm"), default="all")
    p.add_argument("--dry-run", action="store_true", help="list the rows and exit")
    args = p.parse_args(argv)
    do_sort, do_gemm = args.part in ("all", "sort"), args.part in ("all", "gemm")
    if args.dry_run:
        if do_sort:
            print(f"sort + quant rows (experts, topk, hidden, tokens): {sort_rows(args.quick)}")
        if do_gemm:
            print(f"GEMM rows (M, N, K): {gemm_rows(args.quick)}" + ("" if args.aiter else " (need --aiter)"))
        return 0
    if not args.out:
        p.error("--out is required (unless --dry-run)")
    import torch

    if not torch.cuda.is_available():
        print("no GPU here: this benchmark runs on a ROCm (or, without --aiter, CUDA) machine")
        return 2
    modules = None
    if args.aiter:
        try:
            modules = aiter_modules()
        except Exception as exc:  # noqa: BLE001
            print(exc)
            return 3
    torch.manual_seed(0)
    floor = launch_floor_us()
    hip = getattr(torch.version, "hip", None)
    lines = [f"# aiter_patches against AITER on {gpu_name()}", "",
             f"torch {torch.__version__}, HIP {hip or 'none (not ROCm)'}; "
             f"AITER {'measured' if modules else 'not measured (run with --aiter on ROCm)'}.", ""]
    status = 0
    if do_sort:
        rows = []
        for E, K, N, M in sort_rows(args.quick):
            try:
                rows.append(bench_sort(E, K, N, M, modules[:2] if modules else None))
            except Exception as exc:  # noqa: BLE001 - one failing row is reported; the others still run
                rows.append(dict(E=E, K=K, N=N, M=M, patched=None, aiter_error=f"patched failed: {err_text(exc)}"))
                status = 1
            r = rows[-1]
            print(f"sort E={E} K={K} N={N} M={M}: patched {fmt(r['patched'])} AITER {fmt(r.get('aiter_chain'))} "
                  f"{r.get('aiter_error', '')}", flush=True)
        lines += sort_table(rows, floor, modules is not None) + [""]
    if do_gemm and modules is None:
        lines += ["## Block-scale fp8 GEMM", "", "Not measured: it times AITER's `.co` (run with --aiter on ROCm).",
                  ""]
    elif do_gemm:
        import aiter_patches
        from aiter_patches.kernels import hip_blockscale_asm as hb

        gemm_op = modules[2]
        original = gemm_op.gemm_a8w8_blockscale_bpreshuffle_asm
        aiter_patches.apply([GEMM_NAME])
        state = {r["name"]: r for r in aiter_patches.status()["patches"]}[GEMM_NAME]
        patched = gemm_op.gemm_a8w8_blockscale_bpreshuffle_asm
        if patched is original:
            lines += ["## Block-scale fp8 GEMM", "", f"Not measured: the patch did not apply ({state}).", ""]
            status = 1
        else:
            import aiter

            dev = torch.device("cuda", 0)
            root = hb.aiter_root_of(aiter)
            gfx = hb.gfx_of(dev)
            kernels = hb.load_kernel_list(root, gfx)
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            rows = []
            for M, N, K in gemm_rows(args.quick):
                try:
                    rows.append(bench_gemm(M, N, K, (original, patched), sms, kernels, aiter.dtypes.fp8))
                except Exception as exc:  # noqa: BLE001
                    rows.append(dict(M=M, N=N, K=K, split="?", note=f"failed: {err_text(exc)}"))
                    status = 1
                r = rows[-1]
                print(f"gemm M={M} N={N} K={K} split={r['split']}: AITER {fmt(r.get('aiter'))} "
                      f"patched {fmt(r.get('patched'))} {r.get('note', '')}", flush=True)
                torch.cuda.empty_cache()
            lines += gemm_table(rows) + [""]
            if any("handed the call back" in r.get("note", "") for r in rows):
                status = 1
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
