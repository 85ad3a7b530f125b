"""One parsed module of a source: what each top-level name is bound to, read from ``ast`` without running anything.

Why: a patch target is a name as its caller looks it up (``aiter.fused_moe.moe_sorting``),
and in AITER that name is often not defined where it is looked up: ``from aiter import f``,
``from .ops.quant import *``, a ``try``/``except ImportError`` fallback. This module records,
per module, each name's bindings (a ``def``, an import, anything else), the star imports,
``__all__`` and the module-level literal constants that defaults name (``block=BLOCK_SIZE_M``);
``resolve.py`` follows them to the definition.

A file that Python could not parse is refused here with :class:`SourceUnreadable` naming the
file and the problem (a syntax error, an expression nested too deep for the parser), never a
traceback.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Iterable

from .files import SourceUnreadable

# ast.literal_eval of a hostile literal: not a literal (ValueError), unhashable keys ({[]: 1}: TypeError),
# nested too deep (RecursionError), too large (MemoryError).
LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, OverflowError)


def parse(text: str, where: str) -> ast.Module:
    """``ast.parse``, every failure a :class:`SourceUnreadable` that names ``where`` (and the line, if known)."""
    try:
        return ast.parse(text, filename=where)
    except SyntaxError as exc:
        line = f":{exc.lineno}" if exc.lineno else ""
        raise SourceUnreadable(f"{where}{line}: {exc.msg}") from None
    except RecursionError:
        raise SourceUnreadable(f"{where}: nested too deeply for Python's parser (RecursionError)") from None
    except (ValueError, MemoryError, OverflowError) as exc:
        raise SourceUnreadable(f"{where}: cannot parse it: {type(exc).__name__}: {exc}") from None


@dataclass(frozen=True)
class Binding:
    kind: str  # "def", "import" (from X import name), "other"
    node: ast.AST
    fallback: bool  # bound in an ``except`` handler: used only when nothing else binds the name
    source_module: str | None = None  # for "import"
    source_name: str | None = None


class Module:
    """The top-level bindings of one module (``name``, read from ``path``), and its lines for source hashes.

    ``lines`` are split where Python's tokenizer and ``inspect`` split them (``\\n`` only, after
    newline normalisation), so that ``ast`` line numbers index them and a static hash equals
    the live one even when a function holds a form feed or a U+2028.
    """

    def __init__(self, name: str, path: str, is_package: bool, text: str, tree: ast.Module):
        self.name = name
        self.path = path
        self.package = name if is_package else name.rpartition(".")[0]
        self.lines = text.split("\n")
        self.bindings: dict[str, list[Binding]] = {}
        self.star_imports: list[str] = []
        self.all_names: list[str] | None = None
        self.constants: dict[str, Any] = {}
        self._collect(tree.body, fallback=False, top=True)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package.split(".")
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join(base + ([node.module] if node.module else []))

    def _bind(self, name: str, binding: Binding) -> None:
        self.bindings.setdefault(name, []).append(binding)

    def _collect(self, body: Iterable[ast.stmt], fallback: bool, top: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._bind(node.name, Binding("def", node, fallback))
            elif isinstance(node, ast.ClassDef):
                self._bind(node.name, Binding("other", node, fallback))
            elif isinstance(node, ast.ImportFrom):
                src = self._absolute(node)
                for alias in node.names:
                    if alias.name == "*":
                        self.star_imports.append(src)
                    else:
                        self._bind(alias.asname or alias.name, Binding("import", node, fallback, src, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self._bind(alias.asname or alias.name.partition(".")[0], Binding("other", node, fallback))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        self._bind(t.id, Binding("other", node, fallback))
                        self._note_constant(t.id, node.value, top)
            elif isinstance(node, ast.If):
                self._collect(node.body, fallback, False)
                self._collect(node.orelse, fallback, False)
            elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
                self._collect(node.body, fallback, False)
                self._collect(node.orelse, fallback, False)
                self._collect(node.finalbody, fallback, False)
                for handler in node.handlers:
                    self._collect(handler.body, True, False)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                self._collect(node.body, fallback, False)

    def _note_constant(self, name: str, value: ast.expr | None, top: bool) -> None:
        if value is None or not top:
            return
        if name == "__all__":
            try:
                self.all_names = [str(x) for x in ast.literal_eval(value)]
            except LITERAL_ERRORS:
                pass
            return
        try:
            self.constants[name] = ast.literal_eval(value)
        except LITERAL_ERRORS:
            self.constants.pop(name, None)

    def binding(self, name: str) -> Binding | None:
        found = self.bindings.get(name, [])
        primary = [b for b in found if not b.fallback]
        chosen = primary or found
        return chosen[-1] if chosen else None

    def exports(self, name: str) -> bool:
        """Whether ``from <this module> import *`` could bind ``name``."""
        if self.all_names is not None:
            return name in self.all_names
        return not name.startswith("_")

    def segment(self, node: ast.AST) -> list[str]:
        """The lines of ``node``'s source, its decorators included (what a source hash covers)."""
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return self.lines[first - 1 : node.end_lineno]
