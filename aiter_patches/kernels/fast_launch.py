"""Launch a Triton kernel through its compiled launcher, skipping Triton's per-call binder.

Why: ``kernel[grid](...)`` re-derives on every call what a decode step repeats unchanged: it
binds the signature, specializes every argument, builds and hashes the cache key, parses the
options, and its launcher asks the driver about every pointer. For the 52-parameter sort kernel
that is most of the host time of a call (issue 15), paid once per MoE layer per eager step.

How: :func:`launch` takes the same arguments as ``kernel[grid](...)``. The first call of each
key goes through Triton unchanged; the ``CompiledKernel`` it returns is kept under a key that is
at least as fine as Triton's own: the device, the options and the knobs Triton folds into them,
the type of every runtime argument, the value of every constexpr and of every int/bool/float/None
argument (finer than Triton's ``== 1`` / ``% 16`` / i32-i64-u64 classes: a decode step repeats
its ints, so the extra keys are few), and for every tensor its dtype and 16-byte pointer
alignment, plus whatever the backend adds to a tensor's specialization (AMD's buffer-ops
range), asked through the API the installed Triton's binder itself calls: Triton 3.4/3.5 ask
``backend.get_arg_specialization(arg, "tensor", align=...)``, later ones ask
``get_tensor_specialization`` unless the backend says ``supports_native_tensor_specialization``.
Which one is read once from ``triton/runtime/jit.py``; a backend that offers neither API the
binder uses (or overrides the int specialization in a way not checked here) gets ordinary
launches, logged once and counted, never an error. A later call with the same key calls that kernel's launcher directly, as
Triton itself would, with the pointers already unpacked.

It falls back to the ordinary launch (same arguments) whenever it cannot prove it is doing what
Triton would: the interpreter (no compiled kernel), torch.compile tracing (Dynamo understands
``kernel[grid]``), launch hooks or a stage-inspection hook set (profilers see Triton's own
launch), pre-run hooks, an argument type outside the list above, a callable grid, changed
globals, and an installed Triton whose ``JITFunction.run`` does not launch with the convention
checked here (read from its source once: ``kernel.run(grid_0, grid_1, grid_2, stream,
kernel.function, kernel.packed_metadata, launch_metadata, enter_hook, exit_hook,
*bound_args.values())``; the check also needs ``triton.knobs``, so Triton 3.4 or later, and
has been run against Triton 3.5.1 and 3.9; Triton 3.3 and older get ordinary launches).
``AITER_PATCHES_FAST_LAUNCH=0`` turns
it off; ``=verify`` also asks Triton, on every direct launch, which kernel it would have run and
raises :class:`DispatchMismatch` if it is another one (tests and the GPU check use it).

The cache holds compiled kernels and keys made of Python scalars and dtypes: never a tensor,
so nothing created during a CUDA-graph capture outlives it, and it never syncs the device. A
launch inside a capture is recorded like Triton's (same launcher, same stream).
"""

from __future__ import annotations

import inspect
import logging
import operator
import os
import re
import threading
from typing import Any

import torch

from .. import env_flags

MAX_VARIANTS = 4096  # keys per kernel and device (ints are keyed by value); past it: ordinary launches

# The kwargs Triton's run() folds into the options, and where it reads them (checked against
# the installed source: a Triton that adds another one turns the fast path off).
_KNOWN_RUN_KWARGS = {"debug", "instrumentation_mode", "fpsan_homomorphic_casts"}


class DispatchMismatch(AssertionError):
    """Verify mode: the cached kernel is not the one Triton would have launched."""


_lock = threading.Lock()
_kernels: dict[int, tuple[Any, "_Kernel | None"]] = {}  # id(fn) -> (fn, state); None: never direct
_status: dict[str, Any] = {"available": None, "reason": "", "spec_api": None}
_backend_specs: dict[type, tuple[bool, Any, str]] = {}  # backend class -> (native, spec maker, refusal)
_log = logging.getLogger(__name__)
_counts = {"direct": 0, "ordinary": 0, "compiled_variants": 0, "backend_refused": 0}
_knobs = _driver = None  # triton.knobs and triton.runtime.driver, bound at the first kernel seen


_mode_override: str | None = None
_mode_cached: str | None = None


def _read_mode() -> str:
    v = os.environ.get("AITER_PATCHES_FAST_LAUNCH", "1")
    if env_flags.is_false(v):
        return "off"
    return "verify" if v.strip().lower() == "verify" else "on"


def mode() -> str:
    """"on", "off" or "verify": ``AITER_PATCHES_FAST_LAUNCH`` as read at the first launch, or :func:`set_mode`."""
    global _mode_cached
    if _mode_override is not None:
        return _mode_override
    if _mode_cached is None:
        _mode_cached = _read_mode()
    return _mode_cached


def set_mode(value: str | None) -> None:
    """Force a mode ("on", "off", "verify"), or None: re-read the environment at the next launch."""
    global _mode_override, _mode_cached
    if value not in (None, "on", "off", "verify"):
        raise ValueError(f"fast launch mode {value!r}: use 'on', 'off', 'verify' or None")
    _mode_override, _mode_cached = value, None


def _check_triton() -> str | None:
    """None when the installed Triton launches with the convention this module replays, else why not."""
    try:
        from triton import knobs  # noqa: F401  (Triton >= 3.4)
        from triton.runtime.jit import JITFunction
        from triton.runtime import driver  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the installed Triton
        return f"triton has no knobs/JITFunction/driver ({type(exc).__name__}: {exc})"
    try:
        src = inspect.getsource(JITFunction.run)
    except (OSError, TypeError) as exc:  # pragma: no cover
        return f"cannot read JITFunction.run's source ({exc})"
    flat = re.sub(r"\s+", "", src)
    needed = (
        "bound_args,specialization,options=binder(*args,**kwargs)",
        "kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,launch_metadata,"
        "knobs.runtime.launch_enter_hook,knobs.runtime.launch_exit_hook,*bound_args.values())",
        "launch_metadata=kernel.launch_metadata(grid,stream,*bound_args.values())",
        "returnkernel",
    )
    for piece in needed:
        if piece not in flat:
            return f"JITFunction.run does not contain {piece!r}: launch convention unknown"
    extra = set(re.findall(r'kwargs\["(\w+)"\]=', flat)) - _KNOWN_RUN_KWARGS
    if extra:
        return f"JITFunction.run sets unknown option(s) {sorted(extra)}"
    import triton.runtime.jit as jit_module

    try:
        jit_src = re.sub(r"\s+", "", inspect.getsource(jit_module))
    except (OSError, TypeError) as exc:  # pragma: no cover
        return f"cannot read triton/runtime/jit.py ({exc})"
    _status["spec_api"] = _spec_api(jit_src)
    if _status["spec_api"] is None:
        return "the binder in triton/runtime/jit.py asks the backend for specializations in an unknown way"
    return None


def _spec_api(jit_src: str) -> str | None:
    """Which backend API the installed Triton's binder calls for a tensor's specialization."""
    if "create_specialize_impl(backend.get_arg_specialization)" in jit_src:
        return "arg"  # Triton 3.4/3.5: one Python hook for ints and tensors
    if "specialize_impl=native_specialize_impl" in jit_src:
        return "tensor"  # later: native, or get_tensor_specialization when the backend is not native
    return None


# Triton 3.5's HIPBackend override: the base result, plus letters for tensors only (so an int's
# specialization stays a function of its value, which the key holds).
_TENSOR_ONLY_OVERRIDE = re.compile(
    r'@staticmethoddefget_arg_specialization\(arg,ty,\*\*kwargs\):ret=BaseBackend\.get_arg_specialization'
    r'\(arg,ty,\*\*kwargs\)if[^:]*ty=="tensor"[^:]*:ret\+="\w+"returnret')


def _backend_spec(backend) -> tuple[bool, Any, str]:
    """(native, spec, refusal) for this backend object, decided once per backend class:
    native: the key's dtype + 16-byte alignment is the whole tensor specialization; else
    ``spec(tensor, align=True)`` returns what the binder adds (bound to this object); refusal:
    why neither is provable."""
    cls = type(backend)
    got = _backend_specs.get(cls)
    if got is None:
        got = _backend_specs[cls] = _decide_backend_spec(backend)
        if got[2]:
            _log.warning("aiter_patches fast launch: ordinary Triton launches on %s: %s", cls.__name__, got[2])
    native, make, why = got
    return native, (make(backend) if make is not None else None), why


def _decide_backend_spec(backend) -> tuple[bool, Any, str]:
    cls = type(backend)
    api = _status["spec_api"]
    native, spec, why = False, None, ""
    if api == "tensor":
        flag = getattr(backend, "supports_native_tensor_specialization", None)
        if flag is True:
            native = True
        elif flag is False and callable(getattr(backend, "get_tensor_specialization", None)):
            spec = operator.attrgetter("get_tensor_specialization")
        else:
            why = (f"{cls.__name__} has neither supports_native_tensor_specialization nor "
                   "get_tensor_specialization, which this Triton's binder uses")
    elif api == "arg":
        from triton.backends.compiler import BaseBackend

        impl = inspect.getattr_static(cls, "get_arg_specialization", None)
        impl = getattr(impl, "__func__", impl)
        base = getattr(inspect.getattr_static(BaseBackend, "get_arg_specialization", None), "__func__", None)
        try:
            base_src = re.sub(r"\s+", "", inspect.getsource(base)) if base is not None else ""
        except (OSError, TypeError):  # pragma: no cover
            base_src = ""
        base_ok = ('ifty=="int"andarg%16==0andkwargs.get("align",False):return"D"' in base_src
                   and 'ifty=="tensor"andarg.data_ptr()%16==0andkwargs.get("align",False):return"D"'
                   in base_src and base_src.endswith('return""'))
        if not base_ok:
            why = "BaseBackend.get_arg_specialization is not the 16-byte-alignment rule checked here"
        elif impl is base:
            native = True  # alignment only: already in the key
        elif impl is not None and _override_is_tensor_only(impl):
            spec = _tensor_arg_spec
        else:
            why = f"{cls.__name__}.get_arg_specialization is missing or overrides more than tensors"
    else:
        why = "the installed Triton's specialization API is unknown"
    return native, spec, why


def _tensor_arg_spec(backend):
    f = backend.get_arg_specialization
    return lambda t, align=True: f(t, "tensor", align=align)


def _override_is_tensor_only(impl) -> bool:
    try:
        lines = inspect.getsource(impl).splitlines()
    except (OSError, TypeError):
        return False
    code = "".join(ln.split("#", 1)[0] for ln in lines)
    return _TENSOR_ONLY_OVERRIDE.fullmatch(re.sub(r"\s+", "", code)) is not None


def available() -> tuple[bool, str]:
    """Whether direct launches can be used with the installed Triton, and why not."""
    if _status["available"] is None:
        reason = _check_triton()
        _status["available"], _status["reason"] = reason is None, reason or ""
    return _status["available"], _status["reason"]


def stats() -> dict[str, Any]:
    ok, why = available()
    return {**_counts, "available": ok, "reason": why, "mode": mode(),
            "kernels": sum(1 for _, k in _kernels.values() if k is not None)}


def clear() -> None:
    """Forget every kept kernel (tests; a server never needs it)."""
    with _lock:
        _kernels.clear()
        for k in _counts:
            _counts[k] = 0


class _Kernel:
    """Per JITFunction: the argument packer, which positions are constexpr, kept kernels per device,
    and per pattern of runtime argument types, where the tensors are."""

    __slots__ = ("fn", "pack", "runtime", "get_runtime", "devices", "knob_reads", "layouts")

    def __init__(self, fn):
        self.fn = fn
        params = fn.params
        names = [p.name for p in params]
        self.runtime = tuple(i for i, p in enumerate(params) if not p.is_constexpr)
        self.get_runtime = _getter(self.runtime)
        self.pack = _make_packer(fn.signature, names)
        self.devices: dict[Any, tuple[dict, bool, Any]] = {}
        self.layouts: dict[tuple, "_Layout | None"] = {}
        src = re.sub(r"\s+", "", inspect.getsource(type(fn).run))
        self.knob_reads = tuple(k for k in ("instrumentation_mode", "fpsan_homomorphic_casts")
                                if f'kwargs["{k}"]' in src)

    def device_state(self, device):
        st = self.devices.get(device)
        if st is None:
            backend = self.fn.device_caches[device][3]
            native, spec, why = _backend_spec(backend)
            st = ({}, native, None if why else spec)
            self.devices[device] = st
        return st

    def layout(self, types: tuple) -> "_Layout | None":
        """Where the tensors are among the arguments for this pattern of runtime types, or None when
        some type is not one whose specialization the key reproduces."""
        lay = self.layouts.get(types, False)
        if lay is not False:
            return lay
        tensors, others = [], []
        ok = True
        for pos, t in zip(self.runtime, types):
            if issubclass(t, torch.Tensor):
                tensors.append(pos)
            elif t in (int, bool, float, type(None)):
                others.append(pos)  # keyed by value: at least as fine as Triton's ==1 / %16 / i32-i64-u64
            else:
                ok = False
        n = len(self.fn.params)
        others += [i for i in range(n) if i not in self.runtime]  # constexprs, by value as Triton keys them
        lay = _Layout(tuple(tensors), _getter(tuple(others))) if ok else None
        if len(self.layouts) < MAX_VARIANTS:
            self.layouts[types] = lay
        return lay


class _Layout:
    """For one pattern of runtime argument types: where the tensors are, the getter of the values
    keyed as they are, and ``unpack(values, launch_values, spec) -> (dtypes, alignment)``, generated
    straight-line for these positions, which also puts each CUDA tensor's pointer into
    ``launch_values`` (a CPU tensor stays a tensor: the launcher then refuses it, as Triton's does)."""

    __slots__ = ("tensor_pos", "get_others", "unpack")

    def __init__(self, tensor_pos, get_others):
        self.tensor_pos, self.get_others = tensor_pos, get_others
        lines = ["def unpack(values, lv, spec):"]
        for j, pos in enumerate(tensor_pos):
            lines += [f"    t{j} = values[{pos}]", f"    p{j} = t{j}.data_ptr()",
                      f"    if t{j}.is_cuda:", f"        lv[{pos}] = p{j}"]
        n = len(tensor_pos)
        dts = ", ".join(f"t{j}.dtype" for j in range(n))
        als = ", ".join(f"not p{j} & 15" for j in range(n))
        extra = ", ".join(f"spec(t{j}, align=True)" for j in range(n))
        lines += ["    if spec is None:", f"        return ({dts}{',' if n else ''}), ({als}{',' if n else ''})",
                  f"    return ({dts}{',' if n else ''} {extra}{',' if n else ''}), ({als}{',' if n else ''})"]
        ns: dict[str, Any] = {}
        exec("\n".join(lines) + "\n", ns)  # noqa: S102 - generated from integer positions only
        self.unpack = ns["unpack"]


def _getter(positions: tuple):
    """``f(list) -> tuple`` of those positions, at C speed."""
    if not positions:
        return lambda values: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda values: (values[i],)
    return operator.itemgetter(*positions)


def _make_packer(sig: inspect.Signature, names: list[str]):
    """``pack(*args, **kwargs) -> (all arguments in parameter order, options)``, bound by Python itself."""
    if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in sig.parameters.values()):
        raise TypeError("only plain parameters")
    ns: dict[str, Any] = {}
    args = []
    for name, p in sig.parameters.items():
        if p.default is inspect.Parameter.empty:
            args.append(name)
        else:
            ns[f"_d_{name}"] = p.default
            args.append(f"{name}=_d_{name}")
    body = (f"def pack({', '.join(args + ['**_opts'])}):\n"
            f"    return [{', '.join(names)}], _opts\n")
    exec(body, ns)  # noqa: S102 - generated from the kernel's own parameter names
    return ns["pack"]


def _kernel_state(fn) -> "_Kernel | None":
    entry = _kernels.get(id(fn))
    if entry is not None and entry[0] is fn:
        return entry[1]
    global _knobs, _driver
    from triton.runtime.jit import JITFunction

    state = None
    if isinstance(fn, JITFunction) and available()[0]:
        from triton import knobs
        from triton.runtime import driver

        _knobs, _driver = knobs, driver
        try:
            state = _Kernel(fn)
        except Exception:  # an unusual signature: Triton launches it
            state = None
    with _lock:
        _kernels[id(fn)] = (fn, state)  # holding fn keeps its id from being reused
    return state


def _hook_idle(h) -> bool:
    return h is None or (hasattr(h, "calls") and not h.calls)


def launch(fn, grid, *args, **kwargs) -> None:
    """``fn[grid](*args, **kwargs)``, through the kept compiled kernel when that is provably the same."""
    if torch.compiler.is_compiling():  # first: Dynamo folds it and traces Triton's own launch
        fn[grid](*args, **kwargs)
        return
    entry = _kernels.get(id(fn))
    st = entry[1] if entry is not None and entry[0] is fn else _kernel_state(fn)
    if st is None:
        fn[grid](*args, **kwargs)
        return
    m = _mode_override or _mode_cached or mode()
    rt = _knobs.runtime
    if (m == "off" or type(grid) is not tuple or fn.pre_run_hooks
            or not _hook_idle(rt.launch_enter_hook) or not _hook_idle(rt.launch_exit_hook)
            or getattr(rt, "add_stages_inspection_hook", None) is not None):
        _ordinary(fn, grid, args, kwargs, None, None)
        return
    try:
        values, opts = st.pack(*args, **kwargs)
    except TypeError:
        fn[grid](*args, **kwargs)  # Triton reports the bad call in its own words
        return
    types = tuple(map(type, st.get_runtime(values)))
    lay = st.layouts.get(types) or st.layout(types)
    if lay is None:
        _ordinary(fn, grid, args, kwargs, None, None)
        return
    drv = _driver.active
    device = drv.get_current_device()
    compiled, native, spec = st.devices.get(device) or st.device_state(device)
    if not native and spec is None:  # the backend's specialization cannot be reproduced here
        _counts["backend_refused"] += 1
        _ordinary(fn, grid, args, kwargs, None, None)
        return

    launch_values = values.copy()
    dtypes, aligned = lay.unpack(values, launch_values, None if native else spec)
    key = (types, lay.get_others(values), dtypes, aligned,
           tuple(opts.items()) if opts else (), fn.debug, rt.debug,
           tuple(getattr(_knobs.compilation, k, None) for k in st.knob_reads) if st.knob_reads else ())
    try:
        kernel = compiled.get(key)
    except TypeError:  # an unhashable constexpr value
        _ordinary(fn, grid, args, kwargs, None, None)
        return
    if kernel is None or (fn.used_global_vals and not _globals_unchanged(fn)):
        _ordinary(fn, grid, args, kwargs, compiled, key)
        return
    if m == "verify":
        expected = fn.run(*args, grid=grid, warmup=True, **kwargs)
        expected = expected.result() if hasattr(expected, "result") else expected
        if expected is not kernel:
            raise DispatchMismatch(f"{fn.__name__}: the kept kernel for this key is not the one Triton picks")
    n = len(grid)
    stream = drv.get_current_stream(device)
    # launch metadata only feeds launch hooks, and none is set (checked above)
    kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, kernel.function,
               kernel.packed_metadata, None, rt.launch_enter_hook, rt.launch_exit_hook, *launch_values)
    _counts["direct"] += 1


def _globals_unchanged(fn) -> bool:
    """Triton refuses a launch when a global the kernel read at compile time changed: let it say so."""
    missing = object()
    for (name, _), (val, globals_dict) in fn.used_global_vals.items():
        if globals_dict.get(name, missing) != val:
            return False
    return True


def _ordinary(fn, grid, args, kwargs, compiled, key) -> None:
    kernel = fn[grid](*args, **kwargs)
    _counts["ordinary"] += 1
    if compiled is None or key is None:
        return
    if hasattr(kernel, "result"):
        kernel = kernel.result()
    if all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
        with _lock:
            if len(compiled) < MAX_VARIANTS and key not in compiled:
                compiled[key] = kernel
                _counts["compiled_variants"] += 1
