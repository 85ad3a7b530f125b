"""AITER's own Triton MoE sort + MXFP4 quant chain, loaded from an AITER source tree, for benchmarks.

Why: the number a user compares the patched sort + quant with is what AITER itself runs, in the
same process on the same GPU. Its ``aiter/ops/triton`` kernels run on NVIDIA too, but
``import aiter`` does not (its ``__init__`` builds or loads HIP extensions). So every ``aiter.*``
package here is a bare module whose ``__path__`` points into the given tree (no ``__init__.py``
runs), ``aiter.utility.dtypes`` is a stub holding the few dtypes the Triton wrappers read, and
the gfx1250-only Gluon kernel module is stubbed where this Triton build cannot import it. The
tree is read at run time from a folder the caller names (never copied into this repository).

AITER's MXFP4 Triton quant writes different scale bytes from AITER's HIP kernels on NVIDIA
(design.md): benchmarks time it, they do not compare its bytes.

The chain (what a user of AITER's Triton path runs per MoE layer at decode):
``sorted_ids.fill_(numel)`` (the aligner writes only real pairs), ``moe_align_block_size_triton``
(two zeroed tables, four launches), a one-launch conversion of its flat pair indices to AITER's
``(slot << 24) | token`` ids (padding -> ``(topk << 24) | tokens``), the ``moe_buf`` zero-fill and
``fused_dynamic_mxfp4_quant_moe_sort``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path

import torch
import triton
import triton.language as tl

_GLUON_MODULE = "aiter.ops.triton._gluon_kernels.gfx1250.quant.fused_mxfp4_quant"
_ARCH_MODULE = "aiter.ops.triton.utils._triton.arch_info"


def package_root(src: str | Path) -> Path:
    """The folder holding the ``aiter`` package: ``src`` itself, ``src/aiter``'s parent, or a
    copy of the package (``src/ops/triton``) named ``src``."""
    src = Path(src)
    if (src / "aiter" / "ops" / "triton").is_dir():
        return src
    if (src / "ops" / "triton").is_dir():
        return src.parent if src.name == "aiter" else _alias_root(src)
    raise FileNotFoundError(f"{src}: no aiter/ops/triton (copy AITER's aiter/ package, or at least "
                            "aiter/ops/triton, there)")


def _alias_root(pkg: Path) -> Path:
    """A package folder not named ``aiter``: serve it under that name through a link in a temp dir."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="aiter_src_"))
    (root / "aiter").symlink_to(pkg.resolve(), target_is_directory=True)
    return root


class _BarePackages(importlib.abc.MetaPathFinder):
    """Finds ``aiter.*`` packages under ``root`` as namespace modules (their ``__init__`` is skipped)."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name != "aiter" and not name.startswith("aiter."):
            return None
        folder = self.root.joinpath(*name.split("."))
        if not folder.is_dir():
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        return spec


def _stub_dtypes() -> types.ModuleType:
    m = types.ModuleType("aiter.utility.dtypes")
    m.fp4x2 = torch.float4_e2m1fn_x2
    m.fp8_e8m0 = torch.float8_e8m0fnu
    m.fp8 = torch.float8_e4m3fn
    m.bf16, m.fp16, m.fp32 = torch.bfloat16, torch.float16, torch.float32
    m.i32, m.i8, m.u8 = torch.int32, torch.int8, torch.uint8
    return m


def load(src: str | Path) -> types.SimpleNamespace:
    """Import AITER's Triton aligner and MXFP4 sort-quant from the tree at ``src``."""
    root = package_root(src)
    if any(n == "aiter" or n.startswith("aiter.") for n in sys.modules):
        loaded = sys.modules.get("aiter")
        where = list(getattr(loaded, "__path__", []) or [])
        if where != [str(root / "aiter")]:
            raise RuntimeError(f"another aiter is already imported ({where}); load from a fresh process")
    else:
        sys.meta_path.insert(0, _BarePackages(root))
        if not (root / "aiter" / "utility").is_dir():
            utility = types.ModuleType("aiter.utility")
            utility.__path__ = []
            sys.modules["aiter.utility"] = utility
        else:
            utility = importlib.import_module("aiter.utility")
        utility.dtypes = sys.modules["aiter.utility.dtypes"] = _stub_dtypes()
        try:
            importlib.import_module(_ARCH_MODULE)
        except Exception:  # no active GPU driver (CPU, interpreter): the wrappers only compare names
            arch = types.ModuleType(_ARCH_MODULE)
            arch.get_arch = lambda: "none"
            sys.modules[_ARCH_MODULE] = arch
        try:
            importlib.import_module(_GLUON_MODULE)
        except Exception:  # gfx1250 only; this Triton build has no such Gluon target
            gl = types.ModuleType(_GLUON_MODULE)
            gl._gluon_fused_rms_mxfp4_quant_kernel = None
            sys.modules[_GLUON_MODULE] = gl
    align = importlib.import_module("aiter.ops.triton.moe.moe_align_block_size")
    quant = importlib.import_module("aiter.ops.triton.quant.fused_mxfp4_quant")
    return types.SimpleNamespace(moe_align_block_size_triton=align.moe_align_block_size_triton,
                                 fused_dynamic_mxfp4_quant_moe_sort=quant.fused_dynamic_mxfp4_quant_moe_sort,
                                 root=root)


@triton.jit
def _flat_to_aiter_ids(flat_ptr, out_ptr, n, numel, pad_id, K: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    f = tl.load(flat_ptr + i, mask=i < n, other=0)
    tl.store(out_ptr + i, tl.where(f < numel, ((f % K) << 24) | (f // K), pad_id), mask=i < n)


def sort(ops, ids: torch.Tensor, num_experts: int, block_size: int):
    """AITER's Triton sort, ids converted: ``(sorted_ids, expert_ids, num_tokens_post_pad)``."""
    M, K = ids.shape
    n = M * K + num_experts * block_size - K  # AITER's max_num_tokens_padded
    flat = torch.full((n,), M * K, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty((n + block_size - 1) // block_size, dtype=torch.int32, device=ids.device)
    post_pad = torch.empty(1, dtype=torch.int32, device=ids.device)
    ops.moe_align_block_size_triton(ids, num_experts, block_size, flat, expert_ids, post_pad)
    sorted_ids = torch.empty_like(flat)
    _flat_to_aiter_ids[(triton.cdiv(n, 1024),)](flat, sorted_ids, n, M * K, (K << 24) | M, K=K, BLOCK=1024)
    return sorted_ids, expert_ids, post_pad


def stage1_quant(ops, x, sorted_ids, post_pad, block_size: int):
    """AITER's Triton MXFP4 sort-quant of the hidden states, scales in sorted order.

    It is given topk=1: with topk > 1 that kernel reads row ``token * topk + slot`` of its input
    (stage 2's per-pair activations), past the end of the hidden states' one row per token.
    """
    return ops.fused_dynamic_mxfp4_quant_moe_sort(x, sorted_ids, post_pad, x.shape[0], 1, block_size=block_size)


def chain(ops, ids, x, num_experts: int, block_size: int, model_dim: int):
    """The whole chain: sort, ``moe_buf`` zero-fill, MXFP4 quant with the scales in sorted order."""
    M, K = ids.shape
    sorted_ids, expert_ids, post_pad = sort(ops, ids, num_experts, block_size)
    moe_buf = torch.zeros(M, model_dim, dtype=torch.bfloat16, device=ids.device)
    q = stage1_quant(ops, x, sorted_ids, post_pad, block_size)
    return sorted_ids, expert_ids, post_pad, moe_buf, q
