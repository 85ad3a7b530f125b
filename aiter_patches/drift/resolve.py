"""From a target's module path and name to the ``def`` it is bound to, following re-exports.

Why statically and to the ``def``: ``inspect`` needs an import (ROCm, a GPU build), and
for AITER's custom-op wrapped functions it sees the wrapper's ``*args, **kwargs``; the
``def`` in the source carries the real parameters. The chain followed
(``from aiter import f``, ``from .ops.quant import *``) is kept as ``via``, so that a
report says where the name was found and how.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ..signatures import Signature, from_ast
from .modules import Module
from .tree import SourceTree


class NotFound(Exception):
    """The module or the name does not exist in the tree; the message says where it was looked for."""


@dataclass
class Definition:
    """Where a name resolved to: the ``def`` (or other binding) and the re-exports followed to it."""

    module: Module
    node: ast.AST
    via: list[str]

    @property
    def location(self) -> str:
        return f"{self.module.path}:{self.node.lineno}"

    @property
    def is_function(self) -> bool:
        return isinstance(self.node, (ast.FunctionDef, ast.AsyncFunctionDef))


def resolve(tree: SourceTree, module: str, qualname: str) -> Definition:
    """Find what ``module.qualname`` is bound to, following re-exports to the definition.

    Raises :class:`NotFound` with the reason when the module or the name does not exist.
    """
    head, _, rest = qualname.partition(".")
    d = _resolve_name(tree, module, head, [], set())
    for part in rest.split(".") if rest else []:
        if not isinstance(d.node, ast.ClassDef):
            raise NotFound(f"{module}.{qualname}: {head} is not a class")
        inner = [n for n in d.node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name == part]
        if not inner:
            raise NotFound(f"{module}.{qualname}: no {part} in class {d.node.name} ({d.location})")
        d = Definition(d.module, inner[-1], d.via)
    return d


def _resolve_name(tree: SourceTree, module: str, name: str, via: list[str], seen: set) -> Definition:
    key = (module, name)
    if key in seen:
        raise NotFound(f"circular re-export of {name} through {module}")
    seen = seen | {key}
    mod = tree.module(module)
    if mod is None:
        where = module.replace(".", "/")
        raise NotFound(f"module {module} not found ({where}.py or {where}/__init__.py)")
    b = mod.binding(name)
    if b is not None:
        if b.kind == "import":
            assert b.source_module is not None and b.source_name is not None
            step = f"{mod.path}:{b.node.lineno} from {b.source_module} import {b.source_name}"
            if b.source_module.split(".")[0] != tree.package:
                raise NotFound(f"{module}.{name} is imported from {b.source_module}, outside {tree.library} ({step})")
            return _resolve_name(tree, b.source_module, b.source_name, via + [step], seen)
        return Definition(mod, b.node, via)
    for star in reversed(mod.star_imports):  # the last star import that binds the name wins
        src = tree.module(star)
        if src is None or not src.exports(name):
            continue
        try:
            return _resolve_name(tree, star, name, via + [f"{mod.path} from {star} import *"], seen)
        except NotFound:
            continue
    raise NotFound(f"{name} is not defined in {mod.path}")


def signature_of(d: Definition) -> Signature:
    assert isinstance(d.node, (ast.FunctionDef, ast.AsyncFunctionDef))
    return from_ast(d.node, constants=d.module.constants)
