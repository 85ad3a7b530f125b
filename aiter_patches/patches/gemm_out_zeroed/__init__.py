"""Patch: ``gemm_a8w8_blockscale_bpreshuffle_asm(..., out_zeroed=True)`` skips the split-K memset.

AITER's asm block-scale fp8 GEMM adds its K splits into ``out`` atomically, so
its launcher memsets ``out`` before every launch with more than one split. When
the kernel that produced the buffer already zeroed it, that memset is a wasted
launch and a wasted pass over ``[M, N]``. With ``out_zeroed=True`` the caller
promises ``out`` holds zeros; the patch then launches the same kernel without
the memset. With a non-zero ``out`` the splits add onto it: that is the
contract, not a bug. ``out_zeroed=False`` (the default), or a split count of
one, is exactly the original call.

The launch without the memset is a backend's (:class:`Backend`): by default AITER's own ``.co``
through HIP (``kernels/hip_blockscale_asm.py``). An AITER build whose asm GEMM is another kernel
registers the backend that launches it, at its import (:func:`register_backend`); this module
knows no such build.

Host time (issue 15): the gate's verdict (a kept kernel plan, or the reason to hand back) is kept
per call key (``call_key``: the arguments' shapes, strides, dtypes, devices and Python values, the
grad mode, the backend and what its ``environment()`` names: the limits, modules and functions the
gate reads), so a repeated call reads its arguments' metadata once and launches. For AITER's ``.co``
the key holds AITER's tree (the root its ``aiter.jit.core`` names) and the HIP-side functions the
gate asks; what those read of the file system and the device (the kernel list, each ``.co``'s
metadata, the device's arch and CU count) is read once per process already, so a kept verdict
decides as the gate would.
"""

from __future__ import annotations

import operator
import sys
import weakref
from typing import Any, NamedTuple, Protocol

from ... import call_key, self_check
from ...core.declarations import CheckResult, Patch, Target
from .. import memset_skipped, pins, relied_on
from ..moe import call as moe_call

NAME = "gemm_out_zeroed"


class HandBack(NamedTuple):
    """This call goes to AITER unchanged, for ``reason`` (counted as a fallback)."""

    reason: str


class Launch(NamedTuple):
    """A no-memset launch: ``backend.launch(plan, A, B, out, A_scale, B_scale)`` on the call's tensors.
    Python values only (``plan`` is the backend's): a verdict of the cache below."""

    backend: Any
    plan: Any


# ---------------------------------------------------------------- the backend seam

class Backend(Protocol):
    """What launches AITER's split-K block-scale GEMM without its memset, for one AITER build.

    The gate below checks what AITER itself would refuse to take the fast path for (the
    signature, ``bias``, autograd); the backend decides the rest and launches:

    - ``environment(aiter)``: everything ``plan`` reads besides the call's arguments, as one
      hashable tuple (modules and functions by identity, limits by value); a kept verdict is
      reused only while it is equal.
    - ``plan(A, B, out, A_scale, B_scale, splitK, kernelName, bpreshuffle)``: a plan of Python
      values (no tensor) for a no-memset launch of these operands, or a :class:`HandBack`
      (``split count 1``: the original launches no memset). ``ValueError``: AITER's launcher
      would raise the same check, so the call is handed back to let it.
    - ``launch(plan, A, B, out, A_scale, B_scale)``: launch ``plan`` on the operands as given.

    The default, :data:`AITER_CODE_OBJECT`, launches AITER's own ``.co`` through HIP
    (``kernels/hip_blockscale_asm.py``). An AITER build whose asm GEMM is something else
    registers its own backend at its import with :func:`register_backend`.
    """

    def environment(self, aiter) -> tuple: ...

    def plan(self, A, B, out, A_scale, B_scale, splitK, kernelName, bpreshuffle) -> Any: ...

    def launch(self, plan, A, B, out, A_scale, B_scale) -> None: ...


_BACKENDS: dict[int, Backend] = {}  # id(aiter package) -> its registered backend; dropped with the package


def register_backend(aiter, backend: Backend | None) -> None:
    """``backend`` serves this patch's calls while ``aiter`` (an imported AITER package) is the one in
    ``sys.modules``; ``None`` gives that package the default again. Read on every call: a change
    after a kept verdict is decided afresh. The entry goes when the package object does."""
    key = id(aiter)
    if backend is None:
        _BACKENDS.pop(key, None)
        return
    if key not in _BACKENDS:
        weakref.finalize(aiter, _BACKENDS.pop, key, None)
    _BACKENDS[key] = backend


def backend_for(aiter) -> Backend:
    """The backend serving calls while ``aiter`` is imported: its registered one, else AITER's ``.co``."""
    return _BACKENDS.get(id(aiter), AITER_CODE_OBJECT)


_HIP: list = []  # the ROCm launcher module and torch, imported once (an import statement per call costs ~1 µs)


def _hip():
    if not _HIP:
        import torch

        from ...kernels import hip_blockscale_asm

        _HIP.extend((hip_blockscale_asm, torch))
    return _HIP[0]


def _aiter_root() -> str | None:
    return _hip().aiter_root_of(sys.modules.get("aiter"))  # AITER's .co files are not inside its package


class AiterCodeObject:
    """AMD's AITER: its own ``.co`` kernel, launched through HIP without the memset.

    What the gate reads of the file system and the device (the kernel list, each ``.co``'s
    metadata, the device's arch and CU count) is read once per process by ``hip_blockscale_asm``;
    the environment names AITER's tree (the root its ``aiter.jit.core`` names) and those
    functions, so a kept verdict decides as the gate would."""

    def environment(self, aiter) -> tuple:
        """AITER's module and tree and the ROCm-side functions and values ``plan`` asks (by identity: a
        test or a server replacing one gets a new verdict), in one flat tuple."""
        hip = _HIP[0] if _HIP else _hip()
        torch = _HIP[1]
        return (aiter, _aiter_root(), torch.version.hip, torch.cuda.is_available,
                torch.cuda.get_device_properties, hip.available, hip.gfx_of, hip.unsupported_reason, hip.plan_launch,
                hip.load_kernel_list, hip.select_kernel, hip.aligned_split, hip.SUPPORTED_GFX, hip.code_object_path,
                hip.code_object_reason, hip.launch_planned, id(hip._co_checks))

    def plan(self, A, B, out, A_scale, B_scale, splitK, kernelName, bpreshuffle):
        hip = _hip()
        reason = hip.unsupported_reason(A, B, out, A_scale, B_scale)
        if reason is not None:
            return HandBack(reason)
        root = _aiter_root()
        reason = hip.available(A.device, root)
        if reason is not None:
            return HandBack(f"AITER's .co cannot be launched here: {reason}")
        plan = hip.plan_launch(A, B, aiter_root=root, splitK=splitK, kernelName=kernelName, bpreshuffle=bpreshuffle)
        if plan.split <= 1:
            return HandBack("split count 1: the original launches no memset")
        reason = hip.code_object_reason(root, plan.gfx, plan.cfg)
        if reason is not None:
            return HandBack(f"AITER's .co refused: {reason}")
        return (plan, root)

    def launch(self, plan, A, B, out, A_scale, B_scale) -> None:
        asm_plan, root = plan
        _hip().launch_planned(A, B, out, A_scale, B_scale, asm_plan, aiter_root=root)


AITER_CODE_OBJECT = AiterCodeObject()


# ---------------------------------------------------------------- the wrapper

# Verdicts of the gate by call_key: every check below reads the arguments' metadata, the grad mode,
# the backend serving this AITER and what its environment() names only.
VERDICTS = call_key.GuardedVerdicts(NAME)
_OPERANDS = ("A", "B", "out", "A_scale", "B_scale")


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
    import torch  # AITER is imported by now: the wrapper is built when its module is

    binder = site.binder
    counters = site.counters
    verdicts = VERDICTS
    split_key, Unkeyable = call_key.split_key, call_key.Unkeyable
    grad_enabled = torch.is_grad_enabled
    backends, default = _BACKENDS, AITER_CODE_OBJECT
    verdicts.clear()  # built at apply (and at a revert that rebuilds the chain): decide afresh

    def gemm_a8w8_blockscale_bpreshuffle_asm(*args, out_zeroed=False, **kwargs):
        if not out_zeroed:
            return inner(*args, **kwargs)
        key, tensors = None, ()
        aiter = sys.modules.get("aiter")
        backend = backends.get(id(aiter), default)
        try:
            split, tensors = split_key(args, kwargs)
            key = (split, grad_enabled(), backend, backend.environment(aiter))
        except Unkeyable:
            pass
        try:
            got = verdicts.get(key, tensors) if key is not None else None
        except TypeError:  # a replaced AITER module or function that does not hash: decided in full
            key = got = None
        if got is None:
            plan, operands = (HandBack(STOOD_DOWN), None) if site.stood_down else _decide(binder, args, kwargs, backend)
            check = self_check.new_plan(NAME) if operands else None
            if key is not None:  # the verdict follows from what the key and the tensors' guard hold
                verdicts.put(key, tensors, (plan, _operand_getter(binder, args, kwargs) if operands else None, check))
                if site.stood_down:  # stood down while this call decided: nothing kept outlives it
                    verdicts.clear()
        else:
            plan, get, check = got
            operands = get(args, kwargs) if get is not None else None
        if type(plan) is HandBack:
            counters.fallback(plan.reason)
            return inner(*args, **kwargs)
        if check is not None and check.left:
            served = first_calls.run(site, verdicts.clear, check, inner, binder, args, kwargs, plan, operands)
            if served is not first_calls.FAST:
                return served
        try:
            plan.backend.launch(plan.plan, *operands)
        except Exception as exc:
            counters.failed(exc, "GEMM launch without memset")
            return inner(*args, **kwargs)
        memset_skipped.report()  # the layer that forwarded the promise counts its hit by this
        counters.hit()
        return operands[2]  # every plan that launches came with its operands

    return moe_call.like(gemm_a8w8_blockscale_bpreshuffle_asm, inner)


from . import first_calls  # noqa: E402 (it names this module's Launch in its docstring only)

STOOD_DOWN = self_check.STOOD_DOWN


def _decide(binder, args, kwargs, backend):
    """``(verdict, operands or None)``: the gate in full, for a call not decided yet."""
    import torch

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
        plan = _plan(bound, backend)
    except ValueError as exc:  # AITER would raise the same check: let it, with its own message
        plan = HandBack(f"launcher check: {exc}")
    operands = None if isinstance(plan, HandBack) else tuple(bound[n] for n in _OPERANDS)
    return plan, operands


def _autograd_reason(out) -> str | None:
    """AITER writes ``out`` in place through a custom op, which autograd refuses for a tensor that
    requires grad under grad mode (a leaf raises); the kernel's raw pointer write would not refuse."""
    import torch

    if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
        return "out requires grad under grad mode (AITER's in-place write decides the outcome)"
    return None


def _plan(bound: dict, backend: Backend) -> Launch | HandBack:
    """A no-memset launch for this call by ``backend``, or the reason there is none."""
    bpreshuffle = bound.get("bpreshuffle", True)
    bpreshuffle = True if bpreshuffle is None else bool(bpreshuffle)
    plan = backend.plan(bound["A"], bound["B"], bound["out"], bound["A_scale"], bound["B_scale"],
                        bound.get("splitK"), bound.get("kernelName"), bpreshuffle)
    return plan if type(plan) is HandBack else Launch(backend, plan)


def check(device) -> CheckResult:
    """``aiter-patches verify``: out_zeroed=True into zeros equals AITER's memset + GEMM, bit for bit."""
    import torch

    from ... import registry
    from .. import checks
    from ...aiter_contract import SCALE_BLOCK
    from ...reference.blockscale_gemm import shuffle_weight_16x16

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
        if checks.provided().fast_paths_required:
            return CheckResult("bitwise", False, f"fast path not taken ({why})")
        return CheckResult("bitwise", True, f"every call goes to AITER unchanged here: no fast path ({why})")
    out_o = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
    with registry.suspended():
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
    kernel_module="aiter_patches.kernels.hip_blockscale_asm",
    relies_on=relied_on.GEMM_OUT_ZEROED,
    order=50,
    check=check,
)
