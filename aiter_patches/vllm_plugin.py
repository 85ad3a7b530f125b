"""vLLM general plugin: the patches in every vLLM process (API server, engine core, each worker).

vLLM calls every ``vllm.general_plugins`` entry point (this package declares
``aiter_patches = aiter_patches.vllm_plugin:register``) in each process it
creates, before that process loads a model, and possibly more than once per
process. ``register()`` is idempotent; a process where vLLM already imported
AITER still gets the patches at every ``from aiter... import`` alias, and its
summary line names them. ``VLLM_PLUGINS`` (a comma list of plugin names) limits
which plugins load: include ``aiter_patches`` in it if you set it.
``AITER_PATCHES=0`` turns the patches off.
"""

from __future__ import annotations


def register() -> None:
    from .bootstrap import start

    start("vllm_plugin")
