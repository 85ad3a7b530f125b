"""Compile captured variants for an AMD arch: amdgcn and hsaco, optionally into a Triton cache.

Why: the source, attributes and options are rebuilt from the variant's
``specialization_data`` exactly as ``JITFunction.preload`` rebuilds them, then
``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("hip", arch, 64),
options=make_backend(target).parse_options(options).__dict__)`` runs the same pipeline and
computes the same cache key as the compile ``JITFunction.run`` would start on a ROCm device
(tests/amd/test_precompile.py proves the key). Compiles run in a pool of spawned processes
(LLVM is single-threaded per compile); each worker points Triton's cache at ``cache_dir``,
or at a throw-away directory so that every report is a fresh compile.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from .resources import Resources, parse_amdgcn


@dataclass
class Outcome:
    ident: tuple
    arch: str
    ok: bool
    seconds: float
    resources: Resources | None = None
    error: str = ""


def _decode(fn, spec: dict):
    """signature, constexprs, attrs, options of a ``specialization_data`` (preload's decoding)."""
    import triton.language as tl

    def tup(x):
        return tuple(tup(v) for v in x) if isinstance(x, list) else x

    def const(value):
        if tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict):
            if "constexpr" in value:
                return tl.constexpr(tup(value["constexpr"]))
            if "jit_function" in value:  # Triton >= 3.7 only: older ones have no registry (nor such constexprs)
                from triton.runtime.jit import _triton_jit_function_registry

                return _triton_jit_function_registry[value["jit_function"]]
        return tup(value)

    constexprs = {tuple(k): const(v) for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    signature = {k: tup(v) for k, v in spec["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    return signature, constexprs, attrs, options


def compile_variant(module: str, qualname: str, spec_json: str, arch: str) -> dict:
    """Compile one variant in this process; a dict (picklable) with the resources or the error."""
    t0 = time.perf_counter()
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend

        fn = getattr(importlib.import_module(module), qualname)
        spec = json.loads(spec_json)
        signature, constexprs, attrs, options = _decode(fn, spec)
        target = GPUTarget("hip", arch, 64)
        opts = make_backend(target).parse_options(options)
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=opts.__dict__)
        res = parse_amdgcn(kernel.asm["amdgcn"], shared=kernel.metadata.shared, num_warps=kernel.metadata.num_warps,
                           arch=arch, llir=kernel.asm.get("llir", ""))
        return {"ok": True, "seconds": time.perf_counter() - t0, "resources": res, "hash": kernel.hash}
    except Exception as exc:  # a compile failure is a result, reported per variant
        cause = exc.__cause__ or exc
        msg = [ln.strip() for ln in f"{type(cause).__name__}: {cause}".splitlines() if ln.strip()]
        return {"ok": False, "seconds": time.perf_counter() - t0, "error": " | ".join(msg)[-400:]}


def _worker_init(cache_dir: str) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    from triton import knobs

    knobs.cache.dir = cache_dir


def compile_all(variants, *, jobs: int = 2, cache_dir: str | None = None, progress=None) -> list[Outcome]:
    """Compile every variant (each for its own arch); results in the order given."""
    variants = list(variants)
    with tempfile.TemporaryDirectory(prefix="aiter-patches-compile-") as scratch:
        where = os.path.abspath(cache_dir) if cache_dir else scratch
        os.makedirs(where, exist_ok=True)
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        out: list[Outcome] = []
        with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx, initializer=_worker_init,
                                 initargs=(where,)) as pool:
            futures = [pool.submit(compile_variant, v.module, v.qualname, v.specialization_data, v.arch)
                       for v in variants]
            for v, fut in zip(variants, futures):
                r = fut.result()
                o = Outcome(v.ident, v.arch, r["ok"], r["seconds"], r.get("resources"), r.get("error", ""))
                out.append(o)
                if progress is not None:
                    progress(v, o)
        return out
