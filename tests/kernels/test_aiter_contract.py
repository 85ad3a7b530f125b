"""AITER's contract constants are written once (aiter_contract.py) and kernels/, reference/, patches/ use that copy."""

import ast
import re
from pathlib import Path

import pytest
import torch

import aiter_patches
from aiter_patches import aiter_contract as C
from aiter_patches_standin import blockscale_gemm_splitk as bg
from aiter_patches.kernels import hip_blockscale_asm as hip
from aiter_patches.kernels import moe_sort_mx_quant as k
from aiter_patches.reference import blockscale_gemm as ref_gemm
from aiter_patches.reference import moe_sorting as ref_sort
from aiter_patches.reference import mx_quant as ref_mx

ROOT = Path(aiter_patches.__file__).parent


def test_the_contract_imports_neither_torch_nor_aiter():
    tree = ast.parse((ROOT / "aiter_contract.py").read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"__future__", "math", "struct", "typing"}


def test_kernels_and_references_hold_the_contracts_objects():
    assert ref_mx.FP4_E2M1 is C.FP4_E2M1 and ref_mx.mx_format is C.mx_format and ref_mx.GROUP == C.MX_GROUP
    assert ref_mx.stage1_uses_fused_quant is C.stage1_uses_fused_quant
    assert k.FUSED_QUANT_MAX_PAIRS == C.STAGE1_FUSED_MAX_PAIRS == 2048
    assert ref_sort.sort_buffer_sizes is C.sort_buffer_sizes
    assert bg.valid_split is C.valid_split and bg.k_tiles_per_split is C.k_tiles_per_split
    assert hip.aligned_split is C.aligned_split
    assert bg.SCALE_BLOCK == hip.TILE_K == hip.SCALE_BLOCK_N == hip.SCALE_BLOCK_K == ref_gemm.SCALE_BLOCK == 128


def test_the_kernels_formats_are_the_contracts_as_they_were_written():
    """The constexprs the Triton kernel gets, spelled out as they were before the contract (a slip fails here)."""
    assert k._FP_FORMATS == {
        torch.float4_e2m1fn_x2: dict(FP4=True, MB=1, EMIN=0, MAXC=0x7, NANC=-1, SIGNED_ZERO=True,
                                     SIGN_SHIFT=3, INV_MAX_BITS=0x3E2AAAAB),
        torch.float8_e4m3fn: dict(FP4=False, MB=3, EMIN=-6, MAXC=0x7E, NANC=0xFE, SIGNED_ZERO=True,
                                  SIGN_SHIFT=7, INV_MAX_BITS=0x3B124925),
        torch.float8_e4m3fnuz: dict(FP4=False, MB=3, EMIN=-7, MAXC=0x7F, NANC=0xFF, SIGNED_ZERO=False,
                                    SIGN_SHIFT=7, INV_MAX_BITS=0x3B888889),
    }
    assert k._AMAX_FLOOR_BITS == C.AMAX_FLOOR_BITS == 0x2EDBE6FF  # fp32 1e-10


@pytest.mark.parametrize("dtype,bits", [(torch.float4_e2m1fn_x2, 0x3E2AAAAB), (torch.float8_e4m3fn, 0x3B124925),
                                        (torch.float8_e4m3fnuz, 0x3B888889)])
def test_each_format_holds_fp32_one_over_its_largest_value(dtype, bits):
    max_pos = {torch.float4_e2m1fn_x2: 6.0, torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}[dtype]
    assert C.mx_format(dtype).inv_max_pos_bits == bits
    assert torch.tensor(1 / max_pos, dtype=torch.float32).view(torch.int32).item() == bits


def test_an_unknown_quant_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="unsupported MX quant dtype torch.bfloat16"):
        C.mx_format(torch.bfloat16)


def test_sort_sizes_and_scale_shape_follow_aitera_formulas():
    assert C.sort_buffer_sizes(3 * 2, 2, 4, 4) == (20, 5)  # 6 + 4 * 4 - 2, blocks of 4 rounded up
    assert k.sort_sizes(3, 2, 4, 4) == (20, 5)  # the kernel counts tokens, AITER pairs: the same sizes
    assert C.mx_scale_shape(33, 7168) == (64, 224) and C.mx_scale_shape(32, 96) == (32, 8)
    assert C.stage1_uses_fused_quant(256, 8) and not C.stage1_uses_fused_quant(257, 8)


def test_the_split_rule():
    assert [s for s in range(1, 9) if C.valid_split(1024, s)] == [1, 2, 3, 4, 8]
    assert C.aligned_split(1024, 5) == 4 and C.aligned_split(1024, 3) == 3 and not C.valid_split(1024, 0)
    assert C.k_tiles_per_split(1024, 3) == 3


def test_the_stand_in_sizes_its_sort_buffers_as_the_contract_says():
    """The stand-in plays AITER with its own copy of the formula: the two must agree."""
    from helpers.standin import use_stub_aiter

    with use_stub_aiter():
        import aiter.fused_moe as fm

        ids = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32)
        w = torch.full((3, 2), 0.5)
        sorted_ids, _, sorted_expert_ids, _, _ = fm.moe_sorting(ids, w, 4, 8, torch.bfloat16, 4)
    assert (sorted_ids.numel(), sorted_expert_ids.numel()) == C.sort_buffer_sizes(6, 2, 4, 4)


CONTRACT_LITERALS = ["0x3E2AAAAB", "0x3B124925", "0x3B888889", "1e-10", "num_experts * block_size - topk"]


def test_no_copy_of_the_contract_in_kernels_reference_or_patches():
    copies = []
    for folder in ("kernels", "reference", "patches"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            copies += [f"{folder}/{path.name}: {lit}" for lit in CONTRACT_LITERALS if re.search(re.escape(lit), text)]
    # docstrings may cite a formula; code may not hold one: only comments/docstrings are allowed to remain
    assert [c for c in copies if not _only_in_text(ROOT / c.split(":")[0], c.split(": ")[1])] == []


def _only_in_text(path: Path, literal: str) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    code_segments = [ast.get_source_segment(path.read_text(encoding="utf-8"), n) or "" for n in ast.walk(tree)
                     if isinstance(n, (ast.Assign, ast.Return, ast.Call, ast.BinOp, ast.Compare))]
    return not any(literal in seg for seg in code_segments)
