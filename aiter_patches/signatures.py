"""Signature pins: one normal form for a function's parameters, however we read it.

A patch may only replace an AITER function whose parameters it understands. The
same signature reaches us three ways: from a live function (``inspect``), from a
registered custom-op schema (AITER's ``@compile_ops``/``@torch_compile_guard``
wrappers report ``(*args, **kwargs)``), and from source text read statically
(the drift check, and the pins themselves, which are written as source text).
All three normalize to :class:`Signature`, so a pin written once compares equal
to every reading of the same AITER function. Annotations are ignored; defaults
are compared by normalized text, enum members by ``Class.Member`` name.
"""

from __future__ import annotations

import ast
import enum
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

POSITIONAL_ONLY = "positional-only"
POSITIONAL_OR_KEYWORD = "positional-or-keyword"
VAR_POSITIONAL = "var-positional"
KEYWORD_ONLY = "keyword-only"
VAR_KEYWORD = "var-keyword"

_KIND_FROM_INSPECT = {
    inspect.Parameter.POSITIONAL_ONLY: POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: POSITIONAL_OR_KEYWORD,
    inspect.Parameter.VAR_POSITIONAL: VAR_POSITIONAL,
    inspect.Parameter.KEYWORD_ONLY: KEYWORD_ONLY,
    inspect.Parameter.VAR_KEYWORD: VAR_KEYWORD,
}

# Source expressions whose runtime value cannot be read without importing AITER
# (and ROCm). Each maps to the normal form of the value it evaluates to.
KNOWN_DEFAULT_EXPRESSIONS: dict[str, str] = {
    "GateMode.SEPARATED.value": "'separated'",
    "GateMode.INTERLEAVE.value": "'interleave'",
    "dtypes.fp4x2": "torch.float4_e2m1fn_x2",
    "dtypes.bf16": "torch.bfloat16",
    "dtypes.fp16": "torch.float16",
    "dtypes.fp32": "torch.float32",
    "dtypes.i32": "torch.int32",
    "dtypes.fp8_e8m0": "torch.float8_e8m0fnu",
}


class SignatureUnavailable(Exception):
    """The signature of a live object cannot be determined; the message says why."""


@dataclass(frozen=True)
class Param:
    name: str
    kind: str
    default: str | None = None  # normalized text; None means "no default"

    def __str__(self) -> str:
        prefix = {VAR_POSITIONAL: "*", VAR_KEYWORD: "**"}.get(self.kind, "")
        return f"{prefix}{self.name}" + ("" if self.default is None else f"={self.default}")


@dataclass(frozen=True)
class Signature:
    params: tuple[Param, ...]

    @classmethod
    def parse(cls, text: str) -> "Signature":
        """Parse pin syntax: a parenthesized Python parameter list, e.g. ``(a, b=None, *, c=1)``."""
        try:
            tree = ast.parse(f"def _pin{text.strip()}:\n    pass\n")
        except SyntaxError as exc:
            raise ValueError(f"not a parameter list: {text!r} ({exc.msg})") from None
        return from_ast(tree.body[0])

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def positional_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if p.kind in (POSITIONAL_ONLY, POSITIONAL_OR_KEYWORD))

    def param(self, name: str) -> Param | None:
        for p in self.params:
            if p.name == name:
                return p
        return None

    def __str__(self) -> str:
        parts: list[str] = []
        saw_star = False
        for i, p in enumerate(self.params):
            if p.kind == KEYWORD_ONLY and not saw_star:
                parts.append("*")
                saw_star = True
            if p.kind == VAR_POSITIONAL:
                saw_star = True
            parts.append(str(p))
            nxt = self.params[i + 1] if i + 1 < len(self.params) else None
            if p.kind == POSITIONAL_ONLY and (nxt is None or nxt.kind != POSITIONAL_ONLY):
                parts.append("/")
        return "(" + ", ".join(parts) + ")"

    def is_opaque(self) -> bool:
        """``(*args, **kwargs)`` alone: the shape of a wrapper that hides the real parameters."""
        kinds = [p.kind for p in self.params]
        return bool(kinds) and set(kinds) <= {VAR_POSITIONAL, VAR_KEYWORD}


def normalize_value(value: Any) -> str:
    """Normal text of a runtime default value."""
    if isinstance(value, enum.Enum) or (
        hasattr(type(value), "__members__") and isinstance(getattr(value, "name", None), str)
    ):  # Python enums, and pybind11 enums such as AITER's C++-built ActivationType
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    mod = type(value).__module__
    if mod == "torch" and type(value).__name__ == "dtype":
        return str(value)  # "torch.bfloat16"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(normalize_value(v) for v in value)
        return f"({inner},)" if isinstance(value, tuple) and len(value) == 1 else (
            f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
        )
    return repr(value)


def normalize_expression(node: ast.expr, constants: Mapping[str, Any] | None = None) -> str:
    """Normal text of a default written in source."""
    try:
        return normalize_value(ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    text = ast.unparse(node)
    if constants and isinstance(node, ast.Name) and node.id in constants:
        return normalize_value(constants[node.id])
    return KNOWN_DEFAULT_EXPRESSIONS.get(text, text)


def from_ast(func: ast.FunctionDef | ast.AsyncFunctionDef, constants: Mapping[str, Any] | None = None) -> Signature:
    """Signature of a function definition read from source (no import)."""
    a = func.args
    params: list[Param] = []
    positional = list(a.posonlyargs) + list(a.args)
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = POSITIONAL_ONLY if i < len(a.posonlyargs) else POSITIONAL_OR_KEYWORD
        params.append(Param(arg.arg, kind, None if default is None else normalize_expression(default, constants)))
    if a.vararg is not None:
        params.append(Param(a.vararg.arg, VAR_POSITIONAL))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        params.append(Param(arg.arg, KEYWORD_ONLY, None if default is None else normalize_expression(default, constants)))
    if a.kwarg is not None:
        params.append(Param(a.kwarg.arg, VAR_KEYWORD))
    return Signature(tuple(params))


def from_inspect(sig: inspect.Signature) -> Signature:
    params = tuple(
        Param(
            p.name,
            _KIND_FROM_INSPECT[p.kind],
            None if p.default is inspect.Parameter.empty else normalize_value(p.default),
        )
        for p in sig.parameters.values()
    )
    return Signature(params)


def from_schema(schema: Any) -> Signature:
    """Signature of a registered torch custom op (``torch.ops.ns.name.default._schema``)."""
    params: list[Param] = []
    for arg in schema.arguments:
        has_default = getattr(arg, "has_default_value", None)
        has = has_default() if callable(has_default) else arg.default_value is not None
        default = normalize_value(_schema_default(arg)) if has else None
        kind = KEYWORD_ONLY if getattr(arg, "kwarg_only", False) else POSITIONAL_OR_KEYWORD
        params.append(Param(arg.name, kind, default))
    return Signature(tuple(params))


# c10::ScalarType codes: a schema reports a dtype default as its code (bf16 is 15)
_SCALAR_TYPE_CODES = {5: "float16", 6: "float32", 7: "float64", 15: "bfloat16", 24: "float8_e4m3fn",
                      26: "float8_e4m3fnuz"}


def _schema_default(arg: Any) -> Any:
    value = arg.default_value
    if isinstance(value, int) and not isinstance(value, bool) and "ScalarType" in str(getattr(arg, "real_type", arg.type)):
        import torch

        name = _SCALAR_TYPE_CODES.get(value)
        return getattr(torch, name) if name is not None else value
    return value


def torch_op_schema(fn: Callable, namespaces: Sequence[str], op_names: Sequence[str] = ()) -> Any | None:
    """The schema of the torch custom op ``fn`` stands for, or None: the one place that reads torch's ``_schema``.

    ``torch.ops.<ns>.<name>.default._schema`` is torch's private attribute, so it
    is read here only, for the first namespace that registers ``fn.__name__`` (or
    the name of what ``fn.__wrapped__`` is, then ``op_names``); an op without a ``default``
    overload, a namespace that raises, or a torch without the attribute: None.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    candidates = [getattr(fn, "__name__", None), getattr(getattr(fn, "__wrapped__", None), "__name__", None),
                  *op_names]
    for ns in namespaces:
        for name in candidates:
            if not name:
                continue
            try:
                packet = getattr(getattr(torch.ops, ns), name)
                return packet.default._schema
            except (AttributeError, RuntimeError):
                continue
    return None


def from_callable(fn: Callable, *, schema_namespaces: Sequence[str] = ("aiter",),
                  op_names: Sequence[str] = ()) -> Signature:
    """Signature of a live callable, seeing through custom-op wrappers.

    Raises :class:`SignatureUnavailable` when the runtime signature is the
    opaque ``(*args, **kwargs)`` of a wrapper and no registered op schema says
    what the real parameters are. ``op_names``: op names to try besides the
    callable's own (AITER's ``torch_compile_guard`` returns a ``wrapper_custom``
    over ``torch.ops.aiter.<the attribute's name>``).
    """
    try:
        sig = from_inspect(inspect.signature(fn))
    except (TypeError, ValueError) as exc:
        raise SignatureUnavailable(f"inspect.signature failed: {exc}") from None
    if not sig.is_opaque():
        return sig
    schema = torch_op_schema(fn, schema_namespaces, op_names)
    if schema is not None:
        return from_schema(schema)
    name = getattr(fn, "__name__", repr(fn))
    raise SignatureUnavailable(
        f"{name} reports only {sig} (a custom-op wrapper) and no torch.ops."
        f"{'/'.join(schema_namespaces)}.{name} schema is registered"
    )


def diff(expected: Signature, found: Signature) -> list[str]:
    """Human-readable differences, empty when the signatures are equal."""
    if expected == found:
        return []
    out: list[str] = []
    exp_names = expected.names()
    found_names = found.names()
    for i, name in enumerate(exp_names):
        if name not in found_names:
            out.append(f"missing parameter '{name}' (position {i})")
    for i, name in enumerate(found_names):
        if name not in exp_names:
            out.append(f"extra parameter '{found.params[i]}' at position {i}")
    common_exp = [n for n in exp_names if n in found_names]
    common_found = [n for n in found_names if n in exp_names]
    if common_exp != common_found:
        for name in common_exp:
            ei, fi = common_exp.index(name), common_found.index(name)
            if ei != fi:
                out.append(
                    f"parameter '{name}' moved from position {exp_names.index(name)} "
                    f"to {found_names.index(name)}"
                )
    for name in common_exp:
        e, f = expected.param(name), found.param(name)
        assert e is not None and f is not None
        if e.kind != f.kind:
            out.append(f"parameter '{name}' changed kind: {e.kind} -> {f.kind}")
        if e.default != f.default:
            before = "no default" if e.default is None else e.default
            after = "no default" if f.default is None else f.default
            out.append(f"default of '{name}' changed: {before} -> {after}")
    if not out:  # same names, kinds and defaults, different positions of extras: say it plainly
        out.append(f"expected {expected}, found {found}")
    return out


@dataclass(frozen=True)
class Pin:
    """One accepted signature of a target, with where it was read from."""

    label: str  # e.g. "v0.1.20"
    text: str  # pin syntax, e.g. "(a, b=None)"
    source: str = ""  # e.g. "ROCm/aiter v0.1.20 aiter/fused_moe.py:171"

    @property
    def signature(self) -> Signature:
        return _parse_cached(self.text)


_PARSED: dict[str, Signature] = {}


def _parse_cached(text: str) -> Signature:
    sig = _PARSED.get(text)
    if sig is None:
        sig = _PARSED[text] = Signature.parse(text)
    return sig


def match(found: Signature, pins: Iterable[Pin]) -> tuple[Pin | None, list[str]]:
    """The pin equal to ``found``, else ``(None, differences from the closest pin)``."""
    best: tuple[int, Pin | None, list[str]] = (1 << 30, None, [])
    for pin in pins:
        d = diff(pin.signature, found)
        if not d:
            return pin, []
        if len(d) < best[0]:
            best = (len(d), pin, d)
    _, closest, differences = best
    if closest is not None:
        differences = [f"vs pin {closest.label}: {x}" for x in differences]
    return None, differences


class Binder:
    """Turns ``(args, kwargs)`` of a call into ``{name: value}`` for one pinned signature, cheaply.

    Wrappers run on every MoE call; ``inspect.Signature.bind`` costs several
    microseconds, this a dict build. Parameters not passed are simply absent:
    the wrapper supplies the defaults it relies on.
    """

    __slots__ = ("positional", "names", "required", "_leading")

    def __init__(self, sig: Signature):
        self.positional = sig.positional_names()
        self.names = frozenset(p.name for p in sig.params if p.kind not in (VAR_POSITIONAL, VAR_KEYWORD))
        self.required = tuple(p.name for p in sig.params
                              if p.default is None and p.kind not in (VAR_POSITIONAL, VAR_KEYWORD))
        # a call with at least this many positional arguments gives every required parameter
        self._leading = (len(self.positional) + 1 if any(n not in self.positional for n in self.required)
                         else max((self.positional.index(n) + 1 for n in self.required), default=0))

    def bind(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """Return ``(arguments, problems)``: the named arguments, and what the pin does not explain
        (a required parameter not given is one: the function itself raises its TypeError for it)."""
        if len(args) > len(self.positional):
            return {}, [f"{len(args)} positional arguments (the pin takes {len(self.positional)})"]
        bound = dict(zip(self.positional, args))
        if kwargs:
            if self.names.issuperset(kwargs) and bound.keys().isdisjoint(kwargs):  # the usual call: no problem
                bound.update(kwargs)
            else:
                problems = [f"unknown keyword '{k}'" for k in kwargs if k not in self.names]
                problems += [f"'{k}' given twice" for k in kwargs if k in bound]
                bound.update(kwargs)
                return bound, problems
        if len(args) < self._leading:
            missing = [n for n in self.required if n not in bound]
            if missing:
                return bound, [f"required argument{'s' if len(missing) > 1 else ''} not given: {', '.join(missing)}"]
        return bound, []
