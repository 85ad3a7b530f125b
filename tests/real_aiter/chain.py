"""Real AITER's MoE call chain on CPU: the compiled leaf ops replaced, every other one a tripwire.

Imported only inside a throw-away subprocess (``runner.py``): it installs the
ROCm fakes (``tests/helpers/fake_rocm.py``) and imports real ``aiter`` from an
AITER source tree, then

- replaces exactly the compiled ops ``fused_moe`` reaches, at the globals their
  callers look them up in, with the stand-in's torch kernels
  (``aiter_patches_standin/root/aiter/ops/_leaf_kernels.py`` and ``moe_op.py``,
  loaded under a private package name so they never pose as ``aiter``);
- makes AITER's JIT module loader (``aiter.jit.core.get_module``,
  ``get_args_of_build``, ``build_module``: every ``@compile_ops`` op, pybind or
  ctypes, goes through them) raise :class:`CompiledOpReached` naming the module,
  and records the hit, so a new HIP op on the path fails loudly even where
  AITER catches the exception;
- records every leaf call by name, at the level of AITER's Python op that the
  chain calls (the same names the stand-in's ``fused_moe`` calls), so the two
  sequences can be compared.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STUB_OPS = REPO / "aiter_patches_standin" / "root" / "aiter" / "ops"

CALLS: list[str] = []  # leaf calls, in order, of the current run
TRIPPED: list[str] = []  # compiled modules something tried to load


class CompiledOpReached(RuntimeError):
    """A compiled AITER op that the CPU harness did not replace was called."""


class _FlyDslKernels(types.ModuleType):
    """Stands for ``aiter.ops.flydsl.moe_kernels`` where FlyDSL is not installed: only the ops the
    harness replaces; any other name is a compiled op the harness does not know."""

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        TRIPPED.append(f"flydsl:{attr}")
        raise CompiledOpReached(f"FlyDSL op aiter.ops.flydsl.moe_kernels.{attr} reached: not replaced by the CPU "
                                "harness (tests/real_aiter/chain.py)")


def stub_ops():
    """The stand-in's leaf kernels and MoE ops as package ``_aiter_patches_stub_ops`` (not ``aiter``)."""
    name = "_aiter_patches_stub_ops"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(STUB_OPS)]
        pkg.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = pkg
    leaf = importlib.import_module(f"{name}._leaf_kernels")
    moe_op = importlib.import_module(f"{name}.moe_op")
    return leaf, moe_op


def recorded(name: str, fn):
    def leaf(*args, **kwargs):
        CALLS.append(name)
        return fn(*args, **kwargs)

    leaf.__name__ = name
    leaf.__wrapped_leaf__ = fn
    return leaf


def _tripwire(kind):
    def trip(md_name, *args, **kwargs):
        TRIPPED.append(f"{kind}:{md_name}")
        raise CompiledOpReached(f"compiled AITER module {md_name!r} reached ({kind}): not replaced by the CPU "
                                "harness; a new HIP op is on the path (tests/real_aiter/chain.py)")

    return trip


def import_real_aiter(tree: Path, gfx: str, cu_num: int, rocm_home: Path):
    """Install the fakes and import AITER's package from ``tree`` (a folder holding ``aiter/`` and ``csrc/``)."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import fake_rocm

    os.environ["AITER_META_DIR"] = str(tree)
    os.environ["CU_NUM"] = str(cu_num)
    os.environ["GPU_ARCHS"] = gfx
    fake_rocm.make_rocm_home(rocm_home, gfx=gfx, compute_units=cu_num)
    fake_rocm.install(rocm_home, gfx=gfx)
    sys.path.insert(0, str(tree))
    import aiter
    import aiter.fused_moe  # noqa: F401

    if not str(Path(aiter.__file__).resolve()).startswith(str(Path(tree).resolve())):
        raise RuntimeError(f"imported {aiter.__file__}, not the tree {tree}")
    return aiter


def _live(sorted_ids, sorted_expert_ids, num_valid_ids, block_m):
    """The sorted slots and blocks below ``num_valid_ids[0]`` (the leaf kernels skip the rest; at
    tuned-row shapes, 256 experts, computing them all would cost gigabytes). Test-only: reads the device."""
    n = int(num_valid_ids[0])
    blocks = min(-(-n // int(block_m)), sorted_expert_ids.shape[0])
    return sorted_ids[: max(blocks, 1) * int(block_m)], sorted_expert_ids[: max(blocks, 1)]


def install_leaves(aiter) -> None:
    """Replace the compiled ops on ``fused_moe``'s MX path; every other compiled op trips."""
    leaf, moe_op = stub_ops()
    quant = sys.modules["aiter.ops.quant"]
    moe = sys.modules["aiter.ops.moe_op"]

    def dynamic_per_group_scaled_quant(out, input, scales, group_size=32, shuffle_scale=True, num_rows=None,
                                       num_rows_factor=1):
        y, s = leaf.per_1x32_mx_quant_hip(input, quant_dtype=out.dtype, shuffle=shuffle_scale, num_rows=num_rows,
                                          num_rows_factor=num_rows_factor, scale_type=leaf.E8M0)
        out.view(leaf.torch.uint8).copy_(y.view(leaf.torch.uint8))
        scales.view(leaf.torch.uint8).copy_(s.view(leaf.torch.uint8))

    def ck_moe_stage1(hidden_states, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk,
                      kernelName=None, w1_scale=None, a1_scale=None, block_m=32, sorted_weights=None, quant_type=0,
                      activation=0, splitk=1, use_non_temporal_load=False, dst_type=None, is_shuffled=True):
        sorted_token_ids, sorted_expert_ids = _live(sorted_token_ids, sorted_expert_ids, num_valid_ids, block_m)
        moe_op.ck_moe_stage1_fwd(hidden_states, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out,
                                 topk, w1_scale=w1_scale, a1_scale=a1_scale, block_m=block_m,
                                 sorted_weights=sorted_weights, activation=activation)

    def ck_moe_stage2(inter_states, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk,
                      kernelName=None, w2_scale=None, a2_scale=None, block_m=32, sorted_weights=None, quant_type=0,
                      activation=0, splitk=1, use_non_temporal_load=False, dst_type=None, is_shuffled=True):
        sorted_token_ids, sorted_expert_ids = _live(sorted_token_ids, sorted_expert_ids, num_valid_ids, block_m)
        moe_op.ck_moe_stage2_fwd(inter_states, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk,
                                 w2_scale=w2_scale, a2_scale=a2_scale, block_m=block_m, sorted_weights=sorted_weights)

    def cktile(fn):
        def compiled(XQ, WQ, Y, sorted_ids, sorted_expert_ids, max_token_ids, topk, n_padded_zeros=0,
                     k_padded_zeros=0, topk_weight=None, x_scale=None, w_scale=None, exp_bias=None, activation=0,
                     block_m=32, split_k=1, kernel_name=""):
            sorted_ids, sorted_expert_ids = _live(sorted_ids, sorted_expert_ids, max_token_ids, block_m)
            return fn(XQ, WQ, Y, sorted_ids, sorted_expert_ids, max_token_ids, topk, topk_weight=topk_weight,
                      x_scale=x_scale, w_scale=w_scale, activation=activation, block_m=block_m, split_k=split_k)

        return compiled

    def asm_stage1(input, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, inter_dim, kernelName,
                   block_m, *args, **kwargs):
        sorted_token_ids, sorted_expert_ids = _live(sorted_token_ids, sorted_expert_ids, num_valid_ids, block_m)
        return moe_op.moe_stage1_g1u1(input, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out,
                                      inter_dim, kernelName, block_m, *args, **kwargs)

    # (module, name the caller looks up, CPU implementation, recorded name: the chain-level op)
    compiled = [
        (aiter, "moe_sorting_opus_get_workspace_size", leaf.moe_sorting_opus_get_workspace_size, None),
        (aiter, "moe_sorting_opus_fwd", leaf.moe_sorting_opus_fwd, "moe_sorting_opus_fwd"),
        (aiter, "moe_sorting_fwd", leaf.moe_sorting_fwd, "moe_sorting_fwd"),
        (quant, "fused_dynamic_mx_quant_moe_sort_hip", leaf.fused_dynamic_mx_quant_moe_sort_hip,
         "fused_dynamic_mx_quant_moe_sort_hip"),
        (quant, "mxfp4_moe_sort_hip", leaf.mxfp4_moe_sort_hip, "mxfp4_moe_sort_hip"),
        (quant, "dynamic_per_group_scaled_quant", dynamic_per_group_scaled_quant, None),
        (moe, "ck_moe_stage1", ck_moe_stage1, None),
        (moe, "ck_moe_stage2", ck_moe_stage2, None),
        (moe, "moe_cktile2stages_gemm1_ck", cktile(moe_op.moe_cktile2stages_gemm1), None),
        (moe, "moe_cktile2stages_gemm2_ck", cktile(moe_op.moe_cktile2stages_gemm2), None),
        (aiter, "moe_stage1_g1u1", asm_stage1, "moe_stage1_g1u1"),
        (aiter, "silu_and_mul", moe_op.silu_and_mul, "silu_and_mul"),
        (aiter, "gelu_and_mul", moe_op.gelu_and_mul, "gelu_and_mul"),
        (aiter, "swiglu_and_mul", moe_op.swiglu_and_mul, "swiglu_and_mul"),
    ]
    for mod, attr, fn, name in compiled:
        if not hasattr(mod, attr):
            raise RuntimeError(f"{mod.__name__}.{attr} is gone: the harness's leaf table needs updating")
        setattr(mod, attr, recorded(name, fn) if name else fn)
    # Python ops of AITER that the chain calls: recorded where the chain looks them up, run as AITER's.
    for attr in ("per_1x32_mx_quant_hip",):
        setattr(quant, attr, recorded(attr, getattr(quant, attr)))
    for attr in ("ck_moe_stage1_fwd", "ck_moe_stage2_fwd", "moe_cktile2stages_gemm1", "moe_cktile2stages_gemm2"):
        setattr(aiter, attr, recorded(attr, getattr(aiter, attr)))
    try:
        flydsl = importlib.import_module("aiter.ops.flydsl.moe_kernels")
    except ModuleNotFoundError:  # it imports the FlyDSL compiler at import: a module of compiled ops
        flydsl = _FlyDslKernels("aiter.ops.flydsl.moe_kernels")
        flydsl.flydsl_silu_and_mul_interleaved = flydsl.flydsl_swiglu_and_mul_interleaved = None
        sys.modules[flydsl.__name__] = flydsl
        setattr(sys.modules["aiter.ops.flydsl"], "moe_kernels", flydsl)
    for attr in ("flydsl_silu_and_mul_interleaved", "flydsl_swiglu_and_mul_interleaved"):
        if not hasattr(flydsl, attr):
            raise RuntimeError(f"aiter.ops.flydsl.moe_kernels.{attr} is gone: update the harness's leaf table")
        setattr(flydsl, attr, recorded(attr, getattr(moe_op, attr)))
    core = sys.modules["aiter.jit.core"]
    for attr in ("get_module", "get_args_of_build", "build_module"):
        setattr(core, attr, _tripwire(attr))


def install_stand_in_recorders(aiter) -> None:
    """The same recorders on the stand-in's ops (its leaves are the torch kernels already)."""
    quant = sys.modules["aiter.ops.quant"]
    for attr in ("fused_dynamic_mx_quant_moe_sort_hip", "mxfp4_moe_sort_hip", "per_1x32_mx_quant_hip"):
        setattr(quant, attr, recorded(attr, getattr(quant, attr)))
    for attr in ("moe_sorting_opus_fwd", "moe_sorting_fwd", "ck_moe_stage1_fwd", "ck_moe_stage2_fwd",
                 "moe_cktile2stages_gemm1", "moe_cktile2stages_gemm2", "moe_stage1_g1u1", "silu_and_mul",
                 "gelu_and_mul", "swiglu_and_mul", "flydsl_silu_and_mul_interleaved",
                 "flydsl_swiglu_and_mul_interleaved"):
        setattr(aiter, attr, recorded(attr, getattr(aiter, attr)))
