"""The package's rules for its environment variables: yes/no words, and numbers.

Yes/no: ``1``/``true``/``yes``/``on`` and their opposites. Why one module: the
strict switch, the on/off switch, the auto ``.pth`` line and the fast-launch mode
each parsed these words themselves. Numbers (:func:`positive_number`, and
:func:`integer` for AITER's own variables that a patch mirrors): a value that
breaks the rule (``-5``, ``abc``, ``inf``, ``1e999``, ``²``) is never silently
ignored and never raises: one warning naming the variable and the rule, then
the default. It imports only ``os`` at import time, so the bootstrap and the
``.pth`` line's text can use it at no cost.
"""

from __future__ import annotations

import math
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


_warned: set[tuple[str, str]] = set()


def positive_number(name: str, default, *, whole: bool = False, zero_ok: bool = False,
                    maximum: float | None = None, unit: str = "", default_text: str | None = None):
    """Environment variable ``name`` as a positive finite number (``whole``: ASCII digits only, an ``int``;
    ``zero_ok``: 0 allowed; ``maximum``: at most that); unset or empty: ``default``.

    Any other value logs one warning per variable and value on the ``aiter_patches``
    logger (naming the variable, the value and the rule) and gives ``default``.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    value = _parse(raw, whole)
    low_ok = value is not None and (value > 0 or (zero_ok and value == 0))
    if low_ok and (maximum is None or value <= maximum):
        return value
    if (name, raw) not in _warned:
        _warned.add((name, raw))
        import logging

        rule = f"{'a whole number' if whole else 'a number'}{' of ' + unit if unit else ''}, " \
               f"{'0 or more' if zero_ok else 'more than 0'}" + (f", at most {maximum:g}" if maximum is not None else "")
        shown = default_text if default_text is not None else str(default)
        logging.getLogger("aiter_patches").warning("%s=%r ignored: the rule is %s; using the default (%s)",
                                                   name, raw, rule, shown)
    return default


def _parse(raw: str, whole: bool):
    """``raw`` as an int (``whole``: ASCII digits only) or a finite float; None if it is neither."""
    if whole:
        return int(raw) if raw.isascii() and raw.isdigit() else None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def integer(name: str, default: int) -> int:
    """Environment variable ``name`` as an integer (any sign; unset or empty: ``default``), for the variables
    of AITER's that a patch mirrors: never raises; anything else warns once and gives ``default``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    body = raw[1:] if raw[:1] in "+-" else raw
    if body.isascii() and body.isdigit():
        return int(raw)
    if (name, raw) not in _warned:
        _warned.add((name, raw))
        import logging

        logging.getLogger("aiter_patches").warning("%s=%r ignored: the rule is a whole number; using the default (%s)",
                                                   name, raw, default)
    return default
