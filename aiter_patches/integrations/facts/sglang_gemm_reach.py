"""Which of SGLang's DeepSeek-V3/R1 fp8 GEMMs reach AITER's asm kernel with a split above one, read from an AITER tree.

``sglang_gemm_zero_pool`` saves a memset only where three things meet: SGLang sends the
(N, K) to AITER's dispatcher (gfx950 with ROCm >= 7.2, outside SGLang's Triton list
``use_aiter_triton_gemm_w8a8_tuned_gfx950``: ``TRITON_NK``), and AITER's tuned CSV sends
(M, N, K) to ``libtype == "asm"`` with ``splitK > 1``. This module answers the second
half from the CSVs of any AITER tree, with the dispatcher's own lookup rules
(``aiter/ops/gemm_op_a8w8.py`` ``get_CKGEMM_config``: the default CSV merged with
``configs/model_configs/*a8w8_blockscale_bpreshuffle_tuned_gemm*.csv``, the lowest ``us``
kept per (gfx, cu_num, M, N, K); exact M, then M padded to 16 up to 256 (``getPaddedM``
level 0), then the next power of two (level 1)). No AITER import, no GPU:
``python -m aiter_patches.integrations.facts.sglang_gemm_reach AITER_ROOT [gfx] [cu_num] [max_m]``.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

CSV = "a8w8_blockscale_bpreshuffle_tuned_gemm"

# SGLang 0.5.23 fp8_utils.py use_aiter_triton_gemm_w8a8_tuned_gfx950 (≈318): these (N, K) never reach the dispatcher
TRITON_NK = frozenset({(1024, 8192), (16384, 1536), (2112, 7168), (3072, 1536), (32768, 8192), (4096, 7168),
                       (4608, 7168), (512, 7168), (7168, 2048), (7168, 2304), (7168, 256), (8192, 1024),
                       (8192, 32768)})


def deepseek_v3_shapes(tp: int) -> dict[str, tuple[int, int]]:
    """SGLang's fp8 block linears of DeepSeek-V3/R1 at (attention or MLP) tensor parallelism ``tp``: name -> (N, K)."""
    return {
        "fused_qkv_a_proj_with_mqa": (1536 + 512 + 64, 7168),
        "q_b_proj": (128 * 192 // tp, 1536),
        "kv_b_proj": (128 * 256 // tp, 512),
        "o_proj": (7168, 128 * 128 // tp),
        "dense gate_up_proj": (2 * 18432 // tp, 7168),
        "dense down_proj": (7168, 18432 // tp),
        "shared-expert gate_up_proj": (2 * 2048 // tp, 7168),
        "shared-expert down_proj": (7168, 2048 // tp),
    }


def tuned_table(aiter_root: str | Path) -> dict[tuple, dict]:
    """(gfx, cu_num, M, N, K) -> the CSV row AITER's merged tuned config keeps for it."""
    configs = Path(aiter_root) / "aiter" / "configs"
    files = [configs / f"{CSV}.csv"] + sorted(p for p in (configs / "model_configs").glob(f"*{CSV}*.csv")
                                               if "untuned" not in p.name)
    best: dict[tuple, dict] = {}
    for path in files:
        if not path.is_file():
            continue
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                key = (row.get("gfx", ""), int(row["cu_num"]), int(row["M"]), int(row["N"]), int(row["K"]))
                if key not in best or float(row["us"]) < float(best[key]["us"]):
                    best[key] = row
    return best


def _next_pow2(m: int) -> int:
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


def _padded(M: int, N: int, level: int) -> int:
    if level == 0:
        for bound, step in ((256, 16), (1024, 32), (4096, 64)):
            if M <= bound:
                return -(-M // step) * step
        return -(-M // 128) * 128
    return 8192 if M > 8192 and N > 4096 else _next_pow2(M)


def lookup(table: dict, gfx: str, cu_num: int, M: int, N: int, K: int) -> dict | None:
    for m in (M, _padded(M, N, 0), _padded(M, N, 1)):
        row = table.get((gfx, cu_num, m, N, K))
        if row is not None:
            return row
    return None


def asm_splits(table: dict, gfx: str, cu_num: int, N: int, K: int, max_m: int) -> dict[int, int]:
    """{M: splitK} for every M in 1..max_m that the tuned config sends to asm with splitK > 1."""
    found = {}
    for M in range(1, max_m + 1):
        row = lookup(table, gfx, cu_num, M, N, K)
        if row is not None and row["libtype"] == "asm" and int(float(row["splitK"])) > 1:
            found[M] = int(float(row["splitK"]))
    return found


def report(aiter_root, gfx: str = "gfx950", cu_num: int = 256, max_m: int = 256) -> list[dict]:
    """One row per (tp, linear): its (N, K), whether SGLang sends it to the dispatcher, and the asm split-K Ms."""
    table = tuned_table(aiter_root)
    rows = []
    for tp in (1, 2, 4, 8):
        for name, (N, K) in deepseek_v3_shapes(tp).items():
            if name.startswith("fused_qkv_a") and tp != 1:
                continue  # replicated: the same shape at every tp
            splits = asm_splits(table, gfx, cu_num, N, K, max_m)
            rows.append(dict(tp=tp, name=name, N=N, K=K, dispatcher=(N, K) not in TRITON_NK, splits=splits))
    return rows


def _ranges(ms) -> str:
    ms, out = sorted(ms), []
    for m in ms:
        if out and m == out[-1][1] + 1:
            out[-1][1] = m
        else:
            out.append([m, m])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out) or "-"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip())
        return 2
    root, gfx = argv[0], argv[1] if len(argv) > 1 else "gfx950"
    cu, max_m = int(argv[2]) if len(argv) > 2 else 256, int(argv[3]) if len(argv) > 3 else 256
    print(f"| tp | linear | N | K | SGLang calls | M with asm splitK > 1 ({gfx}, {cu} CUs, M <= {max_m}) | splits |")
    print("|---|---|---|---|---|---|---|")
    for r in report(root, gfx, cu, max_m):
        route = "dispatcher" if r["dispatcher"] else "Triton (its list)"
        splits = sorted(set(r["splits"].values()))
        print(f"| {r['tp']} | {r['name']} | {r['N']} | {r['K']} | {route} | {_ranges(r['splits'])} | "
              f"{', '.join(map(str, splits)) or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
