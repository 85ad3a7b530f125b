"""Registers, spills, scratch, LDS and occupancy of a compiled AMD kernel, read from its amdgcn.

Why: these decide whether a kernel runs well (or at all) on MI300X/MI350X, and LLVM states
them in the amdgcn it emits: the code-object metadata block (``.sgpr_count``,
``.vgpr_count``, ``.sgpr_spill_count``, ``.vgpr_spill_count``,
``.private_segment_fixed_size`` = scratch, ``.group_segment_fixed_size`` = static LDS) and
the ``; Occupancy:`` comment (waves per SIMD the registers allow). Triton allocates its
shared memory dynamically (``metadata.shared``), which LLVM does not see, so LDS is the sum
and the occupancy estimate also applies the LDS bound.

The LLVM IR is scanned for float-to-integer conversions (``fptosi``/``fptoui``): out of
range they saturate on NVIDIA, wrap in Triton's interpreter and truncate on AMD, so the
kernels must not contain any (design.md, "Testing without ROCm"). It is also scanned for
float narrowing (``fptrunc``, AMD's fp8 conversion intrinsics): f32 -> bf16/fp8 rounding is
done on the bit pattern in the kernels (``kernels/rounding.py``, the MX quant), because the
backends' conversions differ (NaN encodings; the interpreter truncates).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LDS_PER_CU = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
MAX_WAVES_PER_SIMD = 8  # CDNA3 / CDNA4
SIMDS_PER_CU = 4


# an fptrunc, or a call of an AMD intrinsic that converts to fp8/bf8/fp4 (not the widening ones)
_NARROWING = re.compile(r"=\s*fptrunc\b|call\b[^\n]*@llvm\.amdgcn\.cvt\.(?:scalef32\.)?(?:pk|sr)\.(?:fp8|bf8|fp4)\.")


@dataclass
class Resources:
    vgprs: int
    agprs: int
    sgprs: int
    sgpr_spills: int
    vgpr_spills: int
    scratch: int
    lds: int
    lds_limit: int
    reg_occupancy: int
    occupancy: int
    num_warps: int
    fp_to_int: int  # fptosi/fptoui instructions in the LLVM IR
    bf16_hw_cvt: int  # v_cvt_pk_bf16_f32 in the amdgcn (hardware f32->bf16 rounding)
    float_narrowing: int  # fptrunc / AMD fp8 conversion intrinsics in the LLVM IR (float rounding)

    @property
    def lds_over(self) -> bool:
        return self.lds > self.lds_limit


def _field(text: str, name: str, default: int = 0) -> int:
    m = re.search(rf"^[\s-]*\.{re.escape(name)}:\s+(\d+)", text, re.M)
    return int(m.group(1)) if m else default


def occupancy(reg_occupancy: int, lds: int, num_warps: int, lds_limit: int) -> int:
    """Waves per SIMD: the register bound, the hardware cap, and the LDS bound (whole workgroups
    per CU, each putting ceil(num_warps / 4) waves on a SIMD)."""
    occ = min(reg_occupancy or MAX_WAVES_PER_SIMD, MAX_WAVES_PER_SIMD)
    if lds > 0:
        groups = lds_limit // lds
        occ = min(occ, groups * -(-num_warps // SIMDS_PER_CU))
    return occ


def parse_amdgcn(amdgcn: str, *, shared: int, num_warps: int, arch: str, llir: str = "") -> Resources:
    meta = amdgcn[amdgcn.rfind("amdhsa.kernels"):] if "amdhsa.kernels" in amdgcn else amdgcn
    m = re.search(r";\s*Occupancy:\s*(\d+)", amdgcn)
    reg_occ = int(m.group(1)) if m else 0
    lds = _field(meta, "group_segment_fixed_size") + int(shared or 0)
    limit = LDS_PER_CU.get(arch, 64 * 1024)
    return Resources(
        vgprs=_field(meta, "vgpr_count"), agprs=_field(meta, "agpr_count"), sgprs=_field(meta, "sgpr_count"),
        sgpr_spills=_field(meta, "sgpr_spill_count"), vgpr_spills=_field(meta, "vgpr_spill_count"),
        scratch=_field(meta, "private_segment_fixed_size"), lds=lds, lds_limit=limit,
        reg_occupancy=reg_occ, occupancy=occupancy(reg_occ, lds, num_warps, limit), num_warps=num_warps,
        fp_to_int=len(re.findall(r"=\s*fpto[su]i\b", llir)),
        bf16_hw_cvt=len(re.findall(r"\bv_cvt_pk_bf16_f32\b", amdgcn)),
        float_narrowing=len(re.findall(_NARROWING, llir)),
    )
