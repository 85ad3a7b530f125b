"""Launch AITER's own block-scale fp8 GEMM code object (`.co`) without AITER's memset.

AITER's C++ launcher (`asm_a8w8_blockscale_bpreshuffle.cu`) zeroes `out` with
`hipMemsetAsync` before every split-K launch, because the kernel's splits add into
`out` atomically. A caller that already holds a zeroed `out` pays for that memset
anyway. This module launches the very same kernel through the HIP runtime that torch
has loaded (ctypes: `hipModuleLoad`, `hipModuleGetFunction`, `hipModuleLaunchKernel`
with a packed argument buffer) and does NOT zero `out`: with split > 1 the caller
must hand in zeros; with split 1 the kernel overwrites `out`.

It mirrors AITER's launcher step by step, in pure functions testable on any CPU:
the kernel list (`fp8gemm_bf16_blockscale.csv`), the tile/split choice, the split
alignment check, the 16-byte-slot argument struct and the grid. Only `AsmLauncher`
and `launch_planned` touch the GPU; they need ROCm on gfx942/gfx950 and an
AITER tree with `hsa/<gfx>/fp8gemm_blockscale/`. They cannot run on the CUDA/CPU
machines this project is developed on: only the pure parts are tested here.

The asm kernel reads A_scale as raw K-major memory (`ptr[kb * M + m]`), whatever
the tensor's strides say, exactly as AITER's launcher passes it.

A packed argument buffer is trusted blindly by the GPU, so before a `.co` is launched its
own metadata (the `NT_AMDGPU_METADATA` note, read by `code_object`) must describe the
layout `KERNEL_ARGS` packs: `code_object_reason` compares them once per file per process,
and a file that differs is never loaded (the patch hands such calls back to AITER).
"""

from __future__ import annotations

import csv
import ctypes
import ctypes.util
import functools
import io
import logging
import math
import os
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Mapping, NamedTuple

import torch

from .. import aiter_contract as contract
from ..aiter_contract import aligned_split  # AITER's split rule
from ..core import events
from ..reasons import with_values
from . import code_object

log = logging.getLogger(__name__)

SUPPORTED_GFX = ("gfx942", "gfx950")
KERNEL_DIR = "fp8gemm_blockscale"
KERNEL_CSV = "fp8gemm_bf16_blockscale.csv"
TILE_K = SCALE_BLOCK_N = SCALE_BLOCK_K = contract.SCALE_BLOCK
BLOCK_THREADS = 256
WAVEFRONT_SIZE = 64
ARG_SLOT = 16  # AITER's KernelArgs puts every field alone in a 16-byte slot, the rest of the slot zero


def _kernel_args(pointers: tuple[str, ...], uint32s: tuple[str, ...]) -> tuple[code_object.KernelArg, ...]:
    fields = [(n, 8, "global_buffer") for n in pointers] + [(n, 4, "by_value") for n in uint32s]
    return tuple(code_object.KernelArg(n, ARG_SLOT * i, size, kind) for i, (n, size, kind) in enumerate(fields))


# The argument buffer this module packs, under the names the code objects' metadata gives the fields:
# out, A, B, A_scale, B_scale, bias; then M, N, K, the row strides of A and B (elements) and of out
# (bytes), the split count, and the scale grid (M, N/128, K/128). The packing and the check of each
# `.co` both read this table.
KERNEL_ARGS = _kernel_args(("C", "A", "B", "SA", "SB", "BIAS"),
                           ("M", "Ndim", "K", "PA", "PB", "PC", "KS", "scale_m", "scale_n", "scale_k"))
ARGS_SIZE = ARG_SLOT * len(KERNEL_ARGS)
LAUNCH_LAYOUT = code_object.LaunchLayout(KERNEL_ARGS, ARGS_SIZE, WAVEFRONT_SIZE, (BLOCK_THREADS, 1, 1))
_STRUCT_FORMAT = {"global_buffer": "<Q", "by_value": "<I"}
_ARG_NAMES = frozenset(a.name for a in KERNEL_ARGS)

HIP_LAUNCH_PARAM_BUFFER_POINTER = 0x01
HIP_LAUNCH_PARAM_BUFFER_SIZE = 0x02
HIP_LAUNCH_PARAM_END = 0x03


@dataclass(frozen=True)
class AsmKernel:
    """One row of AITER's kernel list."""

    tile_m: int
    tile_n: int
    splitK: int  # 1: the kernel supports split-K (and AITER zeroes out before a split launch)
    bpreshuffle: int
    knl_name: str
    co_name: str


def kernel_dir(aiter_root: str, gfx: str) -> str:
    return os.path.join(aiter_root, "hsa", gfx, KERNEL_DIR)


def aiter_root_of(aiter_module) -> str | None:
    """The folder holding the imported AITER's `hsa/` (its AITER_META_DIR), or None.

    AITER keeps its code objects outside its Python package: `<checkout>/hsa` in a develop
    install, `<site-packages>/aiter_meta/hsa` in a wheel. `aiter.jit.core` settles which at
    import (honouring `AITER_META_DIR`) and publishes `AITER_ASM_DIR = <root>/hsa/`; that is
    used when present. Otherwise the first of those two places (then the package itself) that
    has an `hsa/` folder; otherwise the checkout's, so that a reason names a real path.
    """
    asm_dir = getattr(sys.modules.get("aiter.jit.core"), "AITER_ASM_DIR", None)
    return _aiter_root_from(asm_dir if isinstance(asm_dir, str) else None, getattr(aiter_module, "__file__", None))


@functools.lru_cache(maxsize=8)
def _aiter_root_from(asm_dir: str | None, package_file: str | None) -> str | None:
    if asm_dir:
        return os.path.dirname(os.path.normpath(asm_dir))
    if not package_file:
        return None
    package = os.path.dirname(os.path.abspath(package_file))
    candidates = (os.path.dirname(package), os.path.join(os.path.dirname(package), "aiter_meta"), package)
    return next((c for c in candidates if os.path.isdir(os.path.join(c, "hsa"))), candidates[0])


def parse_kernel_csv(text: str) -> list[AsmKernel]:
    """Rows of `fp8gemm_bf16_blockscale.csv` in file order; blank and comment lines skipped."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(("#", "//", ";"))]
    rows = []
    for rec in csv.DictReader(io.StringIO("\n".join(lines))):
        rows.append(AsmKernel(
            tile_m=int(rec["tile_m"]), tile_n=int(rec["tile_n"]), splitK=int(rec["splitK"]),
            bpreshuffle=int(rec["bpreshuffle"]), knl_name=rec["knl_name"].strip(), co_name=rec["co_name"].strip(),
        ))
    return rows


def load_kernel_list(aiter_root: str, gfx: str) -> list[AsmKernel]:
    return list(_kernel_list(aiter_root, gfx))


@functools.lru_cache(maxsize=16)
def _kernel_list(aiter_root: str, gfx: str) -> tuple[AsmKernel, ...]:
    """Read once per process: the launch path asks on every GEMM call."""
    with open(os.path.join(kernel_dir(aiter_root, gfx), KERNEL_CSV), encoding="utf-8-sig") as f:
        return tuple(parse_kernel_csv(f.read()))


def _heuristic(M: int, N: int, kernels: list[AsmKernel], cu_num: int, split: int, bpreshuffle: bool) -> AsmKernel:
    """AITER's `get_heuristic_fp8_kernel` for one split count.

    AITER first sets `k_split = k_split.value_or(0) ?: 1`, so its "try splits 1..16"
    branch is dead: only the given split (1 when none) is ever evaluated. The fewest
    rounds of workgroups over the CUs wins; within a round, fewer idle CUs or a
    better `tile_m*tile_n/(tile_m+tile_n)` (integer division) replaces the pick.
    AITER walks an unordered_map, whose order is the C++ library's; this walks the
    CSV order, which can differ only where that comparison is not transitive.
    """
    best, best_round, best_empty, best_effi = None, 0xFFFFFFFF, cu_num, 1.0
    for cfg in kernels:
        if cfg.bpreshuffle != int(bpreshuffle) or cfg.splitK < 1 or N % cfg.tile_n:
            continue
        tg = math.ceil(M / cfg.tile_m) * math.ceil(N / cfg.tile_n) * split
        rnd = math.ceil(tg / cu_num)
        effi = float(cfg.tile_m * cfg.tile_n // (cfg.tile_m + cfg.tile_n))
        empty = rnd * cu_num - tg
        if rnd < best_round or (rnd == best_round and (best_empty > empty or effi > best_effi)):
            best, best_round, best_empty, best_effi = cfg, rnd, empty, effi
    if best is None:
        raise ValueError(f"no asm kernel fits N={N} (bpreshuffle={bpreshuffle})")
    return best


def select_kernel(M: int, N: int, K: int, kernels: list[AsmKernel], cu_num: int, splitK: int | None = None,
                  kernelName: str | None = None, bpreshuffle: bool = True) -> tuple[AsmKernel, int]:
    """(kernel, split) as AITER's launcher picks them, with its split checks.

    `splitK` None or negative means "not given": AITER then runs split 1. An explicit
    split that AITER's alignment would change raises ValueError, as AITER does.
    """
    explicit = splitK is not None and splitK >= 0
    split = (splitK or 1) if explicit else 1
    if kernelName:
        matches = [k for k in kernels if k.knl_name == kernelName]
        if not matches:
            raise ValueError(f"not find kernel {kernelName}")
        cfg = matches[0]
    else:
        cfg = _heuristic(M, N, kernels, cu_num, split, bpreshuffle)
    if cfg.splitK == 1 and split > 0:
        actual = aligned_split(K, split)
        if actual != split:
            if explicit:
                raise ValueError(f"Kdim alignment check failed for splitK! Kdim={K}, splitK={split}, "
                                 f"actual_ksplit={actual}")
            split = actual
        per = contract.k_tiles_per_split(K, split) * TILE_K
        if not (K % per == 0 or K // per == split - 1):
            raise ValueError(f"Kdim alignment check failed for splitK! Kdim={K}, splitK={split}")
    return cfg, split


def launch_grid(M: int, N: int, tile_m: int, tile_n: int, split: int) -> tuple[int, int, int]:
    """Workgroups: (N/tile_n * split, ceil(M/tile_m), 1); each has BLOCK_THREADS threads."""
    return (N // tile_n) * split, math.ceil(M / tile_m), 1


def pack_kernel_args(values: Mapping[str, int]) -> bytes:
    """AITER's packed `KernelArgs` from {argument name: value}: each field in its slot of `KERNEL_ARGS`, padding zeroed."""
    if values.keys() != _ARG_NAMES:
        raise ValueError(f"kernel arguments: missing {sorted(_ARG_NAMES - set(values))}, "
                         f"unknown {sorted(set(values) - _ARG_NAMES)}")
    return _ARGS_STRUCT.pack(*map(values.__getitem__, _ARG_ORDER))


def _args_struct() -> tuple[struct.Struct, tuple[str, ...]]:
    """One precompiled ``struct.Struct`` for the whole buffer (fields at their offsets, zero padding
    between and after) and the field order it packs: one C call per launch instead of one per field."""
    fmt, pos, order = "<", 0, []
    for a in sorted(KERNEL_ARGS, key=lambda a: a.offset):
        if a.offset < pos:
            raise ValueError(f"kernel argument {a.name} overlaps the one before it")
        code = _STRUCT_FORMAT[a.value_kind]
        fmt += (f"{a.offset - pos}x" if a.offset > pos else "") + code[1:]
        pos = a.offset + struct.calcsize(code)
        order.append(a.name)
    fmt += f"{ARGS_SIZE - pos}x" if ARGS_SIZE > pos else ""
    packer = struct.Struct(fmt)
    assert packer.size == ARGS_SIZE, (fmt, ARGS_SIZE)
    return packer, tuple(order)


_ARGS_STRUCT, _ARG_ORDER = _args_struct()


def kernel_args(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, A_scale: torch.Tensor,
                B_scale: torch.Tensor, bias: torch.Tensor, split: int) -> bytes:
    """The argument buffer AITER's launcher builds for these tensors (strides in elements; ldc in bytes)."""
    M, K = A.shape
    N = out.shape[1]
    return pack_kernel_args({
        "C": out.data_ptr(), "A": A.data_ptr(), "B": B.data_ptr(),
        "SA": A_scale.data_ptr(), "SB": B_scale.data_ptr(), "BIAS": bias.data_ptr(),
        "M": M, "Ndim": N, "K": K, "PA": A.stride(0), "PB": B.stride(0), "PC": out.stride(0) * out.element_size(),
        "KS": split, "scale_m": M, "scale_n": math.ceil(N / SCALE_BLOCK_N), "scale_k": math.ceil(K / SCALE_BLOCK_K),
    })


_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n))


def unsupported_reason(A, B, out, A_scale, B_scale) -> str | None:
    """Why these operands would reach the kernel in a layout its arguments cannot describe, or None.

    Metadata only. The kernel takes row strides for A, B and out (unit column strides), and reads
    both scale tensors as raw contiguous memory: A_scale as AITER's K-major M x K/128 values,
    B_scale as N/128 x K/128.
    """
    for name, t in (("A", A), ("B", B)):
        if t.dim() != 2 or t.dtype not in _FP8:
            return f"{name} is not a 2-D fp8 tensor ({t.dtype})"
        if t.stride(1) != 1:
            return f"{name} rows are not contiguous"
    if out.dim() != 2 or out.dtype != torch.bfloat16 or out.stride(1) != 1:
        return "out is not a bf16 [M, N] tensor with contiguous rows"
    # reasons name the rule broken, never the call's shapes (issue 35: they are counted per reason); those go
    # to DEBUG once per reason (reasons.with_values)
    M, K = A.shape
    N = out.shape[1]
    if out.shape[0] != M or tuple(B.shape) != (N, K):
        return with_values("shapes: A, B, out are not [M, K], [N, K], [M, N]", A=tuple(A.shape), B=tuple(B.shape),
                           out=tuple(out.shape))
    if N % SCALE_BLOCK_N or K % TILE_K:
        return with_values("N and K must be multiples of 128", N=N, K=K)
    if not B.is_contiguous():
        return "B is not contiguous (the pre-shuffled layout is read as one block)"
    for name, t, n, size in (("A_scale", A_scale, M * (K // TILE_K), "M x K/128"),
                             ("B_scale", B_scale, (N // SCALE_BLOCK_N) * (K // SCALE_BLOCK_K), "N/128 x K/128")):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n:
            return with_values(f"{name} is not a contiguous fp32 tensor of {size} values", values=t.numel(),
                               expected=n, dtype=t.dtype)
    for name, t in (("B", B), ("out", out), ("A_scale", A_scale), ("B_scale", B_scale)):
        if t.device != A.device:
            return with_values(f"{name} is not on A's device", device=t.device, A=A.device)
    return None


def gfx_of(device: torch.device) -> str | None:
    props = torch.cuda.get_device_properties(device)
    name = getattr(props, "gcnArchName", "") or ""
    return name.split(":")[0] or None


def available(device, aiter_root: str | None) -> str | None:
    """Why the asm kernel cannot be launched here, or None."""
    if torch.version.hip is None:
        return "torch is not a ROCm build"
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"{device.type} device is not a ROCm GPU"  # the type, not the index: a category
    gfx = gfx_of(device)
    if gfx not in SUPPORTED_GFX:
        return f"GPU arch {gfx} is not one of {SUPPORTED_GFX}"
    if not aiter_root:
        return "no AITER tree given"
    return _tree_reason(aiter_root, gfx)


@functools.lru_cache(maxsize=16)
def _tree_reason(aiter_root: str, gfx: str) -> str | None:
    """The file-system part of :func:`available`, checked once per process (it runs on every GEMM call)."""
    path = os.path.join(kernel_dir(aiter_root, gfx), KERNEL_CSV)
    if not os.path.isfile(path):
        return f"no kernel list at {path}"
    missing = [k.co_name for k in load_kernel_list(aiter_root, gfx)
               if not os.path.isfile(os.path.join(kernel_dir(aiter_root, gfx), k.co_name))]
    if missing:
        return f"code objects missing: {', '.join(missing)}"
    if _find_hip_library() is None:
        return "libamdhip64 not found"
    return None


@functools.lru_cache(maxsize=256)  # on every launch: two path joins
def code_object_path(aiter_root: str, gfx: str, cfg: AsmKernel) -> str:
    return os.path.join(kernel_dir(aiter_root, gfx), cfg.co_name)


def code_object_reason(aiter_root: str, gfx: str, cfg: AsmKernel) -> str | None:
    """Why `cfg`'s `.co` must not be launched with this module's argument buffer, or None.

    The file's metadata is read and compared with `LAUNCH_LAYOUT` once per file per process;
    later calls are one dict lookup.
    """
    return _checked_code_object(code_object_path(aiter_root, gfx, cfg), cfg.knl_name, gfx)


# Caps of this module's maps (issue 35: bounded over a server's life). Their keys come from AITER's kernel
# lists (a dozen files per arch), the devices and the GEMMs' N, so a server stays far below them; past a cap
# a file is checked again per call, a bias made per call, a code object not loaded (its calls go to AITER).
MAX_CODE_OBJECTS = 256
MAX_ZERO_BIASES = 1024

_co_checks: dict[tuple[str, str, str], str | None] = {}  # MAX_CODE_OBJECTS at most
_co_lock = threading.Lock()


def _checked_code_object(path: str, knl_name: str, gfx: str) -> str | None:
    key = (path, knl_name, gfx)
    try:
        return _co_checks[key]
    except KeyError:
        pass
    with _co_lock:
        if key in _co_checks:
            return _co_checks[key]
        keep = len(_co_checks) < MAX_CODE_OBJECTS
        reason = _check_code_object(path, knl_name, gfx, warn=keep)  # past the cap: no WARNING per call
        if keep:
            _co_checks[key] = reason
        return reason


def _check_code_object(path: str, knl_name: str, gfx: str, warn: bool = True) -> str | None:
    try:
        reason = code_object.layout_mismatch(code_object.read_code_object(path), knl_name, gfx, LAUNCH_LAYOUT)
    except code_object.CodeObjectError as exc:
        reason = str(exc)
    if reason is None:
        return None
    if warn:
        log.warning("aiter_patches: AITER's code object %s does not match this launcher's arguments and will not "
                    "be launched (its calls stay with AITER): %s", path, reason)
    return f"{os.path.basename(path)}: {reason}"


@functools.lru_cache(maxsize=1)
def _find_hip_library() -> str | None:
    """The libamdhip64 torch already mapped into this process, else the loader's choice."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if "libamdhip64.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return ctypes.util.find_library("amdhip64")


class _LoadFailed(str):
    """Why a code object's load failed, kept in place of its function."""


class AsmLauncher:
    """ctypes over the HIP runtime: loads each `.co` once per device, launches it on torch's current stream."""

    def __init__(self) -> None:
        path = _find_hip_library()
        if path is None:
            raise RuntimeError("libamdhip64 not found")
        hip = ctypes.CDLL(path)
        hip.hipModuleLoad.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        hip.hipModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        hip.hipModuleLaunchKernel.argtypes = [
            ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ]
        hip.hipGetErrorString.restype = ctypes.c_char_p
        self._hip = hip
        self._functions: dict[tuple[int, str, str], ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        self._tls = threading.local()  # per thread: {argument bytes: (buffer, size, HIP's extra array)}

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed: {self._hip.hipGetErrorString(err).decode()} ({err})")

    def function(self, device_index: int, co_path: str, knl_name: str, gfx: str) -> ctypes.c_void_p:
        """The kernel, loaded on first use; a code object whose metadata does not match `KERNEL_ARGS` is refused.

        A load that failed is not tried again in this process: every later call raises the same error
        at once (the caller hands the call to AITER), instead of a driver call and a file read per call."""
        key = (device_index, co_path, knl_name)
        with self._lock:
            fn = self._functions.get(key)
            if type(fn) is _LoadFailed:
                raise RuntimeError(f"{fn} (failed before in this process: not tried again)")
            if fn is None and len(self._functions) >= MAX_CODE_OBJECTS:  # a module is never unloaded: not one more
                raise RuntimeError(f"not loading {co_path}: {MAX_CODE_OBJECTS} code objects loaded already")
            if fn is None:
                try:
                    reason = _checked_code_object(co_path, knl_name, gfx)
                    if reason is not None:
                        raise RuntimeError(f"not loading {co_path}: {reason}")
                    module, fn = ctypes.c_void_p(), ctypes.c_void_p()
                    with torch.cuda.device(device_index):
                        self._check(self._hip.hipModuleLoad(ctypes.byref(module), co_path.encode()), "hipModuleLoad")
                        self._check(self._hip.hipModuleGetFunction(ctypes.byref(fn), module, knl_name.encode()),
                                    "hipModuleGetFunction")
                except RuntimeError as exc:
                    self._functions[key] = _LoadFailed(exc)
                    raise
                self._functions[key] = fn
            return fn

    def launch(self, fn: ctypes.c_void_p, grid: tuple[int, int, int], args: bytes, stream: int) -> None:
        """Launch ``fn`` with the packed ``args``. The argument buffer and HIP's ``extra`` array are kept
        per thread and argument size (HIP copies the arguments during the call, as it must for the
        fresh buffers made per call before, which were freed on return): a call copies ``args`` in."""
        n = len(args)
        tls = self._tls
        bufs = getattr(tls, "bufs", None)
        if bufs is None:
            bufs = tls.bufs = {}
        got = bufs.get(n)
        if got is None:
            arg_buf = ctypes.create_string_buffer(n)
            arg_size = ctypes.c_size_t(n)
            extra = (ctypes.c_void_p * 5)(
                HIP_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(arg_buf),
                HIP_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(arg_size),
                HIP_LAUNCH_PARAM_END,
            )
            got = bufs[n] = (arg_buf, arg_size, extra)
        ctypes.memmove(got[0], args, n)
        block = LAUNCH_LAYOUT.block
        err = self._hip.hipModuleLaunchKernel(fn, grid[0], grid[1], grid[2], block[0], block[1], block[2], 0,
                                              ctypes.c_void_p(stream), None, got[2])
        self._check(err, "hipModuleLaunchKernel")


_launcher: AsmLauncher | None = None
_zero_bias: dict[tuple[int, int], torch.Tensor] = {}  # (device index, N) -> zeros [1, N]; MAX_ZERO_BIASES at most


def _zero_bias_of(device: torch.device, N: int) -> torch.Tensor:
    """The kernel's zero bias row for ``N`` outputs on ``device``, kept per (device, N)."""
    key = (device.index, N)
    bias = _zero_bias.get(key)
    if bias is None:
        bias = torch.zeros(1, N, dtype=torch.float32, device=device)
        # made under capture, its zeros would exist only once the graph replays
        if len(_zero_bias) < MAX_ZERO_BIASES and not torch.cuda.is_current_stream_capturing():
            _zero_bias[key] = bias
    return bias


def _renew_locks_after_fork() -> None:
    """``FORK_RENEW``: fresh locks in a forked child (issue 31): a thread of the parent may have held the code
    object check's or the launcher's lock, and that thread is gone. Never blocks."""
    global _co_lock
    _co_lock = threading.Lock()
    if _launcher is not None:
        _launcher._lock = threading.Lock()


events.subscribe(events.FORK_RENEW, _renew_locks_after_fork)


def _get_launcher() -> AsmLauncher:
    global _launcher
    if _launcher is None:
        _launcher = AsmLauncher()
    return _launcher


class LaunchPlan(NamedTuple):
    cfg: AsmKernel
    split: int
    gfx: str


def plan_launch(A: torch.Tensor, B: torch.Tensor, *, aiter_root: str, splitK: int | None = None,
                kernelName: str | None = None, bpreshuffle: bool = True, cu_num: int | None = None) -> LaunchPlan:
    """The kernel and split AITER's launcher would pick for these operands (its checks raise ValueError).

    The caller has checked `available` and `unsupported_reason`; the plan is then launched with
    `launch_planned`, so a call is checked and planned once.
    """
    gfx = gfx_of(A.device)
    kernels = load_kernel_list(aiter_root, gfx)
    cu_num = cu_num or torch.cuda.get_device_properties(A.device).multi_processor_count
    cfg, split = select_kernel(A.shape[0], B.shape[0], A.shape[1], kernels, cu_num, splitK, kernelName, bpreshuffle)
    return LaunchPlan(cfg, split, gfx)


def gemm_a8w8_blockscale_asm(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, A_scale: torch.Tensor,
                             B_scale: torch.Tensor, *, aiter_root: str, bias: torch.Tensor | None = None,
                             splitK: int | None = None, kernelName: str | None = None, bpreshuffle: bool = True,
                             cu_num: int | None = None) -> torch.Tensor:
    """AITER's asm block-scale GEMM, minus the memset: `out` must be zeros when the chosen split is > 1.

    ROCm gfx942/gfx950 only; check `available(A.device, aiter_root)` first.
    """
    reason = available(A.device, aiter_root)
    if reason is not None:
        raise RuntimeError(reason)
    bad = unsupported_reason(A, B, out, A_scale, B_scale)
    if bad is not None:
        raise ValueError(bad)
    plan = plan_launch(A, B, aiter_root=aiter_root, splitK=splitK, kernelName=kernelName, bpreshuffle=bpreshuffle,
                       cu_num=cu_num)
    return launch_planned(A, B, out, A_scale, B_scale, plan, aiter_root=aiter_root, bias=bias)


def launch_planned(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, A_scale: torch.Tensor,
                   B_scale: torch.Tensor, plan: LaunchPlan, *, aiter_root: str,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Launch a `plan_launch` plan on the current stream, with no memset."""
    cfg, split, gfx = plan
    M = A.shape[0]
    N = out.shape[1]
    if bias is None:
        bias = _zero_bias_of(A.device, N)
    launcher = _get_launcher()
    fn = launcher.function(A.device.index, code_object_path(aiter_root, gfx, cfg), cfg.knl_name, gfx)
    args = kernel_args(A, B, out, A_scale, B_scale, bias, split)
    launcher.launch(fn, launch_grid(M, N, cfg.tile_m, cfg.tile_n, split), args,
                    torch.cuda.current_stream(A.device).cuda_stream)
    return out
