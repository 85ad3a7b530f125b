"""A minimal ``sglang`` package around the functions the SGLang integrations patch, read from the wheel at test time.

``srt/models/deepseek_v2.py`` imports half of SGLang; the tree written here keeps
only what the hooked methods read: ``DeepseekV2MoE`` with SGLang's own
``forward_normal``, ``forward_normal_dual_stream``, ``_adds_replicated_output`` and
``_forward_shared_experts`` (their lines as the wheel has them, indentation
included, so their source hashes are the wheel's), the module flags they read
(ROCm with AITER: ``_is_hip``, ``_use_aiter``), and SGLang's own
``maybe_fuse_routed_scale_and_shared_add`` in its module. Nothing of SGLang is
copied into the repository.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from . import server_tree

WHEEL_NAME = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
ENV = "AITER_PATCHES_TEST_SGLANG_WHEEL"
DOWNLOAD = ("--no-deps --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 "
            "--platform manylinux_2_34_x86_64 sglang==0.5.23")
DS = "sglang/srt/models/deepseek_v2.py"
MX = "sglang/srt/layers/quantization/mxfp4_flashinfer_trtllm_moe.py"
METHODS = ("forward_normal_dual_stream", "forward_normal", "_adds_replicated_output", "_forward_shared_experts")

_DS_HEAD = '''"""Test tree: SGLang 0.5.23's DeepseekV2MoE methods (from the wheel) over fakes of what they import."""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

BumpAllocator = Any
from sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe import maybe_fuse_routed_scale_and_shared_add

_is_cuda = _is_musa = _is_xpu = False
_is_hip = _use_aiter = True


class KTEPWrapperMethod:
    pass


class BaseDispatcher:
    pass


class CombineInput:
    pass


def use_intel_amx_backend(layer):
    return False


def post_experts_all_reduce(x):
    return x


def should_add_replicated_moe_output():
    return True


def adds_replicated_output_to_partial():
    return True


class MoEOutput:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class _HipMoe:
    @staticmethod
    def forward_gate(layer, hidden_states, gemm_output_zero_allocator, fused_gate=True):
        return layer.gate(hidden_states), None


_hip_moe = _HipMoe()


class DeepseekV2MoE(torch.nn.Module):
'''

_MX_HEAD = '''"""Test tree: SGLang 0.5.23's maybe_fuse_routed_scale_and_shared_add (from the wheel)."""
import torch


class Mxfp4FlashinferTrtllmMoEMethod:
    pass


'''

_STUB_CLASSES = {
    "sglang/srt/layers/quantization/expert_pack.py": "ExpertPackMoEMethod",
    "sglang/srt/layers/quantization/mxfp4_flashinfer_cutlass_moe.py": "Mxfp4FlashinferCutlassMoEMethod",
    "sglang/srt/layers/quantization/mxfp4_marlin_moe.py": "Mxfp4MarlinMoEMethod",
}


def wheel() -> Path:
    from helpers.wheels import cached_wheel

    return cached_wheel(WHEEL_NAME, ENV, DOWNLOAD)


def read(member: str) -> str:
    with zipfile.ZipFile(wheel()) as z:
        return z.read(member).decode("utf-8")


def write_tree(root: Path, edit=None) -> Path:
    """The tree under ``root``; ``edit(qualname, source) -> source`` changes a function (a drifted copy)."""
    edit = edit or (lambda q, s: s)
    ds, mx = read(DS), read(MX)
    for d in ("sglang", "sglang/srt", "sglang/srt/models", "sglang/srt/layers", "sglang/srt/layers/quantization"):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / "__init__.py").write_text("")
    body = "\n".join(edit(f"DeepseekV2MoE.{m}", server_tree.segment(ds, f"DeepseekV2MoE.{m}")) for m in METHODS)
    (root / DS).write_text(_DS_HEAD + body)
    fuse = "maybe_fuse_routed_scale_and_shared_add"
    (root / MX).write_text(_MX_HEAD + edit(fuse, server_tree.segment(mx, fuse)))
    for path, cls in _STUB_CLASSES.items():
        (root / path).write_text(f"class {cls}:\n    pass\n")
    return root


def importable(root: Path):
    return server_tree.importable(root, "sglang")


@pytest.fixture
def sglang_tree(tmp_path):
    root = write_tree(tmp_path / "tree")
    with importable(root):
        yield root
