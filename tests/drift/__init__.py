"""Tests of the static drift check and of apply() on real AITER code."""
