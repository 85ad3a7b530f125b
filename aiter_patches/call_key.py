"""Keys of exactly what a gate reads of a call, so that its verdict is decided once per key.

Why: a patched entry point's gate re-derives on every call what a decode step repeats unchanged
(shapes, dtypes, strides, devices, Python values), and at decode sizes that costs the host more
than the launch it guards (issue 15). A gate whose verdict is a function of those reads alone
keeps it here: a hit reads the arguments' metadata once, into this key, and skips the checks.

What a key holds, per argument: for a plain ``torch.Tensor`` or ``torch.nn.Parameter``, its type,
shape, strides, dtype, device and ``requires_grad`` (everything a gate may read of a tensor's
metadata: ``dim()``, ``is_contiguous()``, ``numel()`` follow from them); for ``None``, a bool, int,
float, str, ``torch.dtype``, ``torch.device``, an ``Enum`` member or a member of a pybind11 enum (real
AITER's ``ActivationType`` and ``QuantType``, built in C++, which servers pass to ``fused_moe``), its
type and value (a float by
``float.hex``: exact for every finite value and the infinities, -0.0 is not 0.0, and every NaN, whatever
its sign and payload, is the one key ``'nan'``, as NaN != NaN would make a dead entry per call; no gate
tells NaNs apart). Anything
else (a tensor subclass, a list, an object) makes the call unkeyable: its gate runs in full, every
call. Positional and keyword arguments are keyed as given (names and order), so the binding is the
same for every call of a key. A call's key is one flat tuple: each positional argument's fields, then
each keyword's name and fields (a tuple per argument inside a tuple of arguments cost twice as much
to build and to hash, issue 15). It is exact all the same: an argument's fields start with its type,
which says how many follow (six for a tensor, two for anything else), and a keyword starts with its
name, a str, never a type, so two keys are equal only if every argument, in order, is. Never a data pointer or a tensor's contents: a key never syncs the
device, and it holds no tensor (shapes, dtypes and devices are values), so a verdict made during a
CUDA-graph capture keeps nothing of it. The caller adds to the key whatever else its gate reads
(module constants, the grad mode, AITER's module), by identity or value.
"""

from __future__ import annotations

import enum
import itertools
import threading
import weakref
from typing import Any

import torch

from .core import events

_compiling = torch.compiler.is_compiling
KEYED_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_VALUE_TYPES = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device})


class Unkeyable(Exception):
    """An argument whose gate-relevant state is not captured by a key: the gate runs in full."""


def value_key(v) -> tuple:
    """What a gate may read of one argument, as a hashable tuple holding no tensor."""
    t = type(v)
    if t in KEYED_TENSOR_TYPES:
        return (t, v.shape, v.stride(), v.dtype, v.device, v.requires_grad)
    if t is float:
        return (t, v.hex())
    if t in _VALUE_TYPES or isinstance(v, enum.Enum) or is_pybind_enum(t):
        return (t, v)
    raise Unkeyable(t.__name__)


def is_pybind_enum(t: type) -> bool:
    """Whether ``t`` is a pybind11 enum class (``py::enum_``, as AITER's C++-built ``ActivationType``): its
    metaclass is pybind11's and it holds pybind11's table of members. A member holds its C++ value, which
    Python cannot change, and hashes and compares by it; a key holds the type before it."""
    return type(t).__name__ == "pybind11_type" and isinstance(t.__dict__.get("__entries"), dict)


def args_key(args: tuple, kwargs: dict) -> tuple:
    """The key of a call's arguments as given, one flat tuple (see the module's docstring; raises
    :class:`Unkeyable`, also under torch.compile's tracing: Dynamo decides per trace, through the gate
    in full)."""
    if _compiling():
        raise Unkeyable("torch.compile tracing")
    types = tuple(map(type, args))
    keyer = _KEYERS.get(types)
    if keyer is None:
        keyer = _keyer(types)
    head = keyer(args) if keyer is not False else tuple(itertools.chain.from_iterable(map(value_key, args)))
    for k, v in kwargs.items():  # a call's few keywords: a concatenation each costs less than a chain
        head += (k,) + value_key(v)
    return head


_KEYERS: dict[tuple, Any] = {}  # positional types -> straight-line key function (False: value_key per argument)
MAX_KEYERS = 256  # past it a new pattern takes value_key per argument (no code generated per call)


def _keyer(types: tuple):
    """``f(args) -> the fields of value_key(a) for every a in args, in one tuple``, generated for these positional types
    (plain tensors and value types only: an Enum or anything else takes value_key per argument)."""
    if len(_KEYERS) >= MAX_KEYERS:
        return False
    if not all(t in KEYED_TENSOR_TYPES or t in _VALUE_TYPES for t in types):
        fn = False
    else:
        ns: dict[str, Any] = {f"T{i}": t for i, t in enumerate(types)}
        items = [f"T{i}, a[{i}].shape, a[{i}].stride(), a[{i}].dtype, a[{i}].device, a[{i}].requires_grad"
                 if t in KEYED_TENSOR_TYPES else f"T{i}, a[{i}].hex()" if t is float else f"T{i}, a[{i}]"
                 for i, t in enumerate(types)]
        exec(f"def key(a):\n    return ({', '.join(items)}{',' if items else ''})\n", ns)  # noqa: S102 - positions only
        fn = ns["key"]
    _KEYERS[types] = fn
    return fn


def split_key(args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """``(key, tensors)``: the call's key as :func:`args_key` gives it, less the plain tensors' strides,
    dtypes, devices and ``requires_grad``, which a :func:`tensor_guard` over ``tensors`` (those tensors,
    in order) checks instead; their types are in the key (its first item names the arguments' layout:
    every positional type, every keyword's name and type, in order) and so are their shapes (a decode
    step's token count changes call to call: keyed, never scanned). Raises :class:`Unkeyable` as
    :func:`args_key` does. Why: reading and hashing a tensor's metadata in Python costs the host about
    as much as the check it saves (issue 15); torch's own guard checks it in C++."""
    if _compiling():
        raise Unkeyable("torch.compile tracing")
    layout = (*map(type, args), *kwargs, *map(type, kwargs.values()))
    split = _SPLITTERS.get(layout)
    if split is None:
        split = _splitter(layout, len(args), tuple(kwargs))
    if split is False:
        return args_key(args, kwargs), ()
    try:
        return split(args, kwargs)
    except KeyError:  # a keyword name equal to a plain str's but hashing otherwise: keyed by args_key
        return args_key(args, kwargs), ()


_SPLITTERS: dict[tuple, Any] = {}  # layout -> straight-line split function (False: args_key, all in the key)


def meta_key(args: tuple, kwargs: dict) -> tuple:
    """The key of a call's arguments as given for a decision that reads of a plain tensor its type, shape,
    dtype and device only, no guard: :func:`split_key`'s key with each tensor's dtype and device after its
    shape. Values, layouts and what is unkeyable as there (raises :class:`Unkeyable`). Why: the fold's
    self-check finds a call's plan by it on every call (``moe_addend_fold/first_calls.py``); torch's
    guard over a ``fused_moe`` call's eight tensors costs the host about what the plan key it saves does."""
    if _compiling():
        raise Unkeyable("torch.compile tracing")
    layout = (*map(type, args), *kwargs, *map(type, kwargs.values()))
    keyer = _META_KEYERS.get(layout)
    if keyer is None:
        keyer = _splitter(layout, len(args), tuple(kwargs), meta=True)
    if keyer is False:
        return args_key(args, kwargs)  # finer (strides, requires_grad), never equal to a generated key
    try:
        return keyer(args, kwargs)
    except KeyError:  # a keyword name equal to a plain str's but hashing otherwise: keyed by args_key
        return args_key(args, kwargs)


_META_KEYERS: dict[tuple, Any] = {}  # layout -> straight-line meta_key function (False: args_key)


def _splitter(layout: tuple, n: int, names: tuple, meta: bool = False):
    """``f(args, kwargs) -> (key, tensors)`` for one layout (plain tensors, value types and Enum members,
    pybind11's included, only; anything else, or past :data:`MAX_KEYERS` layouts: False, the call keyed by :func:`args_key`).
    The key's first item is ``f`` itself: one object per layout, alive as long as any key holds it.
    ``meta``: ``f(args, kwargs) -> key`` for :func:`meta_key` instead (each tensor's shape, dtype and device)."""
    made = _META_KEYERS if meta else _SPLITTERS
    if len(made) >= MAX_KEYERS:
        return False
    types = layout[:n] + layout[n + len(names):]
    if not all(t in KEYED_TENSOR_TYPES or t in _VALUE_TYPES or issubclass(t, enum.Enum) or is_pybind_enum(t)
               for t in types) or not all(
            type(name) is str for name in names):
        fn = False  # a keyword name of a str subclass (its own hash or eq): keyed by args_key
    else:
        ns: dict[str, Any] = {f"N{j}": name for j, name in enumerate(names)}  # names as constants, never as code
        where = [f"a[{i}]" for i in range(n)] + [f"k[N{j}]" for j in range(len(names))]
        items, tensors = [], []
        for w, t in zip(where, types):
            if t in KEYED_TENSOR_TYPES:
                items.append(f"{w}.shape, {w}.dtype, {w}.device" if meta else f"{w}.shape")
                tensors.append(w)
            else:
                items.append(f"{w}.hex()" if t is float else w)
        if meta:
            exec(f"def split(a, k):\n    return (S, {', '.join(items)})\n", ns)  # noqa: S102 - positions and N<j> only
        else:
            exec(f"def split(a, k):\n    return (S, {', '.join(items)}), ({', '.join(tensors)}{',' if tensors else ''})\n", ns)  # noqa: S102 - positions and N<j> only
        fn = ns["S"] = ns["split"]
    made[layout] = fn
    return fn


def value_split(v) -> tuple[tuple, tuple]:
    """One argument as :func:`split_key` splits it: ``(key part, (v,) for a plain tensor else ())``."""
    t = type(v)
    if t in KEYED_TENSOR_TYPES:
        return (t, v.shape), (v,)
    return value_key(v), ()


def _always(*tensors) -> bool:
    return True


def tensor_guard(tensors: tuple):
    """``check(*tensors) -> bool``: True when called with tensors of these types, shapes, strides, dtypes,
    devices and ``requires_grad``. torch's own ``TensorGuards`` where it passed :func:`native_guards`' self
    test (it also checks the dispatch keys, and on some torch versions the grad mode: finer, never
    coarser; it fails a call that passes one tensor twice, so such tensors get the Python guard); else
    the same fields read in Python. It holds no tensor (a guard made during a CUDA-graph
    capture keeps nothing of it)."""
    if not tensors:
        return _always
    native = _NATIVE[0] if _NATIVE else native_guards()
    if native is not None and len(set(map(id, tensors))) == len(tensors):  # it refuses one tensor given twice
        return native(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                      dynamic_dims_strides=[list(t.stride()) for t in tensors]).check
    fields = tuple(map(value_key, tensors))
    return lambda *ts: tuple(map(value_key, ts)) == fields


_NATIVE: list = []  # [TensorGuards or None], decided once


def native_guards():
    """torch's ``TensorGuards`` (``torch._C._dynamo.guards``, what torch.compile checks its graphs'
    tensors with) if it is there and tells apart, here, every field this module keys; else None (the
    Python guard). Decided once per process, at the first :meth:`GuardedVerdicts.clear` (the patches
    clear their verdicts when their wrappers are built: at apply) or the first guard made. Its tensors
    are CPU and meta ones only: run inside a CUDA-graph capture, it records nothing."""
    if _NATIVE:
        return _NATIVE[0]
    got = None
    try:
        from torch._C._dynamo.guards import TensorGuards

        class _Sub(torch.Tensor):
            pass

        def make(t):
            return TensorGuards(t, dynamic_dims_sizes=[list(t.shape)], dynamic_dims_strides=[list(t.stride())]).check

        cpu = torch.device("cpu")
        base = torch.zeros(2, 3, device=cpu)
        check = make(base)
        alive = weakref.ref(base)
        del base  # freed at once unless the guard holds it (no cycle: no collection needed)
        others = [torch.zeros(3, 2, device=cpu), torch.zeros(3, 2, device=cpu).t(),
                  torch.zeros(2, 3, dtype=torch.float64, device=cpu), torch.zeros(2, 3, requires_grad=True, device=cpu),
                  torch.nn.Parameter(torch.zeros(2, 3, device=cpu)), torch.zeros(2, 3, device=cpu).as_subclass(_Sub),
                  torch.zeros(2, 3, device="meta")]
        if alive() is None and check(torch.ones(2, 3, device=cpu)) is True and not any(check(o) for o in others):
            got = TensorGuards
    except Exception:  # noqa: BLE001 - no such API in this torch, or it differs: the Python guard
        got = None
    _NATIVE.append(got)
    return got


class GuardedVerdicts:
    """A gate's verdicts by :func:`split_key`-style key and :func:`tensor_guard`, at most ``limit`` of them.

    Under one key, up to :data:`MAX_PER_KEY` verdicts, each with the guard of the tensors it was
    decided for (the same shapes, other strides or dtypes, say); a get is one dict lookup and the
    guards' checks, in order. ``hits`` and ``misses`` are diagnostics, counted without a lock (a lock per call costs more than
    the count is worth: threads calling at once may lose an increment); a put is locked and replaces
    the key's tuple (a get in another thread reads the old one or the new one). The patches clear their
    verdicts whenever their wrappers are built (apply, and a revert that rebuilds a target's chain), so a
    patch applied again decides afresh."""

    MAX_PER_KEY = 8
    __slots__ = ("name", "limit", "_d", "_lock", "hits", "misses", "_n", "__weakref__")

    def __init__(self, name: str, limit: int = 1024):
        self.name, self.limit = name, limit
        self._d: dict[tuple, tuple] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = self._n = 0
        _ALL_VERDICTS.add(self)

    def get(self, key, tensors: tuple):
        for check, verdict in self._d.get(key, ()):
            if check(*tensors):
                self.hits += 1
                return verdict
        self.misses += 1
        return None

    def put(self, key, tensors: tuple, verdict) -> None:
        if torch.compiler.is_compiling() or self._n >= self.limit:  # Dynamo: decided per trace; full: no guard made
            return
        entry = (tensor_guard(tensors), verdict)
        with self._lock:
            got = self._d.get(key, ())
            if self._n < self.limit and len(got) < self.MAX_PER_KEY:
                self._d[key] = got + (entry,)
                self._n += 1

    def __len__(self) -> int:
        return self._n

    def clear(self) -> None:
        native_guards()  # decided here, at apply, rather than at a first put inside a capture
        with self._lock:
            self._d.clear()
            self.hits = self.misses = self._n = 0


_ALL_VERDICTS: "weakref.WeakSet[GuardedVerdicts]" = weakref.WeakSet()


def _renew_locks_after_fork() -> None:
    """``FORK_RENEW``: every verdict table's lock fresh in a forked child (issue 31): a thread of the parent may
    have held one while putting a verdict, and that thread is gone. Never blocks."""
    for verdicts in list(_ALL_VERDICTS):
        verdicts._lock = threading.Lock()


events.subscribe(events.FORK_RENEW, _renew_locks_after_fork)
