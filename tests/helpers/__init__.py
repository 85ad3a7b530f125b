"""Reusable test helpers (not part of the aiter_patches package)."""
