"""One package's source as the drift check sees it: its files, its parsed modules, its version.

Why one class for AITER and the servers: a patch target is a module path and a
name whether it lives in ``aiter`` or in ``sglang``/``vllm``; only the package
differs. A tree reads a module the first time a target needs it, parses it once,
and keeps it; imports that leave the package are not followed (a server's
``from aiter.fused_moe import fused_moe`` is AITER's business, checked against
AITER's source).
"""

from __future__ import annotations

import ast
from typing import Protocol

from .files import SourceUnreadable
from .modules import LITERAL_ERRORS, Module, parse

# Where a package spells its version, first found wins (setuptools-scm writes _version.py).
VERSION_FILES = ("_version.py", "version.py")


class Files(Protocol):
    def exists(self, rel: str) -> bool: ...

    def read(self, rel: str) -> str: ...


def assigned_version(tree: ast.Module, where: str = "<version file>") -> str | None:
    """The string a module assigns to ``__version__`` or ``version`` at its top level, if any.

    A value that is not a literal (``get_version()``) is no version; a literal that cannot be
    evaluated (``{[]: 1}``, which fails at import too) makes the file unreadable.
    """
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in ("__version__", "version") for t in node.targets
        ):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            except LITERAL_ERRORS as exc:
                raise SourceUnreadable(f"{where}:{node.lineno}: the version cannot be evaluated: "
                                       f"{type(exc).__name__}: {exc}") from None
            if isinstance(value, str):
                return value
    return None


class SourceTree:
    """The files of one ``package``'s source, addressed by POSIX paths relative to the directory holding it."""

    def __init__(self, package: str, files: Files, description: str):
        self.package = package
        self.library = "AITER" if package == "aiter" else package  # the report's first word
        self.files = files
        self.description = description
        self._modules: dict[str, Module | None] = {}
        if not self.exists(f"{package}/__init__.py"):
            article = "an" if self.library == "AITER" else "a"
            raise SourceUnreadable(f"{description}: no {package}/__init__.py (not {article} {self.library} source)")

    def exists(self, rel: str) -> bool:
        return self.files.exists(rel)

    def read(self, rel: str) -> str:
        return self.files.read(rel)

    def version(self) -> str | None:
        """The version as the package's version file spells it, without importing it."""
        for name in VERSION_FILES:
            rel = f"{self.package}/{name}"
            if self.exists(rel):
                found = assigned_version(parse(self.read(rel), self._where(rel)), self._where(rel))
                if found is not None:
                    return found
        return None

    def module(self, name: str) -> Module | None:
        """The parsed module ``name`` (``aiter.fused_moe`` -> ``aiter/fused_moe.py`` or its package)."""
        if name not in self._modules:
            self._modules[name] = self._load(name)
        return self._modules[name]

    def _load(self, name: str) -> Module | None:
        base = name.replace(".", "/")
        for rel, is_package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
            if self.exists(rel):
                text = self.read(rel)
                return Module(name, rel, is_package, text, parse(text, self._where(rel)))
        return None

    def _where(self, rel: str) -> str:
        return f"{self.description}: {rel}"
