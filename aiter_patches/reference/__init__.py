"""Torch references of AITER's semantics, written from the contracts in aiter-facts.md.

They are slow, readable and device-agnostic; the kernels are tested against them.
"""
