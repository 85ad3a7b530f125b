"""Source hashes of server functions: at apply time (live objects) and statically (a wheel's or checkout's files).

A server integration relies on the code around its hooks (where SGLang computes
the shared output, what runs between the routed call and the add), which no
signature shows. Each relied-on function is pinned by ``drift.source_hash`` of
its lines; a live function whose source differs is not patched (the patch is
skipped with the reason), and ``aiter-patches drift --server`` reports the same
from files, without importing the server.
"""

from __future__ import annotations

import ast
from typing import Any, Sequence

from ..drift import live_source_reason, source_hash


def reason(target: Any, original: Any, pins: Sequence[Any]) -> str | None:
    """The apply-time gate: the live function's source hashes to its pin (functions without a pin pass)."""
    qualname = getattr(original, "__qualname__", None)
    pin = next((p for p in pins if p.qualname == qualname), None)
    if pin is None:
        return None
    return live_source_reason(original, pin)


def find(tree: ast.Module, qualname: str) -> ast.AST | None:
    """The ``def`` named ``qualname`` (``f`` or ``Class.method``) at module level of ``tree``."""
    body: list[ast.stmt] = tree.body
    node = None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def static_hash(text: str, qualname: str) -> tuple[str | None, int | None]:
    """(hash, first line) of ``qualname``'s source in a module's text, or (None, None) when it is not defined."""
    tree = ast.parse(text)
    node = find(tree, qualname)
    if node is None:
        return None, None
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return source_hash(text.splitlines()[first - 1:node.end_lineno]), first
