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
import io
import os
import pstats
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # the fake driver needs real JITFunctions
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import bench_host_overhead as bho  # noqa: E402
from bench import fake_triton, harness  # noqa: E402

import aiter_patches  # noqa: E402
from aiter_patches import runtime  # noqa: E402
from aiter_patches.kernels import blockscale_gemm_splitk as gemm_kernel  # noqa: E402
from aiter_patches.kernels import moe_sort_mx_quant as sort_kernel  # noqa: E402
from aiter_patches.testing import use_stub_aiter  # noqa: E402


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="0,1,2,3", help="indices into bench_host_overhead.MODELS")
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--profile", type=int, default=0, help="print this many costliest functions per entry")
    p.add_argument("--no-plans", action="store_true", help="kernel APIs without their per-shape plan caches")
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
    text = run(args)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
