"""What the environment says about the declared patches: off, disabled by name, or an opt-in left off.

- ``AITER_PATCHES=0``: every patch disabled;
- ``AITER_PATCHES_DISABLE=name1,name2``: those disabled; an unknown name is an error listing the known ones;
- ``AITER_PATCHES_INTEGRATIONS``: a patch that declares ``opt_in`` (a server integration: SGLang's or
  vLLM's own code, not AITER's) changes where that server adds its shared-expert output; users ask for
  it by name, so it is off until switched on. The value is a comma list of server groups (the
  ``opt_in`` values the declarations carry) and/or patch names; ``all`` turns on every one of them.
  An unknown word is an error naming the known ones (like ``AITER_PATCHES_DISABLE``).

Read at every ``apply()`` from the declarations alone: nothing here imports a patch.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

from .. import env_flags

ENV = "AITER_PATCHES_INTEGRATIONS"


def disabled(known: Sequence[str]) -> tuple[set[str], str]:
    """Names disabled by the environment, and the reason text; raises on unknown names."""
    if env_flags.env_false("AITER_PATCHES"):
        return set(known), "AITER_PATCHES=0"
    raw = os.environ.get("AITER_PATCHES_DISABLE", "")
    names = {n.strip() for n in raw.split(",") if n.strip()}
    unknown = sorted(names - set(known))
    if unknown:
        raise ValueError(
            f"AITER_PATCHES_DISABLE names unknown patch(es) {', '.join(unknown)}; "
            f"known patches: {', '.join(known)}"
        )
    return names, "AITER_PATCHES_DISABLE"


def check_names(names: Iterable[str] | None, known: Sequence[str], what: str) -> list[str]:
    """``names`` as a list (all ``known`` for None); an unknown one raises ``ValueError`` naming ``what``."""
    if names is None:
        return list(known)
    if isinstance(names, str):
        names = [names]
    names = list(names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{what}: unknown patch(es) {', '.join(unknown)}; known patches: {', '.join(known)}")
    return names


def requested(groups: dict[str, str]) -> set[str]:
    """The opt-in patch names switched on; ``groups`` maps each opt-in patch name to its group."""
    raw = os.environ.get(ENV, "")
    words = {w.strip() for w in raw.split(",") if w.strip()}
    if not words:
        return set()
    known = set(groups) | set(groups.values()) | {"all"}
    unknown = sorted(words - known)
    if unknown:
        raise ValueError(f"{ENV} names unknown integration(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")
    if "all" in words:
        return set(groups)
    return {name for name, group in groups.items() if name in words or group in words}


def not_switched_on(patches: Iterable) -> dict[str, str]:
    """``{patch name: reason}`` for every opt-in patch the switch leaves off."""
    groups = {p.name: p.opt_in for p in patches if getattr(p, "opt_in", None)}
    on = requested(groups)
    return {name: f"opt-in: {ENV}={group} turns it on"  # short: one status line holds every patch
            for name, group in groups.items() if name not in on}
