"""Stand-in for ``aiter/__init__.py`` (ROCm/aiter v0.1.20): the package re-exports of the ops the patches touch.

Like the real package it binds every op twice (``aiter.foo`` and ``aiter.ops.X.foo``) with
``from .ops.X import *`` and does not import ``aiter.fused_moe``.
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
