"""The package's one rule for yes/no environment variables: ``1``/``true``/``yes``/``on`` and their opposites.

Why one module: the strict switch, the on/off switch, the auto ``.pth`` line and
the fast-launch mode each parsed these words themselves. It imports only ``os``,
so the bootstrap and the ``.pth`` line's text can use it at no cost.
"""

from __future__ import annotations

import os

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def is_true(value: str) -> bool:
    """``value`` says yes (any case, spaces around ignored)."""
    return value.strip().lower() in TRUE_WORDS


def is_false(value: str) -> bool:
    """``value`` says no (any case, spaces around ignored)."""
    return value.strip().lower() in FALSE_WORDS


def env_true(name: str) -> bool:
    """Environment variable ``name`` says yes; unset or anything else: no."""
    return is_true(os.environ.get(name, ""))


def env_false(name: str) -> bool:
    """Environment variable ``name`` says no; unset or anything else: not no."""
    return is_false(os.environ.get(name, ""))
