"""The core: the only code that changes AITER's namespaces, and it names no patch.

A patch is declared as data (``declarations.py``: targets, accepted signature
pins, a wrapper factory, the patches it needs); the core performs it: all or
nothing per patch, only when every target's signature matches a pin, at once
or the moment AITER's module is imported, on every module-level alias of the
original, chained with other patches on the same target in declared order,
after the patches it needs, idempotent, thread-safe, fork-safe and exactly
revertible. ``aiter_patches.registry`` is its public face.

One job per module, each importing only those listed before it:

- ``events``: what the core tells the modules above it (states changed, fork), and the fields they add to records;
- ``declarations``: ``Patch``, ``Target``, ``SourcePin``, ``Site``, the states (no state of its own);
- ``env``: ``AITER_PATCHES``, ``AITER_PATCHES_DISABLE``, the opt-in switch ``AITER_PATCHES_INTEGRATIONS``;
- ``import_hooks``: when a module has finished executing, without executing anything;
- ``state``: the tables (declared patches, states, counters, chains, watches) and the one lock;
- ``needs``: declared needs: apply order, pending and skipped dependents, revert order;
- ``discovery``: where patches come from (the discovery list of packages, an entry-point group);
- ``chains``: several patches on one target composed in declared order;
- ``aliases``: binding a chain's head at its home and at every alias; foreign wrappers taken off and put back;
- ``disarm``: a reverted wrapper's code swapped for a pass-through;
- ``revert``: one patch off, its dependents first;
- ``catalog``: register, unregister, the list of patches (discovered at first need);
- ``install``: one patch on, all or nothing;
- ``status``: records, ``status()``, ``stats()``, counters;
- ``fork``: the package's one fork handler;
- ``apply``: ``apply()``, ``revert()``, and the post-import path of pending patches.

Reporting (``process_report``, ``stats_log``, ``foreign_layers``) subscribes to
``events``; patches are found through ``discovery``. The core imports neither.
"""
