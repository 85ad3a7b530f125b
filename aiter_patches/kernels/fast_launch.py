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

:class:`Prepared` goes one step further for a kernel API that keeps per-shape plans: the grid
and every non-tensor argument are bound once, and a call reads only the tensors' part of the key.

The cache holds compiled kernels and keys made of Python scalars and dtypes: never a tensor,
so nothing created during a CUDA-graph capture outlives it, and it never syncs the device. A
launch inside a capture is recorded like Triton's (same launcher, same stream). It is bounded
over a server's life: :data:`MAX_KERNELS` kernels, :data:`MAX_VARIANTS` argument patterns and
keys per kernel and device, 64 keys per :class:`Prepared`; past a cap, ordinary launches.
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
from ..core import events
from . import device_stream

MAX_VARIANTS = 4096  # keys per kernel and device (ints are keyed by value); past it: ordinary launches
MAX_KERNELS = 256  # JITFunctions seen (the package has a handful); past it a new one gets ordinary launches

# The kwargs Triton's run() folds into the options, and where it reads them (checked against
# the installed source: a Triton that adds another one turns the fast path off).
_KNOWN_RUN_KWARGS = {"debug", "instrumentation_mode", "fpsan_homomorphic_casts"}


class DispatchMismatch(AssertionError):
    """Verify mode: the cached kernel is not the one Triton would have launched."""


class WrongDevice(ValueError):
    """A launch's tensors are on another GPU than the current one: Triton launches on the current device
    (AITER's own ops guard their tensors' device), so its kernel would run there on the other GPU's memory."""


def _refuse_other_device(t, current: int | None = None) -> None:
    """Raise :class:`WrongDevice` when ``t`` (a launch's first tensor) is on a GPU other than the current one
    (``current``, else asked)."""
    index = t.get_device()  # -1 off CUDA/HIP (the interpreter, the CPU proxy)
    if index < 0:
        return
    if current is None:
        current = device_stream.current_index()
    if index != current:
        raise WrongDevice(f"the launch's tensors are on cuda:{index}, the current device is cuda:{current}: "
                          f"Triton launches on the current device; call under torch.cuda.device({index})")


_lock = threading.Lock()
_kernels: dict[int, tuple[Any, "_Kernel | None"]] = {}  # id(fn) -> (fn, state); None: never direct; MAX_KERNELS
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
    if len(_kernels) >= MAX_KERNELS:  # kernels made at run time, one per call: never kept, Triton launches them
        return None
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


def _renew_lock_after_fork() -> None:
    """``FORK_RENEW``: a fresh lock in a forked child (issue 31): a thread of the parent may have held it while
    keeping a kernel, and that thread is gone. Never blocks."""
    global _lock
    _lock = threading.Lock()


events.subscribe(events.FORK_RENEW, _renew_lock_after_fork)


def _hook_idle(h) -> bool:
    return h is None or (hasattr(h, "calls") and not h.calls)


def launch(fn, grid, *args, **kwargs):
    """``fn[grid](*args, **kwargs)``, through the kept compiled kernel when that is provably the same.

    Returns the compiled kernel when it is the one kept for this call's full key (a direct launch,
    or the ordinary launch that just kept it), else None (:class:`Prepared` keeps only those)."""
    if torch.compiler.is_compiling():  # first: Dynamo folds it and traces Triton's own launch
        fn[grid](*args, **kwargs)
        return
    for a in args:  # the gates check that a launch's tensors share one device: its first tensor says which
        if isinstance(a, torch.Tensor):
            _refuse_other_device(a)
            break
    entry = _kernels.get(id(fn))
    st = entry[1] if entry is not None and entry[0] is fn else _kernel_state(fn)
    if st is None:
        fn[grid](*args, **kwargs)
        return None
    m = _mode_override or _mode_cached or mode()
    rt = _knobs.runtime
    if (m == "off" or type(grid) is not tuple or fn.pre_run_hooks
            or not _hook_idle(rt.launch_enter_hook) or not _hook_idle(rt.launch_exit_hook)
            or getattr(rt, "add_stages_inspection_hook", None) is not None):
        return _ordinary(fn, grid, args, kwargs, None, None)
    try:
        values, opts = st.pack(*args, **kwargs)
    except TypeError:
        fn[grid](*args, **kwargs)  # Triton reports the bad call in its own words
        return None
    types = tuple(map(type, st.get_runtime(values)))
    lay = st.layouts.get(types) or st.layout(types)
    if lay is None:
        return _ordinary(fn, grid, args, kwargs, None, None)
    drv = _driver.active
    device = drv.get_current_device()
    compiled, native, spec = st.devices.get(device) or st.device_state(device)
    if not native and spec is None:  # the backend's specialization cannot be reproduced here
        _counts["backend_refused"] += 1
        return _ordinary(fn, grid, args, kwargs, None, None)

    launch_values = values.copy()
    dtypes, aligned = lay.unpack(values, launch_values, None if native else spec)
    key = (types, lay.get_others(values), dtypes, aligned,
           tuple(opts.items()) if opts else (), fn.debug, rt.debug,
           tuple(getattr(_knobs.compilation, k, None) for k in st.knob_reads) if st.knob_reads else ())
    try:
        kernel = compiled.get(key)
    except TypeError:  # an unhashable constexpr value
        return _ordinary(fn, grid, args, kwargs, None, None)
    if kernel is None or (fn.used_global_vals and not _globals_unchanged(fn)):
        return _ordinary(fn, grid, args, kwargs, compiled, key)
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
    return kernel


def _globals_unchanged(fn) -> bool:
    """Triton refuses a launch when a global the kernel read at compile time changed: let it say so."""
    missing = object()
    for (name, _), (val, globals_dict) in fn.used_global_vals.items():
        if globals_dict.get(name, missing) != val:
            return False
    return True


def _ordinary(fn, grid, args, kwargs, compiled, key):
    kernel = fn[grid](*args, **kwargs)
    _counts["ordinary"] += 1
    if compiled is None or key is None:
        return None
    if hasattr(kernel, "result"):
        kernel = kernel.result()
    if all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
        with _lock:
            if len(compiled) < MAX_VARIANTS and key not in compiled:
                compiled[key] = kernel
                _counts["compiled_variants"] += 1
            if compiled.get(key) is kernel:
                return kernel
    return None


# ------------------------------------------------------------------ prepared launches

class Prepared:
    """One launch whose grid and non-tensor arguments are fixed: ``prep(*tensors)`` is
    ``launch(fn, grid, *args, **kwargs)`` with the tensors put in their places.

    Why: a kernel API that caches its per-shape plan (sizes, grid, constexprs) would still pay
    :func:`launch`'s argument binding and full-key build on every call (a few µs for a
    50-parameter kernel). Here all of that is done once; a call reads, per tensor, only what the
    key reads of it (type, dtype, 16-byte alignment, and the backend's own specialization when it
    has one) plus the device, the debug flags and the knobs, and keeps the compiled kernel under
    those alone: the fixed arguments are the same by construction. The first call of each such
    key, and every call the fast path cannot prove (hooks, verify/off mode, torch.compile, the
    interpreter, changed globals), goes through :func:`launch` itself, which decides exactly as it
    does for any call; only a kernel :func:`launch` returns (kept for the full key) is kept here.
    Holds Python scalars, dtypes and compiled kernels: never a tensor.
    """

    __slots__ = ("fn", "grid", "args", "kwargs", "tensor_at", "_st", "_unpack", "_go", "_kernels", "_knob_values")

    def __init__(self, fn, grid: tuple, tensor_at: tuple, args: tuple, kwargs: dict):
        """``args`` with ``None`` at the positions ``tensor_at`` (filled per call, in that order). An
        entry of ``tensor_at`` may be a tuple of positions: one tensor, passed at each of them (a kernel
        API that hands one buffer to several parameters; a call reads it once)."""
        self.fn, self.grid = fn, tuple(grid)
        self.tensor_at = tuple(p if type(p) is tuple else (p,) for p in tensor_at)
        positions = {p for group in self.tensor_at for p in group}
        self.args, self.kwargs = tuple(args), dict(kwargs)
        fixed = [v for i, v in enumerate(self.args) if i not in positions] + list(self.kwargs.values())
        if any(isinstance(v, torch.Tensor) for v in fixed):
            raise TypeError("Prepared: a tensor among the fixed arguments (pass it per call, through tensor_at)")
        self._kernels: dict[tuple, Any] = {}
        self._st = self._unpack = self._go = self._knob_values = None
        if torch.compiler.is_compiling():
            return
        entry = _kernels.get(id(fn))
        st = entry[1] if entry is not None and entry[0] is fn else _kernel_state(fn)
        if st is None or type(self.grid) is not tuple or not 1 <= len(self.grid) <= 3:
            return
        marks = [object() for _ in self.tensor_at]
        args_ = list(self.args)
        for m, group in zip(marks, self.tensor_at):
            for pos in group:
                args_[pos] = m
        try:
            values, opts = st.pack(*args_, **self.kwargs)
        except TypeError:
            return  # launch() lets Triton report the bad call
        slot = {id(m): j for j, m in enumerate(marks)}
        params: list[list[int]] = [[] for _ in marks]
        for i, v in enumerate(values):
            j = slot.get(id(v))
            if j is not None:
                params[j].append(i)
        if any(len(got) != len(group) for got, group in zip(params, self.tensor_at)):
            return
        taken = {i for got in params for i in got}
        others = [v for i, v in enumerate(values) if i not in taken]
        if not all(type(v) in (int, bool, float, type(None), str) or _is_dtype(v) for v in others):
            return  # a value whose keying launch() would refuse: always through launch()
        self._st = st
        self._unpack, self._go = _make_prepared_code(values, params)
        if st.knob_reads and all(hasattr(_knobs.compilation, k) for k in st.knob_reads):
            get = operator.attrgetter(*st.knob_reads)
            self._knob_values = get if len(st.knob_reads) > 1 else (lambda c: (get(c),))
        else:
            names = st.knob_reads
            self._knob_values = lambda c: tuple(getattr(c, k, None) for k in names)

    def call_args(self, tensors) -> tuple[list, dict]:
        """The ``(args, kwargs)`` of the equivalent ``launch(fn, grid, *args, **kwargs)``."""
        args = list(self.args)
        for group, t in zip(self.tensor_at, tensors):
            for pos in group:
                args[pos] = t
        return args, self.kwargs

    def __call__(self, *tensors) -> None:
        st = self._st
        m = _mode_override or _mode_cached or mode()
        if st is None or m != "on" or torch.compiler.is_compiling():
            return self._through_launch(tensors, None)
        fn = self.fn
        rt = _knobs.runtime
        enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
        if (fn.pre_run_hooks or not (enter is None or _hook_idle(enter)) or not (exit_ is None or _hook_idle(exit_))
                or getattr(rt, "add_stages_inspection_hook", None) is not None):
            return self._through_launch(tensors, None)
        drv = _driver.active
        device = drv.get_current_device()
        if tensors:
            _refuse_other_device(tensors[0], device)
        compiled, native, spec = st.devices.get(device) or st.device_state(device)
        dyn, ptrs = self._unpack(None if native else spec, *tensors)
        key = (device, dyn, fn.debug, rt.debug, self._knob_values(_knobs.compilation))
        kernel = self._kernels.get(key)
        if kernel is None or (fn.used_global_vals and not _globals_unchanged(fn)):
            return self._through_launch(tensors, key)
        self._go(kernel.run, self.grid, drv.get_current_stream(device), kernel.function, kernel.packed_metadata,
                 enter, exit_, ptrs)
        _counts["direct"] += 1
        return None

    def _through_launch(self, tensors, key) -> None:
        args, kwargs = self.call_args(tensors)
        kernel = launch(self.fn, self.grid, *args, **kwargs)
        if key is not None and kernel is not None and len(self._kernels) < 64:
            self._kernels[key] = kernel
        return None


def _is_dtype(v) -> bool:
    return isinstance(v, torch.dtype) or type(v).__name__ == "dtype"


def _make_prepared_code(values: list, params: list[list[int]]):
    """``unpack(spec, *tensors) -> (key part, launcher values of the tensors)`` and
    ``go(run, grid, stream, function, metadata, enter, exit, ptrs)``, straight-line for these
    positions (``params[j]``: where tensor ``j`` goes among the values); ``go`` hands the launcher
    every argument in parameter order, as :func:`launch` does."""
    n = len(params)
    ts = ", ".join(f"t{j}" for j in range(n))
    lines = [f"def unpack(spec{', ' if n else ''}{ts}):"]
    for j in range(n):
        lines.append(f"    p{j} = t{j}.data_ptr()")
    key = ", ".join(f"type(t{j}), t{j}.dtype, not p{j} & 15" for j in range(n))
    ptrs = ", ".join(f"p{j} if t{j}.is_cuda else t{j}" for j in range(n))
    extra = ", ".join(f"spec(t{j}, align=True)" for j in range(n))
    c = "," if n else ""
    lines += ["    if spec is None:", f"        return ({key}{c}), ({ptrs}{c})",
              f"    return ({key}{c} {extra}{c}), ({ptrs}{c})"]
    ns: dict[str, Any] = {}
    slot = {i: j for j, where in enumerate(params) for i in where}
    argv = []
    for i, v in enumerate(values):
        if i in slot:
            argv.append(f"P[{slot[i]}]")
        else:
            ns[f"c{i}"] = v
            argv.append(f"c{i}")
    lines += ["def go(run, grid, stream, function, meta, enter, exit_, P):",
              "    n = len(grid)",
              "    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, function, meta, None,",
              f"        enter, exit_{', ' if argv else ''}{', '.join(argv)})"]
    exec("\n".join(lines) + "\n", ns)  # noqa: S102 - generated from integer positions only
    return ns["unpack"], ns["go"]


def run_prepared(prep: Prepared, current_launch, tensors) -> None:
    """``prep``'s launch, or, where a kernel module's ``launch`` was replaced (tests replay launches),
    the same call through that replacement (``current_launch`` is the module's ``launch`` now)."""
    if current_launch is launch:
        prep(*tensors)
    else:
        args, kwargs = prep.call_args(tensors)
        current_launch(prep.fn, prep.grid, *args, **kwargs)
