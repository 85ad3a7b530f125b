"""The stand-in's backend for the ``gemm_out_zeroed`` patch: its own Triton split-K kernel, no memset.

The stand-in's asm block-scale GEMM is ``blockscale_gemm_splitk`` (a memset, then splits that add
in a fixed order), not AITER's ``.co``; so the patch's default backend (AITER's ``.co`` through
HIP) cannot serve it. The stand-in's ``aiter`` package registers :data:`BACKEND` for itself at its
import (:func:`register`): the patch then launches the same kernel with ``zero_out=False`` into
the caller's zeroed ``out``, and the bits equal the stand-in's memset + GEMM at every split.
"""

from __future__ import annotations

import os
import sys

from aiter_patches import runtime
from aiter_patches.patches.gemm_out_zeroed import HandBack, register_backend

_KERNEL: list = []  # the kernel module, imported once (an import statement per call costs ~1 µs)


def _kernel():
    if not _KERNEL:
        from . import blockscale_gemm_splitk

        _KERNEL.append(blockscale_gemm_splitk)
    return _KERNEL[0]


class TritonSplitK:
    """``gemm_out_zeroed``'s backend on the stand-in (see ``aiter_patches.patches.gemm_out_zeroed.Backend``)."""

    def environment(self, aiter) -> tuple:
        """What ``plan`` reads besides the arguments: AITER's launcher rule, the Triton backend check,
        the kernel module's limits and kernels (objects, kept alive by the key), in one flat tuple."""
        k = _KERNEL[0] if _KERNEL else _kernel()
        return (aiter, getattr(sys.modules.get("aiter.ops.gemm_op_a8w8"), "launcher_split", None),
                runtime.triton_backend_reason, os.environ.get("TRITON_INTERPRET"),
                k.MAX_WORKSPACE_BYTES, k.MAX_SPLITS, k.block_config, k._blockscale_gemm_kernel, k.unsupported_reason)

    def plan(self, A, B, out, A_scale, B_scale, splitK, kernelName, bpreshuffle):
        """A kept one-launch plan of the kernel (``None``: no rows, nothing to launch), or a :class:`HandBack`."""
        from aiter.ops.gemm_op_a8w8 import launcher_split

        from aiter_patches.reference.blockscale_gemm import a_scale_as_read_by_asm

        split = launcher_split(A.shape[1], -1 if splitK is None else splitK)
        if split <= 1:
            return HandBack("split count 1: the original launches no memset")
        k = _kernel()
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
            return None
        plan = k.one_launch_plan(M, B.shape[0], K, split, bpreshuffle, False, A.stride(0), out.stride(0),
                                 a_s.stride(0), a_s.stride(1), B_scale.stride(0), B_scale.stride(1))
        if plan is None:  # pragma: no cover - workspace_reason above refused it
            return HandBack("split-K workspace above the one-launch cap")
        return plan

    def launch(self, plan, A, B, out, A_scale, B_scale) -> None:
        """A_scale as passed: the plan has the strides AITER's asm reads it with."""
        if plan is not None:
            (_KERNEL[0] if _KERNEL else _kernel()).run_plan(plan, A, B, out, A_scale, B_scale)


BACKEND = TritonSplitK()


def register(aiter) -> None:
    """Called by the stand-in's ``aiter`` package at its import: :data:`BACKEND` serves it."""
    register_backend(aiter, BACKEND)
