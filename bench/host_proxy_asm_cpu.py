"""CPU proxy of the host time of ``gemm_out_zeroed`` on real AITER's branch: AITER's own ``.co`` launched
through HIP without the memset.

Why: that branch is the one a ROCm server runs, and no machine here has HIP. Here the HIP runtime is
faked (the launcher records instead of launching, the device reports gfx942 and 304 CUs) while the
kernel list, the tile heuristic and the code objects' metadata check are AITER's real ones, read from
an AITER tree (``AITER_PATCHES_TEST_AITER_SRC``, or the fixture tarball ``../shared/fixtures``, as the
tests find it). What is timed is the patch's Python: the gate (or its kept verdict), the argument
pack, the launch call. Columns: with the kept verdicts (the release) and with them off (every call
decided in full, as before issue 15's sixth round), in the same run. CPU figures, not an AMD host's.

    python bench/host_proxy_asm_cpu.py --out /tmp/asm_proxy.md
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import types
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import aiter_patches  # noqa: E402
from aiter_patches.kernels import hip_blockscale_asm as hb  # noqa: E402
from aiter_patches.patches import gemm_out_zeroed as patch  # noqa: E402
from aiter_patches.reference.blockscale_gemm import shuffle_weight_16x16  # noqa: E402
from aiter_patches_standin import gemm_backend as stand_in_gemm  # noqa: E402
from aiter_patches_standin import use as use_stub_aiter  # noqa: E402
from bench.bench_host_overhead import Clock, publish  # noqa: E402

SHAPES = [(1, 7168, 2048), (64, 7168, 2048), (1, 1536, 7168), (64, 24576, 1536)]  # (M, N, K), decode GEMMs
SPLIT = 4


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--calls", type=int, default=3000)
    return p.parse_args()


class _FakeLauncher:
    def function(self, *args):
        return "fn"

    def launch(self, fn, grid, args, stream):
        pass


def run(calls: int) -> str:
    from helpers.aiter_tree import code_object_root, gemm_kernel_dir

    tree = Path(tempfile.mkdtemp(prefix="aiter_patches_asm_proxy_"))
    shutil.copytree(gemm_kernel_dir(code_object_root(tree / "src"), "gfx942"), gemm_kernel_dir(tree, "gfx942"))
    rows, clock = [], Clock(torch.device("cpu"), calls, 1, warmup=200)
    with use_stub_aiter() as stub, mock.patch.multiple(
            hb, available=lambda device, root: None, gfx_of=lambda device: "gfx942",
            _get_launcher=lambda: _FakeLauncher()), mock.patch.multiple(
            torch.cuda, get_device_properties=lambda d: types.SimpleNamespace(multi_processor_count=304),
            current_stream=lambda d=None: types.SimpleNamespace(cuda_stream=0),
            is_current_stream_capturing=lambda: False), mock.patch.dict(
            sys.modules, {"aiter.jit.core": types.SimpleNamespace(AITER_ASM_DIR=f"{tree}/hsa/")}):
        import aiter.ops.gemm_op_a8w8 as gop

        patch.register_backend(stub, None)  # served as on AMD's AITER: its .co through HIP
        try:
            aiter_patches.apply(["gemm_out_zeroed"])
            for M, N, K in SHAPES:
                g = torch.Generator().manual_seed(M)
                A = (torch.randn(M, K, generator=g) * 2).to(stub.dtypes.fp8)
                B = shuffle_weight_16x16((torch.randn(N, K, generator=g) * 2).to(stub.dtypes.fp8))
                A_scale = torch.rand(K // 128, M, generator=g).contiguous().view(M, K // 128)
                B_scale = torch.rand(N // 128, K // 128, generator=g)
                out = torch.zeros(M, N, dtype=torch.bfloat16)
                call = lambda: gop.gemm_a8w8_blockscale_bpreshuffle_asm(  # noqa: E731
                    A, B, out, A_scale, B_scale, splitK=SPLIT, out_zeroed=True)
                before = aiter_patches.stats()["gemm_out_zeroed"]["fast"]
                kept = clock.host_us(call)
                verdicts, limit = patch.VERDICTS, patch.VERDICTS.limit  # the wrapper holds this object
                verdicts.clear()
                verdicts.limit = 0
                try:
                    full = clock.host_us(call)
                finally:
                    verdicts.limit = limit
                took = aiter_patches.stats()["gemm_out_zeroed"]
                assert took["fast"] - before == 2 * (calls + 200) and not took["fallback"], took
                rows.append((M, N, K, kept, full))
        finally:
            aiter_patches.revert()
            patch.register_backend(stub, stand_in_gemm.BACKEND)
    lines = [f"Host µs per `gemm_a8w8_blockscale_bpreshuffle_asm(..., splitK={SPLIT}, out_zeroed=True)` on real "
             f"AITER's branch (median of {calls} calls; CPU proxy: faked HIP, AITER's real kernel list and code "
             f"objects; torch {torch.__version__}, Python {sys.version.split()[0]}).", "",
             "| M | N | K | kept verdict µs | decided in full µs |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {M} | {N} | {K} | {a:.1f} | {b:.1f} |" for M, N, K, a, b in rows]
    lines += ["", "Command: `python bench/host_proxy_asm_cpu.py " + " ".join(sys.argv[1:]) + "`"]
    return "\n".join(lines) + "\n"


def main():
    args = _parse()
    publish(run(args.calls), args.out)


if __name__ == "__main__":
    main()
