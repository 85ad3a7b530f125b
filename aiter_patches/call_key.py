"""Keys of exactly what a gate reads of a call, so that its verdict is decided once per key.

Why: a patched entry point's gate re-derives on every call what a decode step repeats unchanged
(shapes, dtypes, strides, devices, Python values), and at decode sizes that costs the host more
than the launch it guards (issue 15). A gate whose verdict is a function of those reads alone
keeps it here: a hit reads the arguments' metadata once, into this key, and skips the checks.

What a key holds, per argument: for a plain ``torch.Tensor`` or ``torch.nn.Parameter``, its type,
shape, strides, dtype, device and ``requires_grad`` (everything a gate may read of a tensor's
metadata: ``dim()``, ``is_contiguous()``, ``numel()`` follow from them); for ``None``, a bool, int,
float, str, ``torch.dtype``, ``torch.device`` or an ``Enum`` member, its type and value (a float by
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
from typing import Any

import torch

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
    if t in _VALUE_TYPES or isinstance(v, enum.Enum):
        return (t, v)
    raise Unkeyable(t.__name__)


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


class Verdicts:
    """A gate's verdicts by key, at most ``limit`` of them (past it the gate runs per call).

    ``hits`` and ``misses`` are diagnostics, counted without a lock (a lock per call costs more than
    the count is worth): threads calling at once may lose an increment. The verdicts themselves are
    exact: a put is locked, a get is one dict lookup. The patches clear their verdicts whenever their
    wrappers are built (apply, and a revert that rebuilds a target's chain), so a patch applied again
    decides afresh."""

    __slots__ = ("name", "limit", "_d", "_lock", "hits", "misses")

    def __init__(self, name: str, limit: int = 1024):
        self.name, self.limit = name, limit
        self._d: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key):
        got = self._d.get(key)
        if got is None:
            self.misses += 1
        else:
            self.hits += 1
        return got

    def put(self, key, verdict) -> None:
        if torch.compiler.is_compiling():  # Dynamo: decided per trace, as the gate did
            return
        with self._lock:
            if len(self._d) < self.limit:
                self._d[key] = verdict

    def __len__(self) -> int:
        return len(self._d)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.hits = self.misses = 0
