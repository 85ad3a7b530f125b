"""aiter_patches: runtime patches over AMD's AITER for fewer MoE kernel launches, with the same bits.

    import aiter_patches
    aiter_patches.apply()

Each patch replaces AITER functions only when their signatures match the pins it
was written for (SIGNATURES.md), is skipped with a logged reason otherwise, and
hands any call outside its proven envelope back to AITER.

The core (``aiter_patches/core``, public face ``registry``) names no patch and no
reporter; importing the package imports the reporters, which subscribe to the
core's events (per-process summary and status lines, stats lines, foreign layers).
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
from . import foreign_layers, process_report, stats_log  # noqa: F401,E402 (they subscribe to the core's events)
from .patches.moe_addend_fold import fused_moe_with_addend
from .patches.sort_extension import SortExtension, SortExtensionError, sort_extension

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
