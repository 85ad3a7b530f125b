"""Stand-in for ``aiter/__init__.py`` (ROCm/aiter v0.1.20): the package re-exports of the ops the patches touch.

Like the real package it binds every op twice (``aiter.foo`` and ``aiter.ops.X.foo``) with
``from .ops.X import *`` and does not import ``aiter.fused_moe``.

Unlike it, it tells aiter_patches what it differs in, at its end (see ``aiter_patches_standin``).
"""

import logging

import torch  # noqa: F401  (AITER imports torch first; so do we)

IS_AITER_PATCHES_STAND_IN = True
__version__ = "0.1.20+aiter_patches.stand_in"

logger = logging.getLogger("aiter")

from .utility import dtypes as dtypes  # noqa: E402
from .ops.enum import *  # noqa: E402,F401,F403
from .ops.quant import *  # noqa: E402,F401,F403
from .ops.gemm_op_a8w8 import *  # noqa: E402,F401,F403
from .ops.moe_sorting import *  # noqa: E402,F401,F403
from .ops.moe_sorting_opus import *  # noqa: E402,F401,F403
from .ops.moe_op import *  # noqa: E402,F401,F403

# Not AITER's: what the stand-in differs in, told to aiter_patches' seams (its GEMM patch's
# backend, the inputs of verify's checks). No aiter_patches module knows the stand-in.
import sys as _sys  # noqa: E402

from aiter_patches_standin import check_inputs as _check_inputs, gemm_backend as _gemm_backend  # noqa: E402

_gemm_backend.register(_sys.modules[__name__])
_check_inputs.register(_sys.modules[__name__])
