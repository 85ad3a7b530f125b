"""aiter_patches: runtime patches over AMD's AITER for fewer MoE kernel launches, with the same bits.

    import aiter_patches
    aiter_patches.apply()

Each patch replaces AITER functions only when their signatures match the pins it
was written for (SIGNATURES.md), is skipped with a logged reason otherwise, and
hands any call outside its proven envelope back to AITER.

The core (``aiter_patches/core``, public face ``registry``) names no patch and no
reporter; importing the package imports the reporters, which subscribe to the
core's events (per-process summary and status lines, stats lines, foreign layers, the Prometheus export).
"""

from .registry import (
    ApplyReport,
    Patch,
    PatchSkipped,
    SourcePin,
    Target,
    apply,
    register,
    reset_stats,
    revert,
    stats,
    status,
    unregister,
)
from .signatures import Pin
from . import foreign_layers, process_report, prometheus_export, stats_log  # noqa: F401,E402 (they subscribe to the core's events)
from .extensions.api import SortExtension, SortExtensionError

# Loaded at first use, not at ``import aiter_patches``: the modules behind them import torch (about 1.3 s),
# which a process that only imports the package (the auto switch's every process) must not pay.
_LAZY = {
    "fused_moe_with_addend": "aiter_patches.patches.moe_addend_fold",
    "sort_extension": "aiter_patches.patches.sort_extension",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiter_patches' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "ApplyReport",
    "Patch",
    "PatchSkipped",
    "Pin",
    "SourcePin",
    "Target",
    "SortExtension",
    "SortExtensionError",
    "apply",
    "fused_moe_with_addend",
    "register",
    "reset_stats",
    "revert",
    "sort_extension",
    "stats",
    "status",
    "unregister",
    "__version__",
]
