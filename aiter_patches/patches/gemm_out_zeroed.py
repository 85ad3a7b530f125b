"""Patch: ``gemm_a8w8_blockscale_bpreshuffle_asm(..., out_zeroed=True)`` skips the split-K memset.

AITER's asm block-scale fp8 GEMM adds its K splits into ``out`` atomically, so
its launcher memsets ``out`` before every launch with more than one split. When
the kernel that produced the buffer already zeroed it, that memset is a wasted
launch and a wasted pass over ``[M, N]``. With ``out_zeroed=True`` the caller
promises ``out`` holds zeros; the patch then launches the same kernel without
the memset. With a non-zero ``out`` the splits add onto it: that is the
contract, not a bug. ``out_zeroed=False`` (the default), or a split count of
one, is exactly the original call.

Host time (issue 15): the gate's verdict (a kept kernel plan, or the reason to hand back) is kept
per call key (``call_key``: the arguments' shapes, strides, dtypes, devices and Python values, the
grad mode, the limits, modules and functions the gate reads), so a repeated call reads its
arguments' metadata once and launches. On real AITER's ``.co`` branch the key also holds AITER's
tree (the root its ``aiter.jit.core`` names) and the HIP-side functions the gate asks; what those
read of the file system and the device (the kernel list, each ``.co``'s metadata, the device's arch
and CU count) is read once per process already, so a kept verdict decides as the gate would.
"""

from __future__ import annotations

import operator
import os
import sys
from typing import Any, NamedTuple

import torch

from .. import call_key, runtime
from ..core.declarations import CheckResult, Patch, Target
from . import moe_call, pins, relied_on

NAME = "gemm_out_zeroed"


class HandBack(NamedTuple):
    """This call goes to AITER unchanged, for ``reason`` (counted as a fallback)."""

    reason: str


class AsmLaunch(NamedTuple):
    """Real AITER's no-memset ``.co`` launch: the kernel and split AITER's launcher picks (a
    ``hip_blockscale_asm.LaunchPlan``) and AITER's tree, launched on the call's tensors. Python
    values only: a verdict of the cache below."""

    plan: Any
    root: str


class TritonLaunch(NamedTuple):
    """The stand-in's no-memset launch: a kept kernel plan (Python values only), run on the call's
    tensors; ``plan`` None: no rows, nothing to launch. A verdict of the cache below."""

    plan: Any


_KERNEL: list = []  # the kernel module, imported once (an import statement per call costs ~1 µs)


def _kernel():
    if not _KERNEL:
        from ..kernels import blockscale_gemm_splitk

        _KERNEL.append(blockscale_gemm_splitk)
    return _KERNEL[0]


_HIP: list = []  # the ROCm launcher module, imported once (an import statement per call costs ~1 µs)


def _hip():
    if not _HIP:
        from ..kernels import hip_blockscale_asm

        _HIP.append(hip_blockscale_asm)
    return _HIP[0]


def _aiter_root() -> str | None:
    return _hip().aiter_root_of(sys.modules.get("aiter"))  # AITER's .co files are not inside its package


# Verdicts of the gate by call_key: every check below reads the arguments' metadata, the grad mode
# and what _environment() / _asm_environment() name only (real AITER's .co branch: its file system and
# device answers are read once per process by hip_blockscale_asm, and the key names those functions).
VERDICTS = call_key.GuardedVerdicts(NAME)
_OPERANDS = ("A", "B", "out", "A_scale", "B_scale")


def _environment(aiter=None) -> tuple:
    """What the stand-in's gate reads besides the arguments: AITER's modules and launcher rule, the
    backend check, the kernel module's limits and kernels (objects, kept alive by the key), in one
    flat tuple (``aiter``: ``sys.modules.get("aiter")``, as the caller read it)."""
    k = _KERNEL[0] if _KERNEL else _kernel()
    if aiter is None:
        aiter = sys.modules.get("aiter")
    return (aiter, getattr(sys.modules.get("aiter.ops.gemm_op_a8w8"), "launcher_split", None),
            runtime.triton_backend_reason, os.environ.get("TRITON_INTERPRET"), torch.is_grad_enabled(),
            k.MAX_WORKSPACE_BYTES, k.MAX_SPLITS, k.block_config, k._blockscale_gemm_kernel, k.unsupported_reason)


def _asm_environment(aiter) -> tuple:
    """What real AITER's ``.co`` branch of the gate reads besides the arguments, in one flat tuple:
    AITER's module and tree (the root its ``aiter.jit.core`` names), the grad mode, and the
    ROCm-side functions and values the branch asks (by identity: a test or a server replacing one
    gets a new verdict)."""
    hip = _hip()
    return (aiter, _aiter_root(), torch.is_grad_enabled(), torch.version.hip, torch.cuda.is_available,
            torch.cuda.get_device_properties, hip.available, hip.gfx_of, hip.unsupported_reason, hip.plan_launch,
            hip.load_kernel_list, hip.select_kernel, hip.aligned_split, hip.SUPPORTED_GFX, hip.code_object_path,
            hip.code_object_reason, hip.launch_planned, id(hip._co_checks))


def _operand_getter(binder, args: tuple, kwargs: dict):
    """``f(args, kwargs) -> (A, B, out, A_scale, B_scale)`` for calls bound like this one."""
    where = []
    for name in _OPERANDS:
        i = binder.positional.index(name) if name in binder.positional else len(args)
        where.append((True, i) if i < len(args) else (False, name))
    if all(pos for pos, _ in where):
        get = operator.itemgetter(*(i for _, i in where))
        return lambda a, kw: get(a)
    return lambda a, kw: tuple(a[i] if pos else kw[i] for pos, i in where)


def _wrapper(inner, site):
    binder = site.binder
    counters = site.counters
    verdicts = VERDICTS
    split_key, Unkeyable = call_key.split_key, call_key.Unkeyable
    verdicts.clear()  # built at apply (and at a revert that rebuilds the chain): decide afresh

    def gemm_a8w8_blockscale_bpreshuffle_asm(*args, out_zeroed=False, **kwargs):
        if not out_zeroed:
            return inner(*args, **kwargs)
        key, tensors = None, ()
        aiter = sys.modules.get("aiter")
        try:
            split, tensors = split_key(args, kwargs)
            key = (split, _environment(aiter) if _stand_in(aiter) else _asm_environment(aiter))
        except Unkeyable:
            pass
        try:
            got = verdicts.get(key, tensors) if key is not None else None
        except TypeError:  # a replaced AITER module or function that does not hash: decided in full
            key = got = None
        if got is None:
            plan, operands = _decide(binder, args, kwargs)
            if key is not None:  # the verdict follows from what the key and the tensors' guard hold
                verdicts.put(key, tensors, (plan, _operand_getter(binder, args, kwargs) if operands else None))
        else:
            plan, get = got
            operands = get(args, kwargs) if get is not None else None
        kind = type(plan)
        if kind is HandBack:
            counters.fallback(plan.reason)
            return inner(*args, **kwargs)
        try:
            if kind is TritonLaunch:
                if plan.plan is not None:  # A_scale as passed: the plan has the strides AITER's asm reads it with
                    (_KERNEL[0] if _KERNEL else _kernel()).run_plan(plan.plan, *operands)
            else:
                _hip().launch_planned(*operands, plan.plan, aiter_root=plan.root)
        except Exception as exc:
            counters.failed(exc, "GEMM launch without memset")
            return inner(*args, **kwargs)
        counters.hit()
        return operands[2]  # every plan that launches came with its operands

    return moe_call.like(gemm_a8w8_blockscale_bpreshuffle_asm, inner)


def _decide(binder, args, kwargs):
    """``(verdict, operands or None)``: the gate in full, for a call not decided yet."""
    bound, problems = binder.bind(args, kwargs)
    if problems:
        return HandBack(problems[0]), None
    if bound.get("bias") is not None:
        return HandBack("bias given"), None
    for name in ("splitK", "bpreshuffle"):  # read by value: a tensor would be keyed by metadata only
        if isinstance(bound.get(name), torch.Tensor):
            return HandBack(f"{name} is a tensor: the gate reads it as a Python value"), None
    reason = _autograd_reason(bound["out"])
    if reason is not None:
        return HandBack(reason), None
    try:
        plan = _plan(bound)
    except ValueError as exc:  # AITER would raise the same check: let it, with its own message
        plan = HandBack(f"launcher check: {exc}")
    operands = None if isinstance(plan, HandBack) else tuple(bound[n] for n in _OPERANDS)
    return plan, operands


def _stand_in(aiter) -> bool:
    return bool(getattr(aiter, "IS_AITER_PATCHES_STAND_IN", False))


def _autograd_reason(out) -> str | None:
    """AITER writes ``out`` in place through a custom op, which autograd refuses for a tensor that
    requires grad under grad mode (a leaf raises); the kernel's raw pointer write would not refuse."""
    if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
        return "out requires grad under grad mode (AITER's in-place write decides the outcome)"
    return None


def _plan(bound: dict) -> TritonLaunch | AsmLaunch | HandBack:
    """A no-memset launch for this call, or the reason there is none (split 1 needs no patch)."""
    A, B, out = bound["A"], bound["B"], bound["out"]
    A_scale, B_scale = bound["A_scale"], bound["B_scale"]
    splitK = bound.get("splitK")
    bpreshuffle = bound.get("bpreshuffle", True)
    bpreshuffle = True if bpreshuffle is None else bool(bpreshuffle)
    if _stand_in(sys.modules.get("aiter")):
        from aiter.ops.gemm_op_a8w8 import launcher_split

        split = launcher_split(A.shape[1], -1 if splitK is None else splitK)
        if split <= 1:
            return HandBack("split count 1: the original launches no memset")
        k = _kernel()
        from ..reference.blockscale_gemm import a_scale_as_read_by_asm

        try:
            a_s = a_scale_as_read_by_asm(A_scale)  # as the stand-in's launcher reads it
        except ValueError as exc:
            return HandBack(str(exc))
        reason = runtime.triton_backend_reason(A.device) or k.unsupported_reason(
            A, B, out, a_s, B_scale, split, bpreshuffle) or k.workspace_reason(A.shape[0], B.shape[0], split)
        if reason is not None:
            return HandBack(reason)
        M, K = A.shape
        if M == 0:
            return TritonLaunch(None)
        plan = k.one_launch_plan(M, B.shape[0], K, split, bpreshuffle, False, A.stride(0), out.stride(0),
                                 a_s.stride(0), a_s.stride(1), B_scale.stride(0), B_scale.stride(1))
        if plan is None:  # pragma: no cover - workspace_reason above refused it
            return HandBack("split-K workspace above the one-launch cap")
        return TritonLaunch(plan)
    hip = _hip()
    reason = hip.unsupported_reason(A, B, out, A_scale, B_scale)
    if reason is not None:
        return HandBack(reason)
    root = _aiter_root()
    reason = hip.available(A.device, root)
    if reason is not None:
        return HandBack(f"AITER's .co cannot be launched here: {reason}")
    plan = hip.plan_launch(A, B, aiter_root=root, splitK=splitK, kernelName=bound.get("kernelName"),
                           bpreshuffle=bpreshuffle)
    if plan.split <= 1:
        return HandBack("split count 1: the original launches no memset")
    reason = hip.code_object_reason(root, plan.gfx, plan.cfg)
    if reason is not None:
        return HandBack(f"AITER's .co refused: {reason}")
    return AsmLaunch(plan, root)


def check(device) -> CheckResult:
    """``aiter-patches verify``: out_zeroed=True into zeros equals AITER's memset + GEMM, bit for bit."""
    import torch

    from .. import registry, verify
    from ..aiter_contract import SCALE_BLOCK
    from ..reference.blockscale_gemm import shuffle_weight_16x16

    aiter = sys.modules["aiter"]
    gemm = sys.modules["aiter.ops.gemm_op_a8w8"].gemm_a8w8_blockscale_bpreshuffle_asm
    fast_hits = lambda: registry.stats()[NAME]["fast"]  # noqa: E731
    fp8 = aiter.dtypes.fp8
    g = torch.Generator().manual_seed(7)
    M, N, K, split = 16, 256, 512, 2
    A = (torch.randn(M, K, generator=g) * 2).to(fp8).to(device)
    B = (torch.randn(N, K, generator=g) * 2).to(fp8)
    Bs = shuffle_weight_16x16(B).to(device)
    a_scale = (torch.rand(K // SCALE_BLOCK, M, generator=g) + 0.5).to(device).t()  # K-major storage, [M, K/128] view
    b_scale = (torch.rand(N // SCALE_BLOCK, K // SCALE_BLOCK, generator=g) + 0.5).to(device)
    out_p = torch.zeros(M, N, dtype=torch.bfloat16, device=device)
    before = fast_hits()
    gemm(A, Bs, out_p, a_scale, b_scale, splitK=split, out_zeroed=True)
    if fast_hits() <= before:
        why = registry.stats()[NAME]["fallback"]
        if getattr(aiter, "IS_AITER_PATCHES_STAND_IN", False):
            return CheckResult("bitwise", False, f"fast path not taken ({why})")
        return CheckResult("bitwise", True, f"every call goes to AITER unchanged here: no fast path ({why})")
    out_o = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
    with verify.suspended():
        gemm(A, Bs, out_o, a_scale, b_scale, splitK=split)
    ok = torch.equal(out_p.view(torch.int16), out_o.view(torch.int16))
    return CheckResult("bitwise", ok, f"split {split}: no-memset result equals memset + GEMM" if ok else "outputs differ")


PATCH = Patch(
    name=NAME,
    summary="gemm_a8w8_blockscale_bpreshuffle_asm(..., out_zeroed=True): split-K into a pre-zeroed out, no memset",
    targets=(
        Target("aiter.ops.gemm_op_a8w8", "gemm_a8w8_blockscale_bpreshuffle_asm",
               pins.GEMM_A8W8_BLOCKSCALE_BPRESHUFFLE_ASM, _wrapper,
               "Takes the extra keyword out_zeroed; the package alias aiter.gemm_a8w8_blockscale_bpreshuffle_asm "
               "is rebound with it."),
    ),
    kernel_module="aiter_patches.kernels.blockscale_gemm_splitk",
    relies_on=relied_on.GEMM_OUT_ZEROED,
    order=50,
    check=check,
)
