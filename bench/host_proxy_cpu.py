"""CPU proxy of the host time of the patched entry points: everything but the device work, and where it goes.

Why: the H200 benchmark (bench_host_overhead.py) needs a GPU; finding which lines of the host
path cost the microseconds does not. Here every entry of that benchmark runs on CPU tensors with
Triton's real binder over a fake driver (bench/fake_triton.py: nothing compiled, a launch is a
no-op), so what is timed is the Python of the wrappers, gates, plans, allocations (CPU
``torch.empty``, cheaper than CUDA's caching allocator) and launch preparation. The figures are
CPU-proxy figures, not H200 ones: use them for before/after of a host-path change, the H200
table for the goals of issue 15.

Rows: the benchmark's entries (patched, and the same call unpatched with AITER's leaf kernels
replaced by their host cost: the floor), plus the two kernel APIs alone (gate + call).
``--no-plans`` turns the per-shape plan caches of the kernel APIs off (MAX_PLANS = 0) for an
in-run comparison; ``--profile N`` prints each entry's N costliest functions (cProfile, own
time: profiling inflates small calls, read it for proportions).

    python bench/host_proxy_cpu.py                         # table, all four models, tokens 1 and 64
    python bench/host_proxy_cpu.py --models 0 --tokens 1 --profile 12
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # the fake driver needs real JITFunctions
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import bench_host_overhead as bho  # noqa: E402
from bench import fake_triton, harness  # noqa: E402

import aiter_patches  # noqa: E402
from aiter_patches import call_key, runtime  # noqa: E402
from aiter_patches_standin import blockscale_gemm_splitk as gemm_kernel  # noqa: E402
from aiter_patches.kernels import moe_sort_mx_quant as sort_kernel  # noqa: E402
from aiter_patches_standin import use as use_stub_aiter  # noqa: E402


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="0,1,2,3", help="indices into bench_host_overhead.MODELS")
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--profile", type=int, default=0, help="print this many costliest functions per entry")
    p.add_argument("--no-plans", action="store_true", help="kernel APIs without their per-shape plan caches")
    p.add_argument("--breakdown", action="store_true",
                   help="where one hit's time goes, piece by piece (sort, sort + quant, out_zeroed GEMM)")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def api_entries(D, E, K, M):
    """The kernel APIs alone, gate included, as the patches call them."""
    g = torch.Generator().manual_seed(M + E)
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32).contiguous()
    w = torch.rand(M, K, generator=g)
    x = torch.randn(M, D, generator=g).to(torch.bfloat16)
    fp4 = torch.float4_e2m1fn_x2

    def sort_quant():
        assert sort_kernel.unsupported_reason(ids, w, E, D, bho.BLOCK, None, None, x, fp4, None, None) is None
        return sort_kernel.moe_sort_mx_quant(ids, w, E, D, torch.bfloat16, bho.BLOCK, quant_input=x,
                                             quant_dtype=fp4, checked=True)

    fp8 = torch.float8_e4m3fn
    A = torch.randn(M, D).to(fp8)
    B = torch.randn(D, D).to(fp8)
    out = torch.zeros(M, D, dtype=torch.bfloat16)
    a_s = torch.ones(M, D // 128)
    b_s = torch.ones(D // 128, D // 128)

    def gemm():
        assert gemm_kernel.unsupported_reason(A, B, out, a_s, b_s, bho.GEMM_SPLIT, True) is None
        return gemm_kernel.blockscale_gemm_splitk(A, B, out, a_s, b_s, splits=bho.GEMM_SPLIT, zero_out=False,
                                                  checked=True)

    return {"API: gate + moe_sort_mx_quant (MXFP4)": sort_quant, "API: gate + blockscale_gemm_splitk": gemm}


def _profile(fn, n, top) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return "\n".join(lines[start:])


def _loop_ns(fn, n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def _best_us(pieces: dict, n: int, rounds: int) -> dict:
    """Per piece, the lowest over ``rounds`` of the mean of ``n`` back-to-back calls (pieces alternate
    within each round, so a loaded moment of the shared machine costs each piece alike)."""
    best = dict.fromkeys(pieces, float("inf"))
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, fn in pieces.items():
                best[name] = min(best[name], _loop_ns(fn, n))
    finally:
        if gc_was:
            gc.enable()
    return {k: v / 1e3 for k, v in best.items()}


def breakdown(aiter, fm, E, K, D, M, n=2000, rounds=7) -> str:
    """Where one hit of the sort, the sort + MXFP4 quant and the out_zeroed GEMM spends its time (the
    patches applied, the caller's fake driver on). Each piece runs alone in its own loop: the pieces of
    one entry need not add up to its whole (a loop keeps caches warm that a whole call shares)."""
    from aiter_patches.patches import moe_call, moe_pipeline
    from aiter_patches.patches import gemm_out_zeroed as goz
    from aiter_patches.patches import moe_sort_mx_quant as smq

    device = torch.device("cpu")
    calls = bho.entries(aiter, fm, device, E, K, D, M)
    ids, w = bho._routing(M, K, E, device)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(M, D, generator=g).to(torch.bfloat16)
    impl_args = (ids, w, E, D, torch.bfloat16, bho.BLOCK, None, None, 0, True)
    sort_fn = fm._moe_sorting_impl
    built = getattr(sort_fn, moe_pipeline._MARK)
    binder = built.layers[-1][1].binder
    fp4 = torch.float4_e2m1fn_x2

    def with_quant(fn):
        def run():
            with moe_call.scope(moe_call.MoeCall(hidden_states=x, quant_dtype=fp4)):
                return fn()
        return run

    def step_q():
        return moe_pipeline.SortStep(binder, impl_args, {}), moe_call.MoeCall(hidden_states=x, quant_dtype=fp4)

    st, cl = step_q()
    key_q, tensors_q = smq._verdict_key(st, cl)
    sort_fn(*impl_args)  # the verdicts of both
    with_quant(lambda: sort_fn(*impl_args))()
    verdict_q = smq.VERDICTS.get(key_q, tensors_q)
    assert verdict_q is not None and verdict_q.launch, verdict_q
    api = smq._kernel().moe_sort_mx_quant
    picked = st.pick(verdict_q.picker)
    pids, pw, pE, pD, pdt, pblk, pmask, pnlt, pbuf = picked

    def api_quant():
        return api(pids, pw, pE, pD, pdt, pblk, zero_moe_buf=True, checked=True, expert_mask=pmask,
                   num_local_tokens=pnlt, quant_input=x, quant_dtype=fp4, moe_buf=pbuf, moe_buf_init=None)

    res = api_quant()
    k = smq._kernel()
    plan = next(p for p in k._plans.values() if p.data_cols)

    def seven_empty():
        e = torch.empty
        e(plan.n_sorted, dtype=torch.int32, device=device)
        e(plan.n_sorted, dtype=torch.float32, device=device)
        e(plan.n_blocks, dtype=torch.int32, device=device)
        e(2, dtype=torch.int32, device=device)
        e(M, D, dtype=torch.bfloat16, device=device)
        e(M, plan.data_cols, dtype=fp4, device=device)
        e(plan.scale_rows, plan.snp, dtype=torch.float8_e8m0fnu, device=device)

    sid, sw, seid, nv, buf, (q, s) = res
    q8, s8 = q.view(torch.uint8), s.view(torch.uint8)
    tensors17 = (ids, w, ids, ids, sid, sw, seid, nv, x, q8, s8, buf, buf, sid, sid, sid, sid)

    def api_key():
        quant_input = x
        return (M, K, E, D, bho.BLOCK, device, False, False, True, fp4, quant_input.shape[1], x.stride(0),
                False, buf.stride(0), True, "auto", id(k._sort_quant_kernel), id(k._chunk_rank_kernel),
                id(k._chunk_scan_kernel), id(k._scale_tiles_kernel), k._tunables())

    fused = next(f for f in (fm.fused_moe,) if hasattr(f, moe_pipeline._MARK))
    w1 = torch.empty(1, 1, 1, dtype=fp4).expand(E, 2 * bho.INTER, D // 2)
    w2 = torch.empty(1, 1, 1, dtype=fp4).expand(E, D, bho.INTER // 2)
    fbound, _ = getattr(fused, moe_pipeline._MARK).layers[-1][1].binder.bind(
        (x, w1, w2, w, ids), dict(quant_type=aiter.QuantType.per_1x32))
    assert smq.predict_stage1_quant(fbound) == fp4

    sort_pieces = {
        "sort hit, whole `_moe_sorting_impl` (sort only: hands back at one token)": lambda: sort_fn(*impl_args),
        "sort + quant hit, whole `_moe_sorting_impl`": with_quant(lambda: sort_fn(*impl_args)),
        "  MoeCall + scope (the bench's own, in both)": with_quant(lambda: None),
        "  SortStep(...)": lambda: moe_pipeline.SortStep(binder, impl_args, {}),
        "  `_verdict_key` (sort + quant)": lambda: smq._verdict_key(st, cl),
        "    its arguments' key and tensors (`step.arguments_key`)": st.arguments_key,
        "    `call_key.value_split(hidden_states)`": lambda: call_key.value_split(x),
        "  `VERDICTS.get` (the key's lookup and the tensors' guard)": lambda: smq.VERDICTS.get(key_q, tensors_q),
        "  `predict_stage1_quant` (in `fused_moe`, not in this call)": lambda: smq.predict_stage1_quant(fbound),
        "  `step.pick(picker)`": lambda: st.pick(verdict_q.picker),
        "  kernel API `moe_sort_mx_quant(checked=True)` (+ quant)": api_quant,
        "    its plan key (as built per call)": api_key,
        **({"  kernel `run_kept` (a hit's launch of the verdict's plan, + quant)": lambda: k.run_kept(
            plan, pids, pw, pD, pdt, pmask, pnlt, x, fp4, pbuf, None, True)} if hasattr(k, "run_kept") else {}),
        "      `_tunables()`": k._tunables,
        "    its seven `torch.empty` (+ two `.view`)": lambda: (seven_empty(), q.view(torch.uint8), s.view(torch.uint8)),
        "    `sort_pick` + the prepared launch": lambda: k._run(plan.sort, *plan.sort_pick(tensors17)),
        "  `StageOneQuant(...)` + `tensor_key`": lambda: moe_call.StageOneQuant(
            sorted_ids=sid, num_valid_ids=nv, sorted_weights=sw, quant_dtype=fp4, data=q, scale=s,
            input_key=moe_call.tensor_key(x), block_size=bho.BLOCK, counters=None),
        "  `counters.hit()`": built.layers[-1][1].counters.hit,
        "  AITER's sort on the stand-in (floor piece)": lambda: built.original(*impl_args),
    }

    gemm_patched, gemm_original = calls["gemm ... out_zeroed=True"]
    gemm_patched()
    gargs = (torch.randn(M, D).to(torch.float8_e4m3fn), torch.randn(D, D).to(torch.float8_e4m3fn),
             torch.zeros(M, D, dtype=torch.bfloat16), torch.ones(D // 128, M).t(), torch.ones(D // 128, D // 128))
    gkw = dict(splitK=bho.GEMM_SPLIT)
    gemm_fn = sys.modules["aiter.ops.gemm_op_a8w8"].gemm_a8w8_blockscale_bpreshuffle_asm
    gemm_fn(*gargs, out_zeroed=True, **gkw)
    gsplit, gtensors = call_key.split_key(gargs, gkw)
    gkey = (gsplit, goz._environment())
    gplan, gget = goz.VERDICTS.get(gkey, gtensors)
    gk = goz._kernel()
    gops = gget(gargs, gkw)
    kplan = gplan.plan
    A = gargs[0]

    def gemm_launch_only():
        gk.run_prepared(kplan.launch, gk.launch, (*gops, gops[2], gops[2]))

    gemm_pieces = {
        "gemm out_zeroed=True, whole call": gemm_patched,
        "gemm original call (out_zeroed=False: memset + launch)": gemm_original,
        "  `_stand_in(sys.modules.get('aiter'))`": lambda: goz._stand_in(sys.modules.get("aiter")),
        "  `call_key.split_key` (five tensors, splitK)": lambda: call_key.split_key(gargs, gkw),
        "  `_environment()`": goz._environment,
        "  the verdict key (both parts)": lambda: (call_key.split_key(gargs, gkw), goz._environment()),
        "  `VERDICTS.get` (the GEMM key and the five tensors' guard)": lambda: goz.VERDICTS.get(gkey, gtensors),
        "  operand getter": lambda: gget(gargs, gkw),
        "  `run_plan`": lambda: gk.run_plan(kplan, *gops),
        "    workspace `torch.empty`": lambda: torch.empty(kplan.ws_numel, dtype=torch.float32, device=A.device),
        "    `_tile_counters`": lambda: gk._tile_counters(A.device, kplan.counters),
        "    the prepared launch (7 tensors)": gemm_launch_only,
        "  the original's leaf (memset + empty launch)": lambda: (gargs[2].zero_(), bho._empty_launch_fn(device)()),
    }
    lines = [f"Breakdown at ({E},{K},{D}), {M} token(s): µs per call, the lowest of {rounds} means of {n} calls.", "",
             "| piece | µs |", "|---|---:|"]
    for pieces in (sort_pieces, gemm_pieces):
        for name, us in _best_us(pieces, n, rounds).items():
            lines.append(f"| {name} | {us:.2f} |")
    return "\n".join(lines) + "\n"


def run(args) -> str:
    if args.no_plans:
        sort_kernel.MAX_PLANS = gemm_kernel.MAX_PLANS = 0
    device = torch.device("cpu")
    clock = bho.Clock(device, args.calls, args.reps)
    fake_triton.FakeCompiled.run = lambda self, *a: None  # a launch costs nothing here
    runtime.triton_backend_reason = lambda device: None  # CPU tensors take the Triton path here
    rows, profiles = [], []
    with fake_triton.fake_triton(
            sort_kernel._sort_quant_kernel, sort_kernel._chunk_rank_kernel, sort_kernel._chunk_scan_kernel,
            sort_kernel._scale_tiles_kernel, gemm_kernel._blockscale_gemm_kernel, harness._empty_kernel), \
            use_stub_aiter() as aiter:
        import aiter.fused_moe as fm
        import aiter.ops.gemm_op_a8w8  # noqa: F401

        if args.breakdown:
            with bho.aiter_leaf_cost(aiter, device):
                aiter_patches.apply()
                try:
                    return "\n".join(breakdown(aiter, fm, *bho.MODELS[int(i)], M)
                                     for i in args.models.split(",") for M in (int(t) for t in args.tokens.split(",")))
                finally:
                    aiter_patches.revert()
        x1 = torch.empty(1)
        empty_us = clock.host_us(lambda: harness._empty_kernel[(1,)](x1))
        for E, K, D in [bho.MODELS[int(i)] for i in args.models.split(",")]:
            for M in [int(t) for t in args.tokens.split(",")]:
                calls = bho.entries(aiter, fm, device, E, K, D, M)
                with bho.aiter_leaf_cost(aiter, device):
                    aiter_patches.apply()
                    patched = {n: clock.host_us(p) for n, (p, _) in calls.items()}
                    for n, fn in api_entries(D, E, K, M).items():
                        patched[n] = clock.host_us(fn)
                        calls[n] = (fn, None)
                    if args.profile:
                        for n, (p, _) in calls.items():
                            profiles.append(f"### {n} ({E},{K},{D}) tokens {M}\n\n```\n"
                                            f"{_profile(p, 500, args.profile)}\n```\n")
                    stats = aiter_patches.stats()
                    aiter_patches.revert()
                    floor = {n: clock.host_us(f) for n, (_, f) in calls.items() if f is not None}
                for n in calls:
                    rows.append((n, f"({E},{K},{D})", M, patched[n], floor.get(n)))
    fast = {k: v.get("fast", 0) for k, v in stats.items() if isinstance(v, dict) and "fast" in v}
    lines = [
        "CPU proxy (not the H200): CPU tensors, Triton's binder over a fake driver, launches are no-ops; "
        f"median µs of one call; torch {torch.__version__}, Python {sys.version.split()[0]}; "
        f"plan caches {'off' if args.no_plans else 'on'}. Empty Triton launch (fake): {empty_us:.1f} µs.",
        "",
        "| entry | model (E, topk, dim) | tokens | patched µs | floor µs | patched / floor |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for n, model, M, p, f in rows:
        ratio = f"{p / f:.2f}" if f else "-"
        lines.append(f"| {n} | {model} | {M} | {p:.1f} | {f:.1f} | {ratio} |" if f else
                     f"| {n} | {model} | {M} | {p:.1f} | - | - |")
    lines += ["", f"Fast-path hits (last shape): {fast}.", "", "Command: `python bench/host_proxy_cpu.py "
              + " ".join(sys.argv[1:]) + "`"]
    return "\n".join(lines + [""] + profiles) + "\n"


def main(argv=None):
    args = _parse(argv)
    bho.publish(run(args), args.out)


if __name__ == "__main__":
    main()
