"""What the core's bindings hold now, for tests: ``live_bindings(name)``.

Read through ``registry.visit_chains`` (the chains that hold a layer of the
patch, under the core's lock) and each module's raw ``__dict__``.
"""

from __future__ import annotations

import sys

from aiter_patches import registry
from aiter_patches.core import import_hooks
from aiter_patches.core.aliases import MISSING, get_dotted


def live_bindings(name: str) -> dict[str, str]:
    """Each location the core bound for patch ``name``: what it holds now.

    ``ours`` (the chain head the core installed), ``original`` (AITER's
    object), ``foreign`` (someone rebound it after us), ``missing``.
    """
    registry.patches()

    def visit(chain) -> list[tuple[str, str]]:
        out = []
        for mod_name, attr in sorted(chain.locations):
            d = import_hooks.module_dict(sys.modules.get(mod_name))
            head, _, rest = attr.partition(".")
            held = d.get(head, MISSING) if d is not None else MISSING
            if rest and held is not MISSING:  # a "Class.method" target: the class is in the module's dict
                held = get_dotted(held, rest)
            out.append((f"{mod_name}.{attr}", "ours" if held is chain.current else "original"
                        if held is chain.original else "missing" if held is MISSING else "foreign"))
        return out

    return dict(registry.visit_chains(name, visit))
