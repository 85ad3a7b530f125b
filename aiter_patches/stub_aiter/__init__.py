"""A stand-in of AITER's API surface for machines without ROCm.

The folder holds a top-level package named ``aiter`` with the functions the
patches touch, at AITER's module paths, with AITER v0.1.20's signatures and call
structure (module-global look-ups, package re-export aliases), and torch
implementations of the HIP kernels underneath. It lets the patches, their
equivalence checks and ``aiter-patches verify`` run on CPU and on NVIDIA GPUs.

It is never importable as ``aiter`` by accident: only
``aiter_patches.testing.use_stub_aiter()`` puts this folder on ``sys.path``,
and takes it (and every ``aiter`` module it loaded) off again.
"""

import os

STUB_ROOT = os.path.dirname(os.path.abspath(__file__))
