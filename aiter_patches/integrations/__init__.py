"""Server integrations: patches of SGLang's and vLLM's own code, so that stock servers reach the fusions.

Each is an ordinary registry patch (signature pins, relied-on source hashes
checked at apply time, all or nothing, revert by identity) with ``requires`` (the
server's package), ``opt_in`` (its group) and ``needs`` (the AITER patch it hands
its calls to): off until ``AITER_PATCHES_INTEGRATIONS=sglang`` (or ``vllm``, ``all``,
or a patch name) turns it on (``core/env.py`` reads the switch). Importing this
package imports no server and no AITER module; the core finds the integration
patches through its discovery list (``core/discovery.py``).
"""
