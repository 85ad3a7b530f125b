"""Replacement kernels (Triton) and their launchers. They take tensors and return tensors."""
