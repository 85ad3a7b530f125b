"""Facts about the servers' data flow that the integrations' docs state, computed from source trees (no imports of them).

A subpackage so that ``python -m aiter_patches.integrations.facts.<module>`` runs a module that the
patch discovery (which imports every module directly under ``integrations``) has not imported first.
"""
