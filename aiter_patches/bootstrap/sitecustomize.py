"""Applies aiter_patches in every Python process started under ``aiter-patches run``.

``aiter-patches run`` puts this folder first on ``PYTHONPATH``; Python imports
``sitecustomize`` at start-up, before the program's own code, so the patches
(or their post-import hooks) are in place before any ``from aiter... import``.
A ``sitecustomize`` that was there before (a distribution's, a venv's, a
user's) still runs: it is found on the rest of ``sys.path`` and executed
first. Nothing here may crash the host process.
"""

import importlib.machinery
import importlib.util
import os
import sys
import traceback

_HERE = os.path.dirname(os.path.realpath(__file__))


def _run_next_sitecustomize() -> None:
    """Execute the ``sitecustomize`` this one shadows, as Python would have: errors are printed, not raised."""
    try:
        rest = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or os.curdir) != _HERE]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
    except Exception:
        sys.stderr.write("Error in the sitecustomize chained by aiter_patches:\n")
        traceback.print_exc()


def _apply() -> None:
    try:
        try:
            from aiter_patches import bootstrap
        except ImportError:  # not installed for this interpreter: use the package this file belongs to
            package_parent = os.path.dirname(os.path.dirname(_HERE))
            sys.path.insert(0, package_parent)
            try:
                from aiter_patches import bootstrap
            finally:
                sys.path.remove(package_parent)
        bootstrap.start("run")
    except Exception as exc:
        sys.stderr.write(f"aiter_patches: not applied in process {os.getpid()}: {type(exc).__name__}: {exc}\n")


_run_next_sitecustomize()
_apply()
