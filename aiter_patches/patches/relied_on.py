"""AITER functions the patches rely on without wrapping them, pinned by a hash of their source.

The drift check (`aiter-patches drift`) recomputes each hash from an AITER
release and warns when one changed: the patch may still apply, but the logic it
mirrors (the stage-1 quant dtype rule, the sort routing, the quant helper calls)
must be re-read.
"""

from ..registry import SourcePin

MOE_SORT_MX_QUANT: tuple[SourcePin, ...] = ()
MOE_ADDEND_FOLD: tuple[SourcePin, ...] = ()
SORT_EXTENSION: tuple[SourcePin, ...] = ()
GEMM_OUT_ZEROED: tuple[SourcePin, ...] = ()
