"""Benchmark: host (CPU) time to issue one patched call, against what AITER's own call costs the host.

Eager mode, no CUDA graph: the median CPU time of one call, the GPU queue never full (a device
sync every ``--calls`` calls, outside the timed region). Columns, per entry and decode shape:

- patched: the call with ``aiter_patches.apply()`` on the stand-in AITER (the one-launch sort
  and its direct launch, kernels/fast_launch.py);
- patched, Triton launch: the same with direct launches off (``AITER_PATCHES_FAST_LAUNCH=0``);
- AITER-equivalent floor: the same call unpatched on the stand-in, its leaf kernels replaced by
  what AITER's compiled ops cost the host: AITER's allocations (made by the stand-in's Python,
  as AITER's) plus one empty Triton launch per leaf op (a memset first where AITER's launcher
  memsets);
- the first call of each shape (JIT compile included; a fresh TRITON_CACHE_DIR unless
  ``--warm-cache``), and a bare empty Triton launch, ordinary and direct.

Entries: ``moe_sorting``; ``_moe_sorting_impl`` with and without the stage-1 MXFP4 quant (the
patched one is the single sort+quant launch, its floor AITER's sort plus AITER's quant helper), and
the same with its outputs reused, as a call the ``fused_moe`` wrapper opened makes it
(patches/sort_scratch.py: only ``moe_buf`` is allocated; same floor);
the MXFP4 quant helper's hand-back of that quant; ``fused_moe`` as a server calls it, no patch
keyword (MXFP4 weights, per_1x32: the sort + stage-1 quant in one launch and its hand-back; bf16
weights, no quant: the sort alone, handed back to AITER where it saves no launch), against the
same call unpatched; ``fused_moe(..., moe_addend=...)`` (MXFP4
weights, per_1x32; floor: unpatched ``fused_moe`` + ``out.add_``); the split-K
``gemm_a8w8_blockscale_bpreshuffle_asm(..., out_zeroed=True)`` against the original call
(``out_zeroed=False``, same kernel after a memset).

    python bench/bench_host_overhead.py --out docs/bench/host_overhead_h200.md     # GPU, < 3 min
    python bench/bench_host_overhead.py --fake-launch --out /tmp/host_cpu.md      # CPU figures
    python bench/bench_host_overhead.py --smoke --out /tmp/smoke.md               # CI, interpreter

``--fake-launch`` runs on CPU with Triton's real binder over a fake driver (bench/fake_triton.py:
nothing is compiled or launched), so it measures the Python side only; its numbers are CPU
figures, not H200 ones.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = [  # (experts, topk, model_dim): the four target models' MoE layers
    (256, 8, 7168), (896, 16, 3584), (128, 4, 6144), (128, 8, 4096),
]
SMOKE_MODELS = [(8, 2, 512)]
INTER = 256  # stage widths only shape allocations here (leaf kernels are empty)
BLOCK = 32
GEMM_SPLIT = 4


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="markdown table here (also printed)")
    p.add_argument("--tokens", default="1,64", help="decode batch sizes, comma separated")
    p.add_argument("--models", default="0,1,2,3", help="which of MODELS, comma separated indices")
    p.add_argument("--calls", type=int, default=20, help="calls between device syncs")
    p.add_argument("--reps", type=int, default=40, help="sync-separated groups of calls per measurement")
    p.add_argument("--rounds", type=int, default=8,
                   help="alternations of patched and floor measurements per shape (the groups split among them)")
    p.add_argument("--fake-launch", action="store_true", help="CPU: fake Triton driver, no compile, no launch")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and counts (CI; the interpreter on CPU)")
    p.add_argument("--warm-cache", action="store_true", help="keep Triton's on-disk cache (first calls then skip compiling)")
    return p.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:
    if ARGS.fake_launch:
        os.environ["TRITON_INTERPRET"] = "0"
    elif not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not ARGS.warm_cache:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="aiter_patches_host_bench_")

import triton  # noqa: E402  (after TRITON_INTERPRET / TRITON_CACHE_DIR are decided)

import aiter_patches  # noqa: E402
from aiter_patches import runtime  # noqa: E402
from aiter_patches_standin import blockscale_gemm_splitk as gemm_kernel  # noqa: E402
from aiter_patches.kernels import fast_launch  # noqa: E402
from aiter_patches.kernels import moe_sort_mx_quant as sort_kernel  # noqa: E402
from aiter_patches.patches.moe import call as moe_call, pipeline as moe_pipeline, sort_scratch  # noqa: E402
from aiter_patches_standin import use as use_stub_aiter  # noqa: E402
from bench import harness  # noqa: E402

FP4 = torch.float4_e2m1fn_x2

# The "outputs reused" row opens a call as the fused_moe wrapper does and calls the sort itself. The pool lends
# only to the sort that AITER's fused_moe calls (issue 35: a pooled tensor never leaves the pipeline's frames),
# which the wrapper tells from the caller's frames: here the bench's direct call stands for that sort. Only that
# row opens a call with ``scratch``; the fused_moe rows go through AITER's own call, where this answer is True.
moe_pipeline._from_aiters_fused_moe = lambda caller: True


def publish(table: str, out: Path | None) -> None:
    """A host benchmark's table: printed, and written to ``out`` when given."""
    print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)


class Clock:
    def __init__(self, device, calls, reps, warmup=3):
        self.device, self.calls, self.reps, self.warmup = device, calls, reps, warmup

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def host_us(self, fn) -> float:
        """Median CPU µs of one ``fn()``; a device sync after every ``calls`` calls, outside the timing."""
        return statistics.median(self.samples(fn, self.reps)) / 1e3

    def samples(self, fn, groups: int) -> list[int]:
        """CPU ns of each of ``groups * calls`` calls of ``fn()`` (after the warm-up calls), a device sync
        after every ``calls`` calls, outside the timing."""
        for _ in range(self.warmup):
            fn()
        self.sync()
        times = []
        gc_was = gc.isenabled()
        gc.disable()
        try:
            for _ in range(groups):
                for _ in range(self.calls):
                    t0 = time.perf_counter_ns()
                    fn()
                    times.append(time.perf_counter_ns() - t0)
                self.sync()
        finally:
            if gc_was:
                gc.enable()
        return times

    def first_ms(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3


# ------------------------------------------------------------------ AITER's leaf ops, host cost only

def _empty_launch_fn(device):
    x = torch.empty(1, device=device)

    def empty_launch(*_, **__):
        harness._empty_kernel[(1,)](x)

    return empty_launch


@contextlib.contextmanager
def aiter_leaf_cost(aiter, device):
    """The stand-in's leaf ops replaced by AITER's host cost: its allocations plus one empty launch."""
    import aiter.ops._leaf_kernels as leaf
    import aiter.ops.gemm_op_a8w8 as gemm_op
    import aiter.ops.quant as quant

    empty = _empty_launch_fn(device)

    def per_1x32_mx_quant_hip(x, scale=None, quant_dtype=FP4, shuffle=False, num_rows=None, num_rows_factor=1,
                              scale_type=None):
        n = x.shape[-1]
        m = x.numel() // n
        out = torch.empty(m, n // 2 if quant_dtype == FP4 else n, dtype=quant_dtype, device=x.device)
        s = torch.empty(m, n // 32, dtype=torch.uint8, device=x.device)
        empty()
        return out, s.view(torch.float8_e8m0fnu)

    def gemm_launcher(A, B, out, A_scale, B_scale, bias=None, splitK=-1, kernelName=None, bpreshuffle=1,
                      zero_bias_buf=None):
        if gemm_op.launcher_split(A.shape[1], splitK) > 1:
            out.zero_()  # AITER's launcher memsets before a split launch
        empty()

    saved = []

    def put(mod, name, value):
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)

    put(aiter, "moe_sorting_opus_fwd", empty)
    put(aiter, "moe_sorting_fwd", empty)
    put(quant, "fused_dynamic_mx_quant_moe_sort_hip", empty)
    put(quant, "mxfp4_moe_sort_hip", empty)
    put(quant, "per_1x32_mx_quant_hip", per_1x32_mx_quant_hip)
    put(leaf, "moe_stage1", empty)
    put(leaf, "moe_stage2", empty)
    put(gemm_op, "_gemm_a8w8_blockscale_bpreshuffle_asm", gemm_launcher)
    try:
        yield
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


# ------------------------------------------------------------------ the entries

def _routing(M, K, E, device):
    g = torch.Generator().manual_seed(M * 7 + E)
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    w = torch.rand(M, K, generator=g).softmax(dim=1)
    return ids.to(device), w.to(device)


def entries(aiter, fm, device, E, K, D, M):
    """name -> (patched call, floor call); both called with the patches applied / reverted by the caller."""
    ids, w = _routing(M, K, E, device)
    x = torch.randn(M, D, device=device).to(torch.bfloat16)
    sort_args = (ids, w, E, D, torch.bfloat16, BLOCK)
    impl_args = (*sort_args, None, None, 0, True)

    def quant_call(sorted_ids, sorted_weights, num_valid_ids):
        return fm.fused_dynamic_mxfp4_quant_moe_sort(x, sorted_ids=sorted_ids, num_valid_ids=num_valid_ids,
                                                     token_num=M, topk=K, block_size=BLOCK,
                                                     sorted_weights=sorted_weights)

    def sort_quant_patched():
        with moe_call.scope(moe_call.MoeCall(hidden_states=x, quant_dtype=FP4)):
            return fm._moe_sorting_impl(*impl_args)

    def sort_quant_floor():
        sid, sw, _, nv, _ = fm._moe_sorting_impl(*impl_args)
        return quant_call(sid, sw, nv)

    def sort_quant_reused():  # as inside fused_moe: the wrapper's call lends the sort its outputs, given back after
        call = moe_call.MoeCall(hidden_states=x, quant_dtype=FP4, scratch=[])
        with moe_call.scope(call):
            out = fm._moe_sorting_impl(*impl_args)
        sort_scratch.release(call)
        return out

    handback = {}

    def handback_patched():
        call = handback.get("call")
        if call is None:  # one patched sort+quant, made once: the hand-back is what is timed
            call = moe_call.MoeCall(hidden_states=x, quant_dtype=FP4)
            with moe_call.scope(call):
                out = fm._moe_sorting_impl(*impl_args)
            handback.update(call=call, out=out)
        out = handback["out"]
        if call.stage1_quant is not None:
            call.stage1_quant.consumed = False
        with moe_call.scope(call):
            return quant_call(out[0], out[1], out[3])

    def handback_floor():
        out = handback.get("floor_out")
        if out is None:
            out = handback["floor_out"] = fm._moe_sorting_impl(*impl_args)
        return quant_call(out[0], out[1], out[3])

    w1 = torch.empty(1, 1, 1, dtype=FP4, device=device).expand(E, 2 * INTER, D // 2)
    w2 = torch.empty(1, 1, 1, dtype=FP4, device=device).expand(E, D, INTER // 2)
    addend = torch.randn(M, D, device=device).to(torch.bfloat16)
    moe_kw = dict(quant_type=aiter.QuantType.per_1x32)

    def fused_plain():  # the call a server makes, no patch keyword: patched and floor alike
        return fm.fused_moe(x, w1, w2, w, ids, **moe_kw)

    w1_bf16 = torch.empty(1, 1, 1, dtype=torch.bfloat16, device=device).expand(E, 2 * INTER, D)
    w2_bf16 = torch.empty(1, 1, 1, dtype=torch.bfloat16, device=device).expand(E, D, INTER)

    def fused_bf16():  # no MX quant: the sort alone is the patch's (handed back where it saves no launch)
        return fm.fused_moe(x, w1_bf16, w2_bf16, w, ids)

    def fused_patched():
        return fm.fused_moe(x, w1, w2, w, ids, moe_addend=addend, **moe_kw)

    def fused_floor():
        return fm.fused_moe(x, w1, w2, w, ids, **moe_kw).add_(addend)

    fp8 = torch.float8_e4m3fn
    A = torch.randn(M, D, device=device).to(fp8)
    B = torch.randn(D, D, device=device).to(fp8)
    out = torch.zeros(M, D, device=device, dtype=torch.bfloat16)
    A_scale = torch.ones(D // 128, M, device=device).t()  # AITER's K-major scale memory, logical [M, K/128]
    B_scale = torch.ones(D // 128, D // 128, device=device)
    gemm_args = (A, B, out, A_scale, B_scale)

    def gemm_patched():
        return aiter.gemm_a8w8_blockscale_bpreshuffle_asm(*gemm_args, splitK=GEMM_SPLIT, out_zeroed=True)

    def gemm_original():
        return aiter.gemm_a8w8_blockscale_bpreshuffle_asm(*gemm_args, splitK=GEMM_SPLIT)

    return {
        "moe_sorting": (lambda: fm.moe_sorting(*sort_args), lambda: fm.moe_sorting(*sort_args)),
        "_moe_sorting_impl": (lambda: fm._moe_sorting_impl(*impl_args), lambda: fm._moe_sorting_impl(*impl_args)),
        "_moe_sorting_impl + stage-1 MXFP4 quant": (sort_quant_patched, sort_quant_floor),
        "the same, outputs reused (as in fused_moe)": (sort_quant_reused, sort_quant_floor),
        "MXFP4 quant helper hand-back": (handback_patched, handback_floor),
        "fused_moe, MXFP4 weights": (fused_plain, fused_plain),
        "fused_moe, bf16 weights": (fused_bf16, fused_bf16),
        "fused_moe(moe_addend=...)": (fused_patched, fused_floor),
        "gemm ... out_zeroed=True": (gemm_patched, gemm_original),
    }


def _variants() -> int:
    """Compiled variants Triton holds for the patched kernels (0 in the interpreter)."""
    n = 0
    for fn in (sort_kernel._sort_quant_kernel, sort_kernel._chunk_rank_kernel, sort_kernel._chunk_scan_kernel,
               sort_kernel._scale_tiles_kernel, gemm_kernel._blockscale_gemm_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            n += len(cache[0])
    return n


def run(args) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.fake_launch else "cpu")
    models = SMOKE_MODELS if args.smoke else [MODELS[int(i)] for i in args.models.split(",")]
    tokens = [2] if args.smoke else [int(t) for t in args.tokens.split(",")]
    calls, reps = (1, 1) if args.smoke else (args.calls, args.reps)
    rounds = 2 if args.smoke else args.rounds
    if rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    clock = Clock(device, calls, reps, warmup=0 if args.smoke else 3)
    fake = contextlib.nullcontext()
    if args.fake_launch:
        from bench import fake_triton

        fake_triton.FakeCompiled.run = lambda self, *a: None  # launches cost nothing here
        fake = fake_triton.fake_triton(
            sort_kernel._sort_quant_kernel, sort_kernel._chunk_rank_kernel, sort_kernel._chunk_scan_kernel,
            sort_kernel._scale_tiles_kernel, gemm_kernel._blockscale_gemm_kernel, harness._empty_kernel)
        runtime.triton_backend_reason = lambda device: None  # CPU tensors take the Triton path here

    rows = []
    t_start = time.perf_counter()
    with fake, use_stub_aiter() as aiter:
        import aiter.fused_moe as fm
        import aiter.ops.gemm_op_a8w8  # noqa: F401

        x1 = torch.empty(1, device=device)
        fast_launch.set_mode("off")
        empty_ordinary = clock.host_us(lambda: harness._empty_kernel[(1,)](x1))
        fast_launch.set_mode("on")
        empty_direct = clock.host_us(lambda: fast_launch.launch(harness._empty_kernel, (1,), x1))
        for E, K, D in models:
            for M in tokens:
                calls_ = entries(aiter, fm, device, E, K, D, M)
                with aiter_leaf_cost(aiter, device):
                    aiter_patches.apply()
                    firsts = {}
                    for name, (patched, _) in calls_.items():
                        v0 = _variants()
                        firsts[name] = (clock.first_ms(patched), _variants() - v0)
                    fast, slow, floor = ({n: [] for n in calls_} for _ in range(3))
                    groups = max(-(-reps // rounds), 1)

                    def floor_round():
                        for n, (_, f) in calls_.items():
                            floor[n].append(clock.samples(f, groups))

                    for r in range(rounds):  # patched and floor alternate (order too): the host's drift hits both alike
                        if r % 2:  # the previous round ended reverted
                            floor_round()
                        if r:
                            aiter_patches.apply()
                        fast_launch.set_mode("on")
                        for n, (p, _) in calls_.items():
                            fast[n].append(clock.samples(p, groups))
                        fast_launch.set_mode("off")
                        for n, (p, _) in calls_.items():
                            slow[n].append(clock.samples(p, groups))
                        fast_launch.set_mode(None)
                        stats = aiter_patches.stats()
                        aiter_patches.revert()
                        if not r % 2:
                            floor_round()
                for name in calls_:
                    per_round = [statistics.median(a) / statistics.median(b) for a, b in zip(fast[name], floor[name])]
                    rows.append((name, f"({E},{K},{D})", M, _median_us(fast[name]), _median_us(slow[name]),
                                 _median_us(floor[name]), min(per_round), max(per_round), *firsts[name]))
                if args.smoke:
                    assert stats["moe_sort_mx_quant"]["fast"] > 0, stats
    elapsed = time.perf_counter() - t_start
    return _table(rows, device, empty_ordinary, empty_direct, args, elapsed)


def _median_us(rounds: list[list[int]]) -> float:
    return statistics.median([t for r in rounds for t in r]) / 1e3


def _table(rows, device, empty_ordinary, empty_direct, args, elapsed) -> str:
    where = ("CPU, fake Triton driver (Python only: no launch; torch ops run on CPU tensors)" if args.fake_launch
             else torch.cuda.get_device_name() if device.type == "cuda" else "CPU, Triton interpreter (smoke)")
    cmd = "python bench/bench_host_overhead.py " + " ".join(sys.argv[1:])
    lines = [
        f"Host µs to issue one call (median; eager; a device sync every {args.calls if not args.smoke else 1} "
        f"calls; patched and floor measured in {2 if args.smoke else args.rounds} alternating rounds, the last "
        f"column the lowest and highest of the rounds' patched / floor ratios). Device: {where}; torch {torch.__version__}, triton {triton.__version__}, "
        f"Python {sys.version.split()[0]}. Direct launches: {fast_launch.available()}.",
        "",
        f"Empty Triton launch: {empty_ordinary:.1f} µs ordinary, {empty_direct:.1f} µs direct.",
        "",
        "| entry | model (E, topk, dim) | tokens | patched µs | patched, Triton launch µs | AITER-equivalent "
        "floor µs | patched / floor | first call ms (variants compiled) | patched / floor per round |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, model, M, fast, slow, floor, lo, hi, first, nvar in rows:
        floor_name = "original call" if name.startswith("gemm") else "floor"
        lines.append(f"| {name} | {model} | {M} | {fast:.1f} | {slow:.1f} | {floor:.1f}"
                     f"{'' if floor_name == 'floor' else ' (original)'} | {fast / floor:.2f} | {first:.0f} ({nvar}) "
                     f"| {lo:.2f}-{hi:.2f} |")
    lines += ["", f"Command: `{cmd}` ({elapsed:.0f} s)."]
    return "\n".join(lines) + "\n"


def main():
    publish(run(ARGS), ARGS.out)


if __name__ == "__main__":
    main()
