"""Server integrations: patches of SGLang's and vLLM's own code, so that stock servers reach the fusions.

Each is an ordinary registry patch (signature pins, relied-on source hashes
checked at apply time, all or nothing, revert by identity) with ``requires`` (the
server's package) and ``opt_in`` (its group): off until
``AITER_PATCHES_INTEGRATIONS=sglang`` (or ``vllm``, ``all``, or a patch name) turns it
on. Importing this package imports no server and no AITER module (nor the
registry: the registry imports ``switch`` from here; ``aiter_patches.patches``
lists the integration patches).
"""
