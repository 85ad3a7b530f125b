"""What the SGLang and vLLM test trees share: a function's source cut out of a wheel's file, and the tree on sys.path.

Each tree module (``sglang_tree.py``, ``vllm_tree.py``) writes a few of its server's real
functions over fakes of what they import; both cut those functions the same way and make the
tree importable the same way, so that code lives here once.
"""

from __future__ import annotations

import ast
import sys
from contextlib import contextmanager
from pathlib import Path


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


def segment(text: str, qualname: str) -> str:
    """The source of ``qualname`` in ``text`` (decorators included), as the wheel has it."""
    node = find(ast.parse(text), qualname)
    assert node is not None, f"{qualname} not in the wheel"
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return "\n".join(text.splitlines()[first - 1:node.end_lineno]) + "\n"


@contextmanager
def importable(root: Path, package: str):
    """``root`` first on sys.path; afterwards every patch reverted and ``package``'s modules forgotten."""
    from aiter_patches import registry

    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        registry.revert()
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]
